"""Benchmark: `qkv.attention` against raw PyTorch SDPA and naive eager attention, side by side.

    .venv/bin/python benchmarks/attention.py              # full run, forward only
    .venv/bin/python benchmarks/attention.py --quick      # smoke run: L = 512, 1024, few repeats
    .venv/bin/python benchmarks/attention.py --backward   # forward + backward

Candidates, all on (B, H, L, D) = (1, 12, L, 64) self-attention (L_q = L_k = L):
    qkv    qkv.attention(q, k, v, causal=c)                 (backend "auto")
    sdpa   F.scaled_dot_product_attention(q, k, v, is_causal=c)
    naive  softmax(q k^T / sqrt(D) + causal -inf mask) v    in eager PyTorch, scores materialized
           (the boolean causal mask is built once per configuration, outside the timed call)
    flex   torch.compile(flex_attention)(q, k, v, block_mask=causal BlockMask or None): PyTorch's
           FlexAttention, the peer for attention patterns (compiled once per shape and dtype,
           its BlockMask built outside the timed call); forward only on the CPU, where torch 2.13
           has no FlexAttention backward

Timing: warm-up calls, then rounds that each call every candidate once, in a rotating order, so
that machine noise hits all equally; the median per candidate is reported (common.py). Repeats
are lowered at large L to keep a run within a time budget per configuration (--budget).

Targets: qkv/sdpa <= 1.05 (the wrapper costs at most 5%); naive/sdpa shows what the fused kernel
buys. Throughput counts the useful FLOPs of exact attention (no recomputation, softmax ignored):
    forward:             FLOPs = 4 * B * H * L_q * L_k * D  (Q K^T and P V, 2*B*H*L_q*L_k*D each)
    forward + backward:  FLOPs = 3 * (forward FLOPs)         (backward: dV, dP, dQ, dK matmuls)
    causal:              half of the above                   (half of the scores are needed)
and is reported in GFLOP/s and as a fraction ("%mm") of the measured rate of a square matmul
of the same dtype on this machine (--matmul-size), the proxy for the hardware limit.

Writes a readable table to stdout, the full results (machine, every sample) to JSON, and a plot
if matplotlib is installed (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    DTYPES,
    Timing,
    default_device,
    format_table,
    load_average,
    log,
    machine_info,
    matmul_rate,
    time_interleaved,
    try_import_pyplot,
    write_json,
)

import qkv

RESULTS = Path(__file__).resolve().parent / "results"
CANDIDATES = ("qkv", "sdpa", "naive", "flex")
FLEX = {}  # the compiled flex_attention, made on first use
# One compile per shape, dtype and pattern: more than torch.compile's default of 8 recompiles of
# a function, past which it would silently run flex_attention eagerly (unfused, many times slower).
torch._dynamo.config.recompile_limit = 64
TARGET_RATIO = 1.05  # qkv / sdpa
BATCH, HEADS, HEAD_DIM = 1, 12, 64
# Largest acceptable max |output - sdpa output| per dtype, for the sanity check before timing.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v, with -inf where `hidden` (L_q, L_k) is True; eager PyTorch."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L_q, L_k)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, L_q, D)


def attention_flops(L_q: int, L_k: int, *, causal: bool, backward: bool) -> float:
    """Useful FLOPs of one call (see the module docstring for the formula)."""
    flops = 4 * BATCH * HEADS * L_q * L_k * HEAD_DIM
    if backward:
        flops *= 3
    return flops / 2 if causal else flops


def make_candidates(q, k, v, *, causal: bool, backward: bool) -> dict:
    hidden = (
        torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        if causal
        else None
    )
    forwards = {
        "qkv": lambda q, k, v: qkv.attention(q, k, v, causal=causal),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "naive": lambda q, k, v: naive_attention(q, k, v, hidden),
    }
    if not backward or q.device.type != "cpu":  # FlexAttention: no backward on the CPU
        forwards["flex"] = flex(q.shape[-2], causal, q.device)
    if not backward:
        return {name: (lambda f=f: f(q, k, v)) for name, f in forwards.items()}
    grad_out = torch.randn_like(q)

    def forward_backward(f):
        def call():
            out = f(q, k, v)
            return torch.autograd.grad(out, (q, k, v), grad_out)  # no .grad accumulation

        return call

    return {name: forward_backward(f) for name, f in forwards.items()}


def causal_pattern(b, h, q_index, k_index):
    return q_index >= k_index


def flex(L: int, causal: bool, device):
    """FlexAttention (compiled once per shape, dtype and pattern) with the causal BlockMask (or
    none). The pattern is a module-level function: a new function object per call would fail
    the compiled graph's guards and compile again."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if causal:
        block_mask = create_block_mask(causal_pattern, None, None, L, L, device=device)
    if "compiled" not in FLEX:
        FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    compiled = FLEX["compiled"]
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def check_outputs(q, k, v, *, causal: bool) -> dict[str, float]:
    """Max |output - sdpa output| of qkv and naive; also the first warm-up call of each."""
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        hidden = (
            torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
            if causal
            else None
        )
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        errors = {
            "qkv": (qkv.attention(q, k, v, causal=causal).float() - ref).abs().max().item(),
            "naive": (naive_attention(q, k, v, hidden).float() - ref).abs().max().item(),
            "flex": (flex(q.shape[-2], causal, q.device)(q, k, v).float() - ref).abs().max().item(),
        }
    return errors


def bench_one(L: int, dtype: torch.dtype, causal: bool, args) -> dict:
    gen = torch.Generator(device=args.device).manual_seed(0)
    shape = (BATCH, HEADS, L, HEAD_DIM)
    q, k, v = (
        torch.randn(shape, generator=gen, device=args.device)
        .to(dtype)
        .requires_grad_(args.backward)
        for _ in range(3)
    )
    errors = check_outputs(q, k, v, causal=causal)
    for name, err in errors.items():
        if not err <= TOLERANCE[dtype]:
            log(f"WARNING: L={L} {dtype} causal={causal}: {name} differs from sdpa by {err:.3g}")
    timings = time_interleaved(
        make_candidates(q, k, v, causal=causal, backward=args.backward),
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        min_repeats=min(args.min_repeats, args.repeats),
        budget_s=args.budget,
    )
    flops = attention_flops(L, L, causal=causal, backward=args.backward)
    names = tuple(timings)  # flex is absent from f+b rows on the CPU
    row = {
        "L": L,
        "causal": causal,
        "dtype": str(dtype).removeprefix("torch."),
        "flops": flops,
        "repeats": len(timings["sdpa"].samples),
        "max_abs_diff_vs_sdpa": errors,
        "ms": {n: timings[n].median * 1e3 for n in names},
        "ratio_vs_sdpa": {n: timings[n].median / timings["sdpa"].median for n in names},
        # Median of the per-round ratios: rounds are interleaved, so pairing cancels slow drift.
        "paired_ratio_vs_sdpa": {n: paired_ratio(timings[n], timings["sdpa"]) for n in names},
        "paired_ratio_vs_flex": {n: paired_ratio(timings[n], timings["flex"]) for n in names}
        if "flex" in timings
        else {},
        "gflops": {n: flops / timings[n].median / 1e9 for n in names},
        "timings": {n: timings[n].as_dict() for n in names},
    }
    del q, k, v, timings
    gc.collect()
    return row


def _short(dtype_name: str) -> str:
    """'float32' -> 'fp32': the key of DTYPES."""
    return next(k for k, v in DTYPES.items() if str(v).removeprefix("torch.") == dtype_name)


def paired_ratio(a: Timing, b: Timing) -> float:
    return statistics.median(x / y for x, y in zip(a.samples, b.samples, strict=True))


def table(rows: list[dict]) -> str:
    header = [
        "L",
        "causal",
        "dtype",
        "qkv ms",
        "sdpa ms",
        "naive ms",
        "flex ms",
        "qkv/sdpa",
        "naive/sdpa",
        "qkv/flex",
        "qkv GF/s",
        "qkv %mm",
        "sdpa %mm",
        "naive %mm",
    ]
    body = []
    for r in rows:
        ratio = r["ratio_vs_sdpa"]["qkv"]
        body.append(
            [
                r["L"],
                "yes" if r["causal"] else "no",
                r["dtype"],
                *(f"{r['ms'][n]:.2f}" if n in r["ms"] else "-" for n in CANDIDATES),
                f"{ratio:.3f}" + ("!" if ratio > TARGET_RATIO else " "),
                f"{r['ratio_vs_sdpa']['naive']:.2f}",
                f"{r['ms']['qkv'] / r['ms']['flex']:.2f}" if "flex" in r["ms"] else "-",
                f"{r['gflops']['qkv']:.1f}",
                *(f"{100 * r['fraction_of_matmul'][n]:.1f}%" for n in ("qkv", "sdpa", "naive")),
            ]
        )
    return format_table(body, header)


def summary(rows: list[dict]) -> str:
    ratios = [r["ratio_vs_sdpa"]["qkv"] for r in rows]
    within = sum(x <= TARGET_RATIO for x in ratios)
    return (
        f"qkv/sdpa: median {statistics.median(ratios):.3f}, max {max(ratios):.3f}; "
        f"{within}/{len(ratios)} rows within the target <= {TARGET_RATIO} ('!' marks a miss)"
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = try_import_pyplot()
    if plt is None:
        return
    groups = sorted({(r["dtype"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (dtype, causal) in zip(axes[0], groups, strict=True):
        sel = sorted(
            (r for r in rows if (r["dtype"], r["causal"]) == (dtype, causal)), key=lambda r: r["L"]
        )
        for name in CANDIDATES:
            points = [(r["L"], r["ms"][name]) for r in sel if name in r["ms"]]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="L", ylabel="ms (median)")
        ax.set_title(f"{dtype}, {'causal' if causal else 'full'}")
        ax.set_xticks([r["L"] for r in sel], [str(r["L"]) for r in sel])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    p.add_argument("--repeats", type=int, default=25, help="timed rounds (at most)")
    p.add_argument("--min-repeats", type=int, default=5, help="timed rounds (at least)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds after the check call")
    p.add_argument(
        "--budget",
        type=float,
        default=12.0,
        help="seconds of timed rounds per configuration; repeats drop (to --min-repeats) to fit",
    )
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--quick", action="store_true", help="smoke run: L = 512, 1024; 3 repeats")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n matmul proxy")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/attention.json; attention_backward.json "
        "with --backward; attention_quick.json with --quick)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.quick:
        args.lengths = [L for L in args.lengths if L <= 1024] or [512, 1024]
        args.repeats = args.min_repeats = 3
        args.budget = min(args.budget, 2.0)
    if args.out is None:
        stem = (
            "attention" + ("_backward" if args.backward else "") + ("_quick" if args.quick else "")
        )
        args.out = RESULTS / f"{stem}.json"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    dtypes = [DTYPES[d] for d in args.dtypes]
    info = machine_info(args.device)
    mode = "forward + backward" if args.backward else "forward"
    if info["load_average"] and info["load_average"][0] > 0.5:
        log(f"note: load average {info['load_average'][0]:.2f} at start: other work is running")
    log(f"{mode}, {info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}")

    # The matmul reference is measured before and after the attention rows; the best is kept.
    mm_runs: dict[torch.dtype, list[dict]] = {dtype: [] for dtype in dtypes}

    def measure_matmul(when: str) -> None:
        for dtype in dtypes:
            rate = matmul_rate(dtype, args.device, n=args.matmul_size)
            mm_runs[dtype].append({"when": when, **rate})
            log(
                f"matmul {args.matmul_size}^2 {dtype} ({when}): peak {rate['peak'] / 1e9:.1f}, "
                f"median {rate['median'] / 1e9:.1f} GFLOP/s"
            )

    measure_matmul("start")
    rows = []
    for dtype in dtypes:
        for causal in (False, True):
            for L in args.lengths:
                row = bench_one(L, dtype, causal, args)
                rows.append(row)
                log(
                    f"  L={L:5d} causal={causal!s:5} {row['dtype']:8s} "
                    f"qkv {row['ms']['qkv']:9.2f} ms  sdpa {row['ms']['sdpa']:9.2f} ms  "
                    f"naive {row['ms']['naive']:9.2f} ms  ({row['repeats']} repeats)"
                )

    measure_matmul("end")
    mm_rates = {dtype: max(run["peak"] for run in runs) for dtype, runs in mm_runs.items()}
    for row in rows:
        rate = mm_rates[DTYPES[_short(row["dtype"])]]
        row["fraction_of_matmul"] = {n: row["gflops"][n] * 1e9 / rate for n in row["gflops"]}

    shape = f"B={BATCH}, H={HEADS}, D={HEAD_DIM}, self-attention"
    rates = ", ".join(f"{str(d).removeprefix('torch.')} {r / 1e9:.1f}" for d, r in mm_rates.items())
    print(f"qkv.attention vs F.scaled_dot_product_attention vs naive eager: {mode}, {shape}")
    print(
        f"{info['device_name']}; {info['torch_threads']} threads of {info['cpu_count']} CPUs; "
        f"torch {info['torch']}"
    )
    print(
        f"matmul {args.matmul_size}x{args.matmul_size} GFLOP/s, best of start and end "
        f"(the %mm reference): {rates}"
    )
    print("times: median ms per call; %mm: achieved FLOP/s / matmul FLOP/s of the same dtype")
    print()
    print(table(rows))
    print()
    print(summary(rows))

    payload = {
        "benchmark": "attention",
        "mode": mode,
        "shape": {"B": BATCH, "H": HEADS, "D": HEAD_DIM},
        "flops_formula": "4*B*H*L_q*L_k*D forward, x3 with backward, /2 if causal",
        "target_qkv_over_sdpa": TARGET_RATIO,
        "machine": info,
        "settings": {
            "lengths": args.lengths,
            "dtypes": args.dtypes,
            "repeats_max": args.repeats,
            "repeats_min": args.min_repeats,
            "warmup": args.warmup,
            "budget_s": args.budget,
            "quick": args.quick,
            "matmul_size": args.matmul_size,
        },
        "matmul_gflops": {str(d).removeprefix("torch."): r / 1e9 for d, r in mm_rates.items()},
        "matmul_runs": {
            str(d).removeprefix("torch."): [
                {
                    "when": r["when"],
                    "peak_gflops": r["peak"] / 1e9,
                    "median_gflops": r["median"] / 1e9,
                }
                for r in runs
            ]
            for d, runs in mm_runs.items()
        },
        "rows": rows,
    }
    payload["machine"]["load_average_end"] = load_average()
    path = write_json(args.out, payload)
    log(f"wrote {path}")
    plot(rows, path.with_suffix(".png"), f"attention {mode}, {shape}, {info['device_name']}")


if __name__ == "__main__":
    main()
