"""Benchmark: attention patterns through `qkv.attention` against SDPA and FlexAttention.

    .venv/bin/python benchmarks/patterns.py                 # forward and forward + backward
    .venv/bin/python benchmarks/patterns.py --quick         # smoke run: L = 1024, 3 repeats

Patterns, on (B, H, L, D) = (1, 8, L, 64) self-attention:
    causal   causal mask
    window   causal, sliding window of 1024 keys (Mistral's)
    sinks    the window plus 4 attention sinks (StreamingLLM, Xiao et al. 2024)
    alibi    causal with ALiBi's per-head linear bias (Press et al. 2022)
    softcap  causal with the scores soft-capped at 30 (Gemma 2)

Candidates, each written as a user of that library would write the pattern:
    auto   qkv.attention(q, k, v, causal=True, window=..., sinks=..., alibi_slopes=...,
           softcap=...): backend "auto" (its choice is recorded per row)
    tiled  the same call with backend="tiled", qkv's readable FlashAttention in PyTorch
    sdpa   F.scaled_dot_product_attention: is_causal=True, or the dense bool mask / float bias
           of the pattern built outside the timed call; it cannot soft-cap (no row)
    flex   torch.compile(flex_attention) with the pattern's score_mod and BlockMask
           (create_block_mask, outside the timed call); forward only on the CPU (torch has no
           FlexAttention backward there)
    eager  softmax(cap * tanh(q k^T / (cap sqrt(D))) + causal) v in eager PyTorch: the only
           peer for soft-capping with gradients on the CPU (up to --eager-max)

Every candidate's output is checked against float64 eager math before anything is timed
(timings of a wrong candidate are not reported). Target, per row: auto's time <= the best
peer's (the faster of sdpa and flex; eager where neither runs), as a paired ratio; the tiled
path within 2x of SDPA's time on the causal rows.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DTYPES, format_table, log, machine_info, time_interleaved, write_json
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import qkv

RESULTS = Path(__file__).resolve().parent / "results"
PATTERNS = ("causal", "window", "sinks", "alibi", "softcap")
BATCH, HEADS, HEAD_DIM = 1, 8, 64
WINDOW, SINKS, CAP = 1024, 4, 30.0
PEERS = ("sdpa", "flex", "eager")
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 6e-2}
SLOPES = qkv.positional.alibi_slopes(HEADS)
# One compile per pattern, dtype and shape: more than torch.compile's default of 8 recompiles
# of a function, past which it would run flex_attention unfused.
torch._dynamo.config.recompile_limit = 256
COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)


def qkv_options(pattern: str) -> dict:
    options = {"causal": True}
    if pattern in ("window", "sinks"):
        options["window"] = WINDOW
    if pattern == "sinks":
        options["sinks"] = SINKS
    if pattern == "alibi":
        options["alibi_slopes"] = SLOPES
    if pattern == "softcap":
        options["softcap"] = CAP
    return options


# FlexAttention's functions for each pattern, module-level as its tutorial writes them.
def causal_mod(b, h, i, j):
    return i >= j


def window_mod(b, h, i, j):
    return (i >= j) & (i - j < WINDOW)


def sinks_mod(b, h, i, j):
    return (i >= j) & ((i - j < WINDOW) | (j < SINKS))


def alibi_score(score, b, h, i, j):
    return score - SLOPES[h] * (i - j)


def softcap_score(score, b, h, i, j):
    return CAP * torch.tanh(score / CAP)


FLEX_MASKS = {"causal": causal_mod, "window": window_mod, "sinks": sinks_mod}
FLEX_SCORES = {"alibi": alibi_score, "softcap": softcap_score}


def visible(pattern: str, L: int, device) -> torch.Tensor:
    """The pattern's (L, L) bool mask, True = may attend, from index arithmetic."""
    i = torch.arange(L, device=device).view(-1, 1)
    j = torch.arange(L, device=device).view(1, -1)
    allowed = j <= i
    if pattern in ("window", "sinks"):
        near = i - j < WINDOW
        allowed = allowed & ((near | (j < SINKS)) if pattern == "sinks" else near)
    return allowed


def alibi_bias(L: int, dtype, device) -> torch.Tensor:
    """(1, H, L, L) ALiBi bias with -inf above the diagonal: what SDPA needs for the pattern."""
    distance = (torch.arange(L, device=device).view(-1, 1) - torch.arange(L, device=device)).float()
    bias = -SLOPES.to(device).view(1, -1, 1, 1) * distance
    return bias.masked_fill(~visible("causal", L, device), -math.inf).to(dtype)


def eager(q, k, v, pattern: str, extra):
    """Attention as eager math: scores materialised, the pattern applied, fp32 softmax."""
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if pattern == "softcap":
        scores = CAP * torch.tanh(scores / CAP)
    masked = pattern != "alibi"  # ALiBi's extra is a float bias, -inf included
    scores = scores.masked_fill(~extra, -math.inf) if masked else scores + extra.float()
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def forwards(pattern: str, L: int, dtype, device, *, backward: bool, eager_max: int) -> dict:
    """{candidate: f(q, k, v)} for one row; the dense tensors are built here, outside timing."""
    options = qkv_options(pattern)
    out = {
        "auto": lambda q, k, v: qkv.attention(q, k, v, **options),
        "tiled": lambda q, k, v: qkv.attention(q, k, v, **options, backend="tiled"),
    }
    dense = alibi_bias(L, dtype, device) if pattern == "alibi" else visible(pattern, L, device)
    if pattern == "causal":
        out["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif pattern != "softcap":
        out["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    if not backward or device != "cpu":
        mask_mod = FLEX_MASKS.get(pattern, causal_mod)
        block_mask = create_block_mask(mask_mod, None, None, L, L, device=device)
        score_mod = FLEX_SCORES.get(pattern)
        out["flex"] = lambda q, k, v: COMPILED_FLEX(
            q, k, v, score_mod=score_mod, block_mask=block_mask
        )
    if eager_max >= L:
        out["eager"] = lambda q, k, v: eager(q, k, v, pattern, dense)
    return out


def expected_output(q, k, v, pattern: str) -> torch.Tensor:
    """Float64 eager math of the pattern, computed in query chunks (L up to 16k fits)."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    L, chunks = q.shape[2], []
    j = torch.arange(L).view(1, -1)
    for start in range(0, L, 1024):
        i = torch.arange(start, min(start + 1024, L)).view(-1, 1)
        scores = q[:, :, start : start + 1024] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if pattern == "softcap":
            scores = CAP * torch.tanh(scores / CAP)
        if pattern == "alibi":
            scores = scores - SLOPES.double().view(1, -1, 1, 1) * (i - j)
        allowed = j <= i
        if pattern in ("window", "sinks"):
            near = i - j < WINDOW
            allowed = allowed & ((near | (j < SINKS)) if pattern == "sinks" else near)
        chunks.append(torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v)
    return torch.cat(chunks, dim=2)


def bench_row(pattern: str, L: int, dtype, args) -> dict:
    gen = torch.Generator(device=args.device).manual_seed(0)
    q, k, v = (
        torch.randn(BATCH, HEADS, L, HEAD_DIM, generator=gen, device=args.device).to(dtype)
        for _ in range(3)
    )
    for t in (q, k, v):
        t.requires_grad_(args.backward)
    candidates = forwards(
        pattern, L, dtype, args.device, backward=args.backward, eager_max=args.eager_max
    )
    expected = expected_output(q, k, v, pattern)
    errors, wrong = {}, []
    with torch.no_grad():
        for name, f in candidates.items():
            errors[name] = (f(q, k, v).double() - expected).abs().max().item()
            if not errors[name] <= TOLERANCE[dtype]:
                wrong.append(name)
                log(f"WRONG: {pattern} L={L} {dtype}: {name} off by {errors[name]:.3g}; not timed")
    candidates = {n: f for n, f in candidates.items() if n not in wrong}
    choice = qkv.explain(q, k, v, **qkv_options(pattern)).split("'")[1]
    grad_out = torch.randn_like(q)

    def timed(f):
        if not args.backward:
            return lambda: f(q, k, v)
        return lambda: torch.autograd.grad(f(q, k, v), (q, k, v), grad_out)

    timings = time_interleaved(
        {n: timed(f) for n, f in candidates.items()},
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        min_repeats=min(args.min_repeats, args.repeats),
        budget_s=args.budget,
    )
    names = list(timings)
    peers = [n for n in ("sdpa", "flex") if n in timings] or [n for n in ("eager",) if n in timings]
    best = min(peers, key=lambda n: timings[n].median) if peers else None
    row = {
        "pattern": pattern,
        "L": L,
        "dtype": str(dtype).removeprefix("torch."),
        "auto_backend": choice,
        "repeats": len(timings["auto"].samples),
        "max_abs_diff_vs_float64": errors,
        "not_timed_wrong_output": wrong,
        "ms": {n: timings[n].median * 1e3 for n in names},
        "best_peer": best,
        "paired_auto_vs_best_peer": paired(timings["auto"], timings[best]) if best else None,
        "paired_tiled_vs_sdpa": paired(timings["tiled"], timings["sdpa"])
        if "tiled" in timings and "sdpa" in timings
        else None,
        "timings": {n: timings[n].as_dict() for n in names},
    }
    return row


def paired(a, b) -> float:
    return statistics.median(x / y for x, y in zip(a.samples, b.samples, strict=True))


def table(rows: list[dict]) -> str:
    header = ["pattern", "L", "dtype", *(f"{n} ms" for n in ("auto", "tiled", *PEERS))]
    header += ["auto runs", "best peer", "auto/best", "tiled/sdpa"]
    body = []
    for r in rows:
        ratio = r["paired_auto_vs_best_peer"]
        body.append(
            [
                r["pattern"],
                r["L"],
                r["dtype"],
                *(f"{r['ms'][n]:.1f}" if n in r["ms"] else "-" for n in ("auto", "tiled", *PEERS)),
                r["auto_backend"],
                r["best_peer"] or "-",
                "-" if ratio is None else f"{ratio:.2f}" + ("!" if ratio > 1.0 else " "),
                "-" if r["paired_tiled_vs_sdpa"] is None else f"{r['paired_tiled_vs_sdpa']:.2f}",
            ]
        )
    return format_table(body, header)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timed rounds per row")
    p.add_argument("--eager-max", type=int, default=4096, help="longest L for eager math")
    p.add_argument("--quick", action="store_true", help="smoke run: L = 1024, 3 repeats")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.min_repeats, args.budget = [1024], 3, 3, 2.0
    if args.out is None:
        stem = (
            "patterns" + ("_backward" if args.backward else "") + ("_quick" if args.quick else "")
        )
        args.out = RESULTS / f"{stem}.json"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    info = machine_info(args.device)
    mode = "forward + backward" if args.backward else "forward"
    log(f"{mode}, {info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}")
    rows = []
    for dtype in (DTYPES[d] for d in args.dtypes):
        for L in args.lengths:
            for pattern in args.patterns:
                rows.append(bench_row(pattern, L, dtype, args))
                gc.collect()  # the row's tensors, before the next row allocates its own
                log(table(rows[-1:]).splitlines()[-1])
    print(table(rows))
    ratios = [r["paired_auto_vs_best_peer"] for r in rows if r["paired_auto_vs_best_peer"]]
    print(f"auto <= best peer on {sum(x <= 1.0 for x in ratios)}/{len(ratios)} rows")
    payload = {"machine": info, "mode": mode, "args": vars(args) | {"out": str(args.out)}}
    write_json(args.out, payload | {"rows": rows})
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
