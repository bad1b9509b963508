"""Benchmark: whole qkv models against transformers (attn_implementation="sdpa"), side by side.

    .venv/bin/python benchmarks/models.py            # full sizes (several minutes on 2 cores)
    .venv/bin/python benchmarks/models.py --quick    # smoke run: small batches, 2 rounds

Models, each built once by qkv, saved with qkv's save_pretrained and loaded by transformers from
that directory, so both hold the same config and the same weights (checked before timing):
    bert   qkv.models.bert.BertModel("all-MiniLM-L6-v2")  vs transformers.BertModel
           B = 32, L = 128, attention_mask of ones (what a tokenizer gives for equal lengths)
    llama  qkv.models.GPT("llama-50m"), ~52M parameters, GQA 8/4  vs LlamaForCausalLM
           B = 8, L = 512, no attention_mask (packed sequences, as in pre-training)

Modes: "forward" (eval mode, no_grad) and "train" (train mode: forward, loss, backward, AdamW
step, zero_grad; BERT's loss is mean(last_hidden_state^2), Llama's the next-token
cross-entropy from labels=input_ids). Dtypes: fp32, and bf16 autocast over fp32 weights.

Forward rows on the CPU also time "qkv packed": a copy of qkv's model inside
`qkv.acceleration.packed_linears(model, batch_hint=B * L)` (every linear's weight reordered once
into oneDNN's blocked layout, a bf16 copy under autocast; q/k/v and gate/up fused), the block held
open so the weights are packed once, by the warm-up call, as a program that loads a model and runs
many batches has it; "pack ms" is what packing adds to that first call. Training rows have no packed
path (packed weights carry no gradients); they time "qkv speed_up" instead: a copy of qkv's model
inside `qkv.acceleration.speed_up(model)`, the stand-ins that pay on this CPU, as
`qkv.training.train` runs by default (its loss taken from the logits, as qkv's gpt task does).

Reported per row: tokens/s (B * L / median seconds per call) of each, the speed ratio
qkv/transformers (> 1: qkv is faster; target >= 1.0 on every row by the model as a user
calls it) with the median of the per-round ratios beside it, and qkv's achieved FLOP/s as a
fraction of the measured matmul rate of the same dtype (common.matmul_rate: the faster of
torch.mm and oneDNN). Useful FLOPs, per forward:
    2 * (weights of every Linear applied to each token) * B * L     (BERT's pooler: B tokens)
    + 4 * B * L^2 * E * layers                                       (Q K^T and P V; half if causal)
and a training step counts 3 forwards (backward = 2x forward).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from common import (
    DTYPES,
    Timing,
    default_device,
    format_table,
    log,
    machine_info,
    matmul_rate,
    time_interleaved,
    write_json,
)
from torch import nn

from qkv.acceleration import PackedLinear, packed_linears, speed_up, speed_up_choices
from qkv.models.gpt import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 1.0  # qkv tokens/s over transformers tokens/s
TOLERANCE = {"fp32": 1e-4, "bf16": 0.25}  # max |qkv - transformers| output, sanity check only
transformers.logging.set_verbosity_error()


@dataclass
class Pair:
    """One model as qkv and as transformers, with the inputs and the loss of a step."""

    name: str
    batch: int
    length: int
    qkv: nn.Module
    reference: nn.Module
    call_qkv: Callable[[nn.Module], torch.Tensor]  # model -> the output compared and timed
    call_reference: Callable[[nn.Module], torch.Tensor]
    loss_qkv: Callable[[nn.Module], torch.Tensor]
    loss_reference: Callable[[nn.Module], torch.Tensor]
    forward_flops: float


def linear_flops(model: nn.Module, tokens: int, skip: tuple[str, ...] = ()) -> float:
    """2 * (Linear weights) * tokens: the multiply-adds of every projection on every token."""
    weights = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not name.startswith(skip)
    )
    return 2.0 * weights * tokens


def build_bert(batch: int, length: int, device: str) -> Pair | None:
    try:
        from qkv.models.bert import BertConfig, BertModel
    except ImportError as error:
        log(f"bert: skipped, qkv.models.bert is not importable ({error})")
        return None
    config = BertConfig.from_name("all-MiniLM-L6-v2")
    torch.manual_seed(0)
    ours = BertModel(config)
    theirs = _reload(ours, transformers.BertModel)
    input_ids = torch.randint(1, config.vocab_size, (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    tokens = batch * length
    flops = linear_flops(ours, tokens, skip=("pooler",)) + linear_flops(ours.pooler, batch)
    flops += 4.0 * batch * length * length * config.embed_dim * config.num_layers

    def squared(h: torch.Tensor) -> torch.Tensor:
        return h.float().square().mean()

    return Pair(
        name="bert-MiniLM-L6",
        batch=batch,
        length=length,
        qkv=ours.to(device),
        reference=theirs.to(device),
        call_qkv=lambda m: m(input_ids, attention_mask=mask).last_hidden_state,
        call_reference=lambda m: m(input_ids=input_ids, attention_mask=mask).last_hidden_state,
        loss_qkv=lambda m: squared(m(input_ids, attention_mask=mask).last_hidden_state),
        loss_reference=lambda m: squared(
            m(input_ids=input_ids, attention_mask=mask).last_hidden_state
        ),
        forward_flops=flops,
    )


def build_llama(batch: int, length: int, device: str) -> Pair:
    config = GPTConfig.from_name("llama-50m")
    torch.manual_seed(0)
    ours = GPT(config)
    theirs = _reload(ours, transformers.LlamaForCausalLM)
    input_ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
    flops = linear_flops(ours, batch * length)
    flops += 0.5 * 4.0 * batch * length * length * config.embed_dim * config.num_layers
    return Pair(
        name="llama-50m",
        batch=batch,
        length=length,
        qkv=ours.to(device),
        reference=theirs.to(device),
        call_qkv=lambda m: m(input_ids).logits,
        call_reference=lambda m: m(input_ids=input_ids).logits,
        # the loss outside the model, from its logits, as qkv.training's gpt task computes it
        loss_qkv=lambda m: F.cross_entropy(
            m(input_ids).logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten()
        ),
        loss_reference=lambda m: m(input_ids=input_ids, labels=input_ids).loss,
        forward_flops=flops,
    )


def _reload(model: nn.Module, reference_class: type) -> nn.Module:
    """The same weights in transformers: qkv's save_pretrained, then transformers' loader."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return reference_class.from_pretrained(directory, attn_implementation="sdpa")


def autocast(device: str, dtype: str):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype])


def forward_step(model: nn.Module, call: Callable, device: str, dtype: str) -> Callable:
    def step():
        with torch.no_grad(), autocast(device, dtype):
            return call(model)

    return step


def train_step(model: nn.Module, loss_fn: Callable, device: str, dtype: str) -> Callable:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        with autocast(device, dtype):
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def check_outputs(pair: Pair, device: str, dtype: str) -> float:
    """Max |qkv output - transformers output| in eval mode: the two must compute one function."""
    pair.qkv.eval()
    pair.reference.eval()
    ours = forward_step(pair.qkv, pair.call_qkv, device, dtype)().float()
    theirs = forward_step(pair.reference, pair.call_reference, device, dtype)().float()
    return (ours - theirs).abs().max().item()


def bench_row(pair: Pair, mode: str, dtype: str, rates: dict, args) -> dict:
    error = check_outputs(pair, args.device, dtype)
    if not error <= TOLERANCE[dtype]:
        log(f"WARNING: {pair.name} {dtype}: qkv and transformers differ by {error:.3g}")
    training = mode == "train"
    pair.qkv.train(training)
    pair.reference.train(training)
    if training:
        candidates = {
            "qkv": train_step(pair.qkv, pair.loss_qkv, args.device, dtype),
            "transformers": train_step(pair.reference, pair.loss_reference, args.device, dtype),
        }
    else:
        candidates = {
            "qkv": forward_step(pair.qkv, pair.call_qkv, args.device, dtype),
            "transformers": forward_step(pair.reference, pair.call_reference, args.device, dtype),
        }
    held = contextlib.ExitStack()
    packing = None
    if not training and args.device == "cpu":
        packed_model, packing = packed_copy(pair, dtype, held)
        candidates["qkv_packed"] = forward_step(packed_model, pair.call_qkv, args.device, dtype)
    if training and args.device == "cpu":  # what qkv.training.train runs by default
        swapped = held.enter_context(speed_up(copy.deepcopy(pair.qkv)))
        candidates["qkv_speed_up"] = train_step(swapped, pair.loss_qkv, args.device, dtype)
    log(f"timing {pair.name} {mode} {dtype} ...")
    timings = time_interleaved(
        candidates,
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        min_repeats=min(args.repeats, 3),
        budget_s=args.budget,
    )
    held.close()
    del candidates
    gc.collect()
    flops = pair.forward_flops * (3 if training else 1)
    tokens = pair.batch * pair.length
    ours, theirs = timings["qkv"], timings["transformers"]
    extra = {}
    if "qkv_packed" in timings:
        extra = {
            "packed_ratio": theirs.median / timings["qkv_packed"].median,
            "packed_paired_ratio": paired_ratio(theirs, timings["qkv_packed"]),
            "packing": packing,
        }
    if "qkv_speed_up" in timings:
        extra = {
            "speed_up_ratio": theirs.median / timings["qkv_speed_up"].median,
            "speed_up_paired_ratio": paired_ratio(theirs, timings["qkv_speed_up"]),
            "speed_up_over_plain": paired_ratio(ours, timings["qkv_speed_up"]),
            "speed_up": {name: why.reason for name, why in speed_up_choices().items() if why},
        }
    return {
        "model": pair.name,
        "batch": pair.batch,
        "length": pair.length,
        "mode": mode,
        "dtype": dtype,
        "max_abs_diff": error,
        "flops": flops,
        "tokens_per_s": {n: tokens / t.median for n, t in timings.items()},
        "ratio": theirs.median / ours.median,
        "paired_ratio": paired_ratio(theirs, ours),
        "fraction_of_matmul": {n: flops / t.median / rates[dtype] for n, t in timings.items()},
        "timings": {n: t.as_dict() for n, t in timings.items()},
        **extra,
    }


def packed_copy(pair: Pair, dtype: str, stack: contextlib.ExitStack) -> tuple[nn.Module, dict]:
    """A copy of qkv's model inside a `packed_linears` block that `stack` holds open (weights
    packed once, for B * L rows a call, by the first call: the warm-up), as a program that
    loads a model once and runs many batches has it. Returns (model, {"ms": the time spent
    packing (PackedLinear.packing_seconds), "max_abs_diff": its output against transformers'})."""
    model = copy.deepcopy(pair.qkv).eval()
    stack.enter_context(packed_linears(model, batch_hint=pair.batch * pair.length))
    output = forward_step(model, pair.call_qkv, "cpu", dtype)().float()  # packs what it uses
    packing_s = sum(m.packing_seconds for m in model.modules() if isinstance(m, PackedLinear))
    reference = forward_step(pair.reference, pair.call_reference, "cpu", dtype)().float()
    error = (output - reference).abs().max().item()
    if not error <= TOLERANCE[dtype]:
        log(f"WARNING: {pair.name} {dtype}: packed qkv and transformers differ by {error:.3g}")
    return model, {"ms": 1e3 * packing_s, "max_abs_diff": error}


def paired_ratio(slow: Timing, fast: Timing) -> float:
    """Median over rounds of slow/fast: rounds are interleaved, so pairing cancels drift."""
    return statistics.median(a / b for a, b in zip(slow.samples, fast.samples, strict=True))


def table(rows: list[dict]) -> str:
    header = ["model", "B x L", "mode", "dtype", "qkv tok/s", "hf tok/s", "qkv/hf", "paired"]
    header += ["packed|speed_up tok/s", "/hf", "paired", "pack ms"]
    header += ["qkv GF/s", "qkv %mm", "hf %mm"]
    body = []
    for r in rows:
        gflops = r["flops"] / (r["batch"] * r["length"]) * r["tokens_per_s"]["qkv"] / 1e9
        packed = ["-", "-", "-", "-"]
        if "packed_ratio" in r:
            packed = [
                f"{r['tokens_per_s']['qkv_packed']:.0f}",
                f"{r['packed_ratio']:.3f}",
                f"{r['packed_paired_ratio']:.3f}",
                f"{r['packing']['ms']:.0f}",
            ]
        if "speed_up_ratio" in r:
            packed = [
                f"{r['tokens_per_s']['qkv_speed_up']:.0f}",
                f"{r['speed_up_ratio']:.3f}",
                f"{r['speed_up_paired_ratio']:.3f}",
                "-",
            ]
        body.append(
            [
                r["model"],
                f"{r['batch']}x{r['length']}",
                r["mode"],
                r["dtype"],
                f"{r['tokens_per_s']['qkv']:.0f}",
                f"{r['tokens_per_s']['transformers']:.0f}",
                f"{r['ratio']:.3f}" + ("!" if r["ratio"] < TARGET_RATIO else " "),
                f"{r['paired_ratio']:.3f}",
                *packed,
                f"{gflops:.1f}",
                f"{100 * r['fraction_of_matmul']['qkv']:.1f}%",
                f"{100 * r['fraction_of_matmul']['transformers']:.1f}%",
            ]
        )
    return format_table(body, header)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches, 2 rounds: a smoke run")
    parser.add_argument("--models", nargs="+", default=["bert", "llama"], choices=["bert", "llama"])
    parser.add_argument(
        "--modes", nargs="+", default=["forward", "train"], choices=["forward", "train"]
    )
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=45.0, help="seconds of timing per row")
    parser.add_argument("--out", type=Path, default=RESULTS / "models.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.budget = 2, 5.0
        args.out = args.out.with_name(args.out.stem + "_quick.json")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    sizes = {"bert": (32, 128), "llama": (8, 512)}
    if args.quick:
        sizes = {"bert": (4, 64), "llama": (2, 128)}
    log("measuring the matmul rate of each dtype ...")
    rates = {d: matmul_rate(DTYPES[d], args.device)["peak"] for d in args.dtypes}
    builders = {"bert": build_bert, "llama": build_llama}
    rows, skipped = [], []
    for name in args.models:
        pair = builders[name](*sizes[name], args.device)
        if pair is None:
            skipped.append(f"{name}: qkv.models.bert.BertModel is not importable")
            continue
        for mode in args.modes:
            for dtype in args.dtypes:
                rows.append(bench_row(pair, mode, dtype, rates, args))
        del pair
        gc.collect()
    info = machine_info(args.device)
    print(
        f"# {info['device_name']}, torch {info['torch']}, transformers {transformers.__version__}"
    )
    print("# matmul peak: " + ", ".join(f"{d} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items()))
    print(table(rows))
    for line in skipped:
        print(f"skipped {line}")
    write_json(args.out, {"machine": info, "matmul_rate": rates, "rows": rows, "skipped": skipped})
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
