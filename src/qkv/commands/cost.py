"""`qkv cost`: parameters, FLOPs, score-matrix and KV-cache memory of presets or checkpoints;
with --context-parallel/--fsdp, the per-process plan of training past one process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _cost(args: argparse.Namespace) -> int:
    """Print one column per model, or the table of every preset when no model is named."""
    from qkv.analysis.cost.estimate import cost_report
    from qkv.analysis.cost.format import format_presets, format_report
    from qkv.analysis.cost.sources import preset_names

    names = args.models or preset_names()
    try:
        reports = [
            cost_report(name, context=args.context, dtype=args.dtype or "fp16", batch=args.batch)
            for name in names
        ]
    except (ValueError, TypeError) as error:
        print(f"qkv cost: error: {error}", file=sys.stderr)
        return 1
    if args.context_parallel or args.fsdp:
        return _parallel(args, names)
    if args.json:
        print(json.dumps([dataclasses.asdict(report) for report in reports], indent=2))
    elif args.models:
        print(format_report(reports))
    else:
        print(format_presets(reports))
    return 0


def _parallel(args: argparse.Namespace, names: list[str]) -> int:
    """The per-process plan of training on --context-parallel x --fsdp processes."""
    from qkv.analysis.cost.parallel import format_parallel, parallel_training_cost

    if not args.models:
        print("qkv cost: error: --context-parallel/--fsdp: name the MODEL to plan", file=sys.stderr)
        return 1
    try:
        plans = [
            parallel_training_cost(
                name,
                context_parallel=args.context_parallel or 1,
                fsdp=args.fsdp or 1,
                context=args.context,
                batch=args.batch,
                dtype=args.dtype or "fp32",
            )  # fmt: skip
            for name in names
        ]
    except (ValueError, TypeError) as error:
        print(f"qkv cost: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([dataclasses.asdict(plan) for plan in plans], indent=2))
    else:
        print(format_parallel(plans))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    cost = commands.add_parser(
        "cost",
        help="parameters, FLOPs, score-matrix and KV-cache memory of a preset or checkpoint",
        description="Costs from formulas alone (no weights are read). With no MODEL, a table "
        "of every preset.",
    )
    cost.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="a preset (e.g. llama-2-70b, gpt2, bert-base-uncased, vit-base-16), a checkpoint "
        "folder or a "
        "config.json",
    )
    cost.add_argument(
        "--context", type=int, help="tokens per sequence (default: each model's max_positions)"
    )
    cost.add_argument(
        "--dtype",
        help="fp32, fp16 or bf16: bytes per element (default fp16; fp32 when planning training)",
    )
    cost.add_argument("--batch", type=int, default=1, help="sequences per batch (default 1)")
    cost.add_argument("--json", action="store_true", help="print the reports as JSON")
    cost.add_argument(
        "--context-parallel", type=int, metavar="N",
        help="plan training with each sequence shared by N processes (ring attention): memory "
        "per process and bytes sent per step",
    )  # fmt: skip
    cost.add_argument(
        "--fsdp",
        type=int,
        metavar="N",
        help="plan training with parameters, gradients and AdamW state sharded N ways (FSDP)",
    )
    cost.set_defaults(run=_cost)
