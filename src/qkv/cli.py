"""The `qkv` command. Each sub-command lives in `qkv.commands.<name>` and is thin: it parses,
calls one library function, prints. Modules are imported lazily inside each `run`, so
`qkv --help` stays fast."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from qkv.commands import (
    bench,
    chat,
    check,
    cost,
    embed,
    generate,
    report,
    sample,
    study,
    train,
    translate,
    viz,
)
from qkv.version import __version__

_COMMANDS = (
    train, translate, check, embed, generate, chat, sample, cost, bench, viz, report, study,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv", description="Attention and the Transformer, proved against PyTorch."
    )
    parser.add_argument("--version", action=_Version, help="print the version of qkv and exit")
    commands = parser.add_subparsers(dest="command", metavar="command")
    for command in _COMMANDS:
        command.add_parser(commands)
    parser.set_defaults(run=lambda args: print_help(parser))
    return parser


def print_help(parser: argparse.ArgumentParser) -> int:
    """What a command run without its sub-command does: the full help, not a terse error."""
    parser.print_help()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a reader gone away shows here, not at exit, where it can't be caught
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        return _interrupted(args)
    return status


def _interrupted(args: argparse.Namespace) -> int:
    """Ctrl-C: one line instead of a traceback, and the status of a process ended by SIGINT
    (128 + 2). Nothing is lost: a training run goes on from its last checkpoint."""
    name = " ".join(part for part in ("qkv", args.command, getattr(args, "task", None)) if part)
    resume = ""
    if args.command == "train" and getattr(args, "out", None):
        resume = f"; resume from the last checkpoint in {args.out} with --resume"
    print(f"{name}: interrupted{resume}", file=sys.stderr)
    return 130


def version() -> str:
    """The installed distribution's version, else the package's own."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("qkv")
    except PackageNotFoundError:
        return __version__


class _Version(argparse.Action):
    """--version, looked up only when asked for (argparse's own takes the string up front)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


def _reader_gone() -> int:
    """`qkv cost --json | head -1`: the reader closed the pipe. Stop quietly, as Unix tools
    do, with the status of a process killed by SIGPIPE (128 + 13). Python flushes stdout
    again at exit and would print "Exception ignored ... BrokenPipeError", so stdout now
    points at /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout with no file descriptor (captured in tests)
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
