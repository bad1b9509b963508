"""`qkv cost`: parameters, FLOPs, score-matrix and KV-cache memory of presets or checkpoints;
with --context-parallel/--fsdp, the per-process plan of training past one process; with
--shares, --source-length/--target-length or --generate, how the FLOPs move with the lengths
(`qkv.analysis.cost.scaling`); with --layer-types, Vaswani et al. 2017's Table 1 at the model's
length and width (`qkv.analysis.cost.layer_types`); each under the model's column."""

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
    if _scaling_asked(args):
        return _scaling(args, names, reports)
    if args.json:
        print(json.dumps([dataclasses.asdict(report) for report in reports], indent=2))
    elif args.models:
        print(format_report(reports))
    else:
        print(format_presets(reports))
    return 0


def _scaling_asked(args: argparse.Namespace) -> bool:
    lengths = (args.source_length, args.target_length)
    asked = args.shares or args.generate is not None or lengths != (None, None)
    return asked or _layer_types_asked(args)


def _layer_types_asked(args: argparse.Namespace) -> bool:
    return args.layer_types or (args.kernel, args.neighbourhood) != (None, None)


def _scaling(args: argparse.Namespace, names: list[str], reports: list) -> int:
    """Each model's column, then the sections asked for; with --json, each report's fields
    and the sections under "shares", "encoder_decoder", "generation" and "layer_types"."""
    from qkv.analysis.cost.format import format_report
    from qkv.analysis.cost.scaling_format import (
        format_encoder_decoder,
        format_generation,
        format_layer_types,
        format_shares,
    )

    if not args.models:
        print("qkv cost: error: model: name the MODEL to scale", file=sys.stderr)
        return 1
    try:
        sections = [
            _sections(args, name, report) for name, report in zip(names, reports, strict=True)
        ]
    except (ValueError, TypeError) as error:
        print(f"qkv cost: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        documents = [
            {**dataclasses.asdict(report), **{k: dataclasses.asdict(v) for k, v in extra.items()}}
            for report, extra in zip(reports, sections, strict=True)
        ]
        print(json.dumps(documents, indent=2))
        return 0
    formats = {"shares": format_shares, "encoder_decoder": format_encoder_decoder,
               "generation": format_generation, "layer_types": format_layer_types}  # fmt: skip
    texts = [format_report(reports)]
    texts += [formats[key](value) for extra in sections for key, value in extra.items()]
    print("\n\n".join(texts))
    return 0


def _sections(args: argparse.Namespace, name: str, report) -> dict:
    from qkv.analysis.cost.scaling import (
        attention_shares,
        encoder_decoder_flops,
        generation_flops,
    )

    sections = {}
    if args.shares:
        sections["shares"] = attention_shares(name)
    if (args.source_length, args.target_length) != (None, None):
        sections["encoder_decoder"] = encoder_decoder_flops(
            name,
            source_length=args.source_length or report.context,
            target_length=args.target_length or report.context,
        )
    if args.generate is not None:
        sections["generation"] = generation_flops(
            name, prompt_length=report.context, new_tokens=args.generate
        )
    if _layer_types_asked(args):
        sections["layer_types"] = _layer_types(args, report)
    return sections


def _layer_types(args: argparse.Namespace, report):
    from qkv.analysis.cost.layer_types import KERNEL, layer_types

    kernel = KERNEL if args.kernel is None else args.kernel
    return layer_types(
        length=report.context, width=report.embed_dim, kernel=kernel,
        neighbourhood=args.neighbourhood, name=report.name,
    )  # fmt: skip


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
        help="a preset (e.g. llama-2-70b, gpt2, bert-base-uncased, t5-small, vit-base-16), a "
        "checkpoint folder or a config.json",
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
    cost.add_argument(
        "--shares", action="store_true",
        help="attention's share of one block's FLOPs at 512 to 128K tokens, and the length "
        "where the scores cost what the projections and the FFN cost",
    )  # fmt: skip
    cost.add_argument(
        "--source-length", type=int, metavar="S",
        help="encoder-decoder: source tokens (default --context); FLOPs per block of the "
        "encoder (S^2), the decoder (T^2) and cross-attention (S x T)",
    )  # fmt: skip
    cost.add_argument(
        "--target-length", type=int, metavar="T",
        help="encoder-decoder: target tokens (default --context)",
    )  # fmt: skip
    cost.add_argument(
        "--generate", type=int, metavar="N",
        help="FLOPs of generating N tokens after a --context-token prompt, with a KV cache "
        "and by recomputing every prefix, and their ratio",
    )  # fmt: skip
    cost.add_argument(
        "--layer-types", action="store_true",
        help="Vaswani et al. 2017, Table 1 at n = --context and d = the model's width: FLOPs "
        "per layer, sequential operations and maximum path length of self-attention, "
        "recurrent, convolutional and restricted self-attention layers",
    )  # fmt: skip
    cost.add_argument(
        "--kernel", type=int, metavar="K",
        help="--layer-types: the convolutions' width k (default 3)",
    )  # fmt: skip
    cost.add_argument(
        "--neighbourhood", type=int, metavar="R",
        help="--layer-types: the keys r of restricted self-attention, centred on each query "
        "(default 256, or the context if shorter)",
    )  # fmt: skip
    cost.set_defaults(run=_cost)
