"""The study record: JSON round trip, the Markdown page, the index, the report section and
the command's errors. (Each study's own run is tested in its file, at its tiny size.)"""

from __future__ import annotations

import ast
import json
import math
import re
import sys

import pytest

from qkv.cli import main
from qkv.studies import STUDIES, report_section, run_study, write_index
from qkv.studies.record import (
    StudyResult,
    beyond_noise,
    machine,
    markdown,
    read_result,
    write_result,
)


def _result() -> StudyResult:
    return StudyResult(
        name="example", title="An example", claim="Numbers behave (Someone et al. 2020).",
        columns=["what", "value", "count"],
        rows=[{"what": "a", "value": 0.123456, "count": 12345}, {"what": "b", "value": None}],
        findings=["a is 0.123."], series={"x": [1, 2]}, settings={"steps": 3}, seed=7,
        command="qkv study example", machine=machine(), seconds=1.5,
    )  # fmt: skip


def test_json_round_trip_and_markdown(tmp_path):
    result = _result()
    paths = write_result(result, tmp_path)
    assert sorted(paths) == ["json", "md"]  # no figure given: no PNG
    assert read_result(paths["json"]) == result
    data = json.loads(paths["json"].read_text())
    assert {"command", "seed", "machine", "settings"} <= set(data)
    assert data["machine"]["cpu_model"] and "aten_capability" in data["machine"]["isa"]
    page = paths["md"].read_text()
    assert page == markdown(result, figure=False)
    assert "| a | 0.123 | 12,345 |" in page and "| b | - | - |" in page
    assert "- a is 0.123." in page and "seed 7" in page
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_index_and_report_section_list_every_result(tmp_path):
    write_result(_result(), tmp_path)
    index = write_index(tmp_path).read_text()
    assert "[An example](example.md)" in index and "- a is 0.123." in index
    body = report_section(tmp_path)
    assert "<h3>An example</h3>" in body and "<td>0.123</td>" in body
    assert report_section(tmp_path / "missing") is None


def test_run_study_refuses_bad_arguments_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"^name: expected one of"):
        run_study("nope", out=tmp_path)
    name = next(iter(STUDIES))
    with pytest.raises(ValueError, match=r"^size: expected one of"):
        run_study(name, size="huge", out=tmp_path)
    with pytest.raises(ValueError, match=r"^seed: expected an int >= 0"):
        run_study(name, seed=-1, out=tmp_path)
    with pytest.raises(ValueError, match=r"^overrides: \['no_such_setting'\]"):
        run_study(name, size="tiny", out=tmp_path, no_such_setting=1)


def test_command_lists_studies_and_reports_errors_in_one_line(capsys, tmp_path):
    assert main(["study", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in STUDIES)
    assert main(["study", "nope", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("qkv study: error: name: expected one of")
    assert main(["study", next(iter(STUDIES)), "--set", "oops", "--out", str(tmp_path)]) == 1
    assert "--set: expected KEY=VALUE" in capsys.readouterr().err


def test_cells_of_non_finite_values_stay_readable(tmp_path):
    result = _result()
    result.rows = [{"what": "c", "value": math.inf, "count": 1}]
    assert "| c | inf | 1 |" in markdown(result, figure=False)


def test_the_command_names_only_the_files_it_wrote(capsys, tmp_path, monkeypatch):
    """Without matplotlib no figure is drawn: the command says so, and names the JSON and the
    page, never a PNG it did not write."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    assert main(["study", "softmax", "--size", "tiny", "--out", str(tmp_path)]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("wrote ") and "softmax.json" in said and "softmax.md" in said
    assert ".png" not in said and not (tmp_path / "softmax.png").exists()
    assert json.loads((tmp_path / "softmax.json").read_text())["name"] == "softmax"
    assert "files" not in json.loads((tmp_path / "softmax.json").read_text())


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        ("train_steps=0", ValueError, "train_steps: expected an int in [1, 60000]"),
        ("batch_size=-4", ValueError, "batch_size: expected an int in [1, 1600]"),
        ("vocab_size=1000000000", ValueError, "vocab_size: expected an int in [1, 102400]"),
        ("kv_heads=[4, -1]", ValueError, "kv_heads: expected an int in [1, 800]"),
        (
            "learning_rate=1e999",
            ValueError,
            "learning_rate: expected a finite number >= 0, got inf",
        ),
        ("train_steps=2.5", TypeError, "train_steps: expected an int like 3, got 2.5"),
        ("head_counts=4", TypeError, "head_counts: expected a non-empty list like [1, 4]"),
    ],
)
def test_study_settings_are_checked_before_the_study_runs(capsys, tmp_path, setting, error,
                                                           message):  # fmt: skip
    """Negative counts, zero steps and sizes of 10^9 gave tracebacks (or ran for ever); each
    is one line naming the setting, from the command and from run_study alike."""
    assert main(["study", "heads", "--size", "tiny", "--set", setting, "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"qkv study: error: {message}")
    key, _, text = setting.partition("=")
    with pytest.raises(error, match=re.escape(message)):
        run_study("heads", size="tiny", out=None, **{key: ast.literal_eval(text)})
    assert not list(tmp_path.iterdir())


def test_beyond_noise_needs_the_gap_to_clear_the_spread_either_way():
    assert beyond_noise(0.2, 0.1) == "supported"
    assert beyond_noise(-0.2, 0.1) == "not supported"
    assert beyond_noise(0.1, 0.1) == beyond_noise(-0.05, 0.1) == "mixed"
