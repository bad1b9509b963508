"""The `qkv` command. Each sub-command lives in `qkv.commands.<name>` and is thin: it parses,
calls one library function, prints. Modules are imported lazily inside each `run`, so
`qkv --help` stays fast."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qkv.commands import (
    bench,
    check,
    cost,
    embed,
    generate,
    report,
    train,
    translate,
    viz,
)

_COMMANDS = (train, translate, check, embed, generate, cost, bench, viz, report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv", description="Attention and the Transformer, proved against PyTorch."
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    for command in _COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
