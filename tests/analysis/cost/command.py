"""`qkv cost` as the command line runs it, for the tests of its sections."""

from __future__ import annotations

import argparse

from qkv.commands import cost as cost_command


def run_cost(capsys, *argv: str) -> tuple[int, str, str]:
    """`qkv cost *argv` in this process: (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="qkv")
    cost_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["cost", *argv])
    code = args.run(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
