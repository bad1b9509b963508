"""`qkv check`: sanity checks of attention and the Transformer against PyTorch, as a table,
then what this machine supports (`qkv.capabilities`)."""

from __future__ import annotations

import argparse


def _check(args: argparse.Namespace) -> int:
    """Run the sanity checks and print them as a table; exit status 1 if any failed."""
    import torch

    from qkv.analysis import run_checks
    from qkv.capabilities import describe

    torch.set_num_threads(max(1, min(torch.get_num_threads(), args.threads)))
    results = run_checks(seed=args.seed)
    width = max(len(r.description) for r in results)
    print(f"qkv check: {len(results)} sanity checks, against PyTorch {torch.__version__}")
    print(f"{'':4} {'check':{width}}  {'':4}  measured")
    for r in results:
        print(
            f"{r.label:4} {r.description:{width}}  {'ok' if r.passed else 'FAIL':4}  {r.measured}"
        )
    failed = [r.label for r in results if not r.passed]
    print(
        f"{len(results) - len(failed)}/{len(results)} passed"
        + (f"; failed: {' '.join(failed)}" if failed else "")
    )
    print("\nthis machine (the CPU fast paths each take only what it supports):")
    for line in describe().splitlines():
        print(f"  {line}")
    return 1 if failed else 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "check", help="run the sanity checks of attention and the Transformer against PyTorch"
    )
    check.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    check.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    check.set_defaults(run=_check)
