"""The `qkv` command: `qkv check` runs every sanity check and fails loudly when one fails."""

import subprocess
import sys

import pytest

from qkv.analysis import sanity
from qkv.cli import main


def test_check_passes_and_prints_every_row(capsys):
    assert main(["check"]) == 0
    printed = capsys.readouterr().out
    for label in "abcdefghijklmnopqrs":
        assert f"({label})" in printed
    assert "FAIL" not in printed and "19/19 passed" in printed


def test_a_failing_check_makes_the_command_fail(capsys, monkeypatch):
    monkeypatch.setattr(sanity, "_CHECKS", [*sanity._CHECKS, ("(z)", "broken", lambda: 1 / 0)])
    assert main(["check"]) == 1
    printed = capsys.readouterr().out
    assert "(z)" in printed and "raised ZeroDivisionError" in printed and "failed: (z)" in printed


def test_help_lists_every_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "check" in result.stdout and "sanity checks" in result.stdout


def test_unknown_subcommand_is_an_error():
    with pytest.raises(SystemExit):
        main(["nonsense"])
