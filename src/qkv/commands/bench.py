"""`qkv bench`: measurements you can rerun. `qkv bench complexity`: time and memory against L."""

from __future__ import annotations

import argparse
import sys

from qkv.commands import _progress
from qkv.commands._device import check_device

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def _complexity(args: argparse.Namespace) -> int:
    """Run the doubling benchmark, print the table; optionally write JSON and a plot."""
    import json

    import torch

    from qkv.analysis.cost.complexity_report import format_table, plot_complexity

    dtype = getattr(torch, _DTYPES[args.dtype])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), args.threads)))
    try:
        check_device(device, allowed=("cpu", "cuda"))  # timing waits for CUDA only, not MPS
        result = _measure(args, dtype, device)
        print(format_table(result))
        if args.json is not None:
            with open(args.json, "w", encoding="utf-8") as file:
                json.dump(result.to_dict(), file, indent=2)
            print(f"wrote {args.json}", file=sys.stderr)
        if args.plot is not None:
            plot_complexity(result).savefig(args.plot, dpi=120)
            print(f"wrote {args.plot}", file=sys.stderr)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as error:
        print(f"qkv bench complexity: error: {error}", file=sys.stderr)
        return 1
    return 0


def _measure(args: argparse.Namespace, dtype, device: str):
    """measure_complexity with the flags, and a bar of the lengths measured."""
    from qkv.analysis.cost.complexity import measure_complexity

    bar = _progress.progress(len(set(args.lengths)), desc="complexity", unit="length")
    try:
        return measure_complexity(
            lengths=args.lengths, backends=args.backends, batch=args.batch, heads=args.heads,
            head_dim=args.head_dim, causal=args.causal, backward=args.backward, dtype=dtype,
            device=device, repeats=args.repeats, max_memory=int(args.max_memory * 2**30),
            fit_from=args.fit_from, progress=lambda message: _one_length(bar, message),
        )  # fmt: skip
    finally:
        bar.close()


def _one_length(bar: _progress.Progress, message: str) -> None:
    """A length measured: its timings stay as a line above the bar, which moves on."""
    _progress.say(message)
    bar.update(1)


def _add_complexity(benches: argparse._SubParsersAction) -> None:
    complexity = benches.add_parser(
        "complexity",
        help="time and memory vs L for naive, SDPA and tiled attention (the O(L^2) table)",
        description="The doubling benchmark of attention's cost: per backend and L, median time "
        "and measured peak memory, their ratio to the previous L, and the fitted exponent p of "
        "cost ~ L^p.",
    )
    complexity.add_argument(
        "--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048], metavar="L",
        help="sequence lengths (default 256 512 1024 2048)",
    )  # fmt: skip
    complexity.add_argument(
        "--backends", nargs="+", choices=("naive", "sdpa", "tiled"),
        default=["naive", "sdpa", "tiled"], help="which to compare (default all three)",
    )  # fmt: skip
    complexity.add_argument("--batch", type=int, default=1, help="B (default 1)")
    complexity.add_argument("--heads", type=int, default=8, help="H (default 8)")
    complexity.add_argument("--head-dim", type=int, default=64, help="D (default 64)")
    complexity.add_argument("--causal", action="store_true", help="causal self-attention")
    complexity.add_argument("--backward", action="store_true", help="time forward + backward")
    complexity.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="default fp32")
    complexity.add_argument("--repeats", type=int, default=3, help="timed samples (default 3)")
    complexity.add_argument(
        "--max-memory", type=float, default=4.0, metavar="GIB",
        help="skip a backend at an L whose predicted peak exceeds this many GiB (default 4)",
    )  # fmt: skip
    complexity.add_argument(
        "--fit-from", type=int, metavar="L",
        help="fit exponents over lengths >= L (default: the median length and above)",
    )  # fmt: skip
    complexity.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    complexity.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    complexity.add_argument("--plot", metavar="PNG", help="save a log-log plot here")
    complexity.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    complexity.set_defaults(run=_complexity)


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="benchmarks: qkv bench complexity (time, memory vs L)"
    )
    benches = bench.add_subparsers(dest="bench", metavar="benchmark")
    bench.set_defaults(run=lambda args: _print_help(bench))  # `qkv bench` alone
    _add_complexity(benches)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0
