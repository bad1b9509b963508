"""`qkv study NAME`: run one of the papers' claims as an experiment, write JSON + Markdown +
PNG (and the folder's index) into --out. `qkv study list` names them."""

from __future__ import annotations

import argparse
import sys

from qkv.commands import _progress


def _study(args: argparse.Namespace) -> int:
    from qkv.studies import STUDIES, run_study, study_module

    if args.name == "list":
        for name in STUDIES:
            print(f"{name:16s} {study_module(name).TITLE}")
        return 0
    try:
        overrides = dict(_setting(text) for text in args.set)
        with _progress.log_lines("qkv.studies", prefix=f"{args.name}: "):
            result = run_study(args.name, size=args.size, seed=args.seed, out=args.out, **overrides)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv study: error: {error}", file=sys.stderr)
        return 1
    for finding in result.findings:
        print(f"- {finding}")
    written = ", ".join(str(path) for path in result.files.values())
    print(f"wrote {written} ({result.seconds:.0f} s)")
    return 0


def _setting(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as a Python literal when it is one (8, 0.5, [64, 128])."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set: expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def add_parser(commands: argparse._SubParsersAction) -> None:
    study = commands.add_parser(
        "study",
        help="run a claim of the papers as an experiment: JSON + Markdown + PNG",
        description="Each study trains or measures something small on data shipped with qkv "
        "and writes NAME.json (command, seed, machine), NAME.md and NAME.png into --out. "
        "`qkv study list` names the studies.",
    )
    study.add_argument("name", help="the study, or 'list'")
    study.add_argument(
        "--size", default="default", choices=("tiny", "default"),
        help="default: minutes on 2 CPU cores; tiny: seconds, for a quick look",
    )  # fmt: skip
    study.add_argument("--seed", type=int, default=0, help="the seed of every draw (0)")
    study.add_argument("--out", default="studies", help="folder of the results (studies)")
    study.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="replace one setting of the study for this run (repeatable)",
    )  # fmt: skip
    study.set_defaults(run=_study)
