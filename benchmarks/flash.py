"""Benchmark: tiled FlashAttention (`qkv.flash_attention`) vs SDPA vs naive math, time and memory.

    .venv/bin/python benchmarks/flash.py            # causal + window 1024, L = 1k .. 16k
    .venv/bin/python benchmarks/flash.py --quick    # smoke run: L = 1k, 2k, fp32
    .venv/bin/python benchmarks/flash.py --long     # also tiled alone at 32k and 64k

Shapes: (B, H, L, D) = (1, 8, L, 64), self-attention. Two settings, side by side per L:
    causal       naive  softmax(q k^T / sqrt(D) + causal mask) v, eager, scores materialised
                 sdpa   F.scaled_dot_product_attention(is_causal=True)
                 tiled  qkv.flash_attention(causal=True)
    window 1024  sdpa   qkv.attention(window=1024, backend="sdpa"): SDPA with the dense
                        (L, L) mask qkv builds for it, every hidden score still computed
                 tiled  qkv.flash_attention(window=1024): hidden tiles skipped
    both         flex   PyTorch's FlexAttention, compiled (torch.compile(flex_attention)), with
                        the BlockMask of the same pattern, built once outside the timing: what a
                        PyTorch user writes for a custom pattern; its output is checked against
                        the tiled path's before timing. On the CPU it has no backward (torch
                        2.13 refuses it), so its f+b and memory columns stay empty there.
Each is timed forward ("fwd") and forward + backward ("f+b"), interleaved (common.py), and its
peak memory of forward + backward is measured once with the PyTorch profiler's allocation
events (CPU) or max_memory_allocated (CUDA): bytes beyond the inputs, at the worst moment.

Naive math at large L does not fit (16k causal needs ~4 score-sized fp32 tensors, 34 GB):
it runs up to --naive-max, and its peak at 16k is extrapolated from a fit and marked so.
The fitted exponent of peak memory vs L (log-log least squares) should be ~1 for tiled and
~2 for naive. Throughput (GFLOP/s) counts useful FLOPs: forward 4 * B * H * L^2 * D, halved
for causal; with the window, 4 * B * H * L * min(L, W) * D; forward + backward x 3.

Targets: tiled fwd <= 2x SDPA's time at L >= 2048 causal; tiled f+b peak memory
exponent <= 1.1 and at 16k <= 1/8 of naive; window 1024 at 16k: tiled >= 3x faster than SDPA.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from common import (
    DTYPES,
    default_device,
    format_table,
    log,
    machine_info,
    matmul_rate,
    time_interleaved,
    try_import_pyplot,
    write_json,
)

import qkv
from qkv.analysis.cost.memory import peak_bytes

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, HEAD_DIM, WINDOW = 8, 64, 1024
FLEX = {}  # the compiled flex_attention, made on first use
# One compile per shape, dtype and pattern: more than torch.compile's default of 8 recompiles of
# a function, past which it would silently run flex_attention eagerly (unfused, many times slower).
torch._dynamo.config.recompile_limit = 64
# Largest acceptable max |flex - tiled| per dtype, checked before timing.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}


def naive(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def candidates(setting: str, L: int, dtype: torch.dtype, device: str, naive_max: int) -> dict:
    """{name: function(q, k, v) -> output} for one setting and length."""
    if setting == "causal":
        found = {
            "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True
            ),
            "tiled": lambda q, k, v: qkv.flash_attention(q, k, v, causal=True),
        }
        if naive_max >= L:
            mask = qkv.masks.causal(L, device=device)
            found["naive"] = lambda q, k, v: naive(q, k, v, mask)
    else:
        found = {
            "sdpa": lambda q, k, v: qkv.attention(q, k, v, window=WINDOW, backend="sdpa"),
            "tiled": lambda q, k, v: qkv.flash_attention(q, k, v, window=WINDOW),
        }
    found["flex"] = flex(setting, L, device)
    return found


def differentiable(name: str, device: str) -> bool:
    """FlexAttention has no backward on the CPU (torch 2.13)."""
    return name != "flex" or device != "cpu"


def causal_pattern(b, h, q_index, k_index):
    return q_index >= k_index


def window_pattern(b, h, q_index, k_index):  # keys j with i - W < j <= i, as qkv's window=W
    return (q_index >= k_index) & (q_index - k_index < WINDOW)


def flex(setting: str, L: int, device: str):
    """FlexAttention (compiled once per shape, dtype and pattern) with the BlockMask of
    `setting`. The patterns are module-level functions: a new function object per call would
    fail the compiled graph's guards and compile again."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pattern = causal_pattern if setting == "causal" else window_pattern
    block_mask = create_block_mask(pattern, None, None, L, L, device=device)
    if "compiled" not in FLEX:
        FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    compiled = FLEX["compiled"]
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def inputs(L: int, dtype: torch.dtype, device: str, grad: bool):
    return [
        torch.randn(1, HEADS, L, HEAD_DIM, device=device, dtype=dtype, requires_grad=grad)
        for _ in range(3)
    ]


def forward_backward(fn, q, k, v):
    def run():
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    return run


def useful_flops(setting: str, L: int, backward: bool) -> float:
    visible = L * L / 2 if setting == "causal" else L * min(L, WINDOW)
    return 4 * HEADS * visible * HEAD_DIM * (3 if backward else 1)


def bench(setting: str, L: int, dtype: torch.dtype, args) -> dict:
    fns = candidates(setting, L, dtype, args.device, args.naive_max)
    q, k, v = inputs(L, dtype, args.device, grad=False)
    flex_error = float((fns["flex"](q, k, v) - fns["tiled"](q, k, v)).abs().max())
    if flex_error > TOLERANCE[dtype]:
        raise RuntimeError(f"{setting} L={L} {dtype}: flex differs from tiled by {flex_error}")
    fwd = time_interleaved(
        {n: (lambda f=f: f(q, k, v)) for n, f in fns.items()},
        device=args.device,
        warmup=1,
        repeats=args.repeats,
        min_repeats=3,
        budget_s=args.budget,
    )
    qg, kg, vg = inputs(L, dtype, args.device, grad=True)
    backward = {n: f for n, f in fns.items() if differentiable(n, args.device)}
    fb = time_interleaved(
        {n: forward_backward(f, qg, kg, vg) for n, f in backward.items()},
        device=args.device,
        warmup=1,
        repeats=args.repeats,
        min_repeats=3,
        budget_s=args.budget,
    )
    memory = {
        n: peak_bytes(forward_backward(f, qg, kg, vg), args.device) for n, f in backward.items()
    }
    row = {"setting": setting, "L": L, "dtype": str(dtype).removeprefix("torch."), "by": {}}
    row["flex_max_abs_diff_vs_tiled"] = flex_error
    for name in fns:
        fb_s = fb[name].median if name in fb else None
        row["by"][name] = {
            "fwd_s": fwd[name].median,
            "fb_s": fb_s,
            "peak_fb_bytes": memory.get(name),
            "fwd_gflops": useful_flops(setting, L, False) / fwd[name].median / 1e9,
            "fb_gflops": useful_flops(setting, L, True) / fb_s / 1e9 if fb_s else None,
        }
    log(
        f"{setting} L={L} {row['dtype']}: "
        + ", ".join(f"{n} fwd {r['fwd_s'] * 1e3:.0f} ms" for n, r in row["by"].items())
    )
    return row


def bench_tiled_alone(L: int, dtype: torch.dtype, args) -> dict:
    """Long sequences only the tiled path fits: forward time and f+b peak memory."""
    q, k, v = inputs(L, dtype, args.device, grad=True)
    fn = candidates("causal", L, dtype, args.device, 0)["tiled"]
    with torch.no_grad():
        fwd = time_interleaved(
            {"tiled": lambda: fn(q, k, v)}, device=args.device, warmup=1, repeats=1, min_repeats=1
        )["tiled"]
    memory = peak_bytes(forward_backward(fn, q, k, v), args.device)
    log(f"causal L={L} tiled alone: fwd {fwd.median:.1f} s, peak {memory / 2**20:.0f} MiB")
    by = {
        "tiled": {
            "fwd_s": fwd.median,
            "fb_s": None,
            "peak_fb_bytes": memory,
            "fwd_gflops": useful_flops("causal", L, False) / fwd.median / 1e9,
            "fb_gflops": None,
        }
    }
    return {"setting": "causal", "L": L, "dtype": str(dtype).removeprefix("torch."), "by": by}


def fitted_exponent(rows: list[dict], name: str, dtype: str) -> float | None:
    """Slope of log(peak bytes) against log(L): 1 for O(L) memory, 2 for O(L^2)."""
    points = [
        (math.log(r["L"]), math.log(r["by"][name]["peak_fb_bytes"]))
        for r in rows
        if r["setting"] == "causal"
        and r["dtype"] == dtype
        and name in r["by"]
        and r["by"][name]["peak_fb_bytes"] > 0
    ]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )


def extrapolated_naive_peak(rows: list[dict], dtype: str, L: int) -> float | None:
    """Naive peak at L from its largest measured point, scaled by the fitted exponent."""
    measured = [
        r for r in rows if r["setting"] == "causal" and r["dtype"] == dtype and "naive" in r["by"]
    ]
    exponent = fitted_exponent(rows, "naive", dtype)
    if not measured or exponent is None:
        return None
    last = max(measured, key=lambda r: r["L"])
    return last["by"]["naive"]["peak_fb_bytes"] * (L / last["L"]) ** exponent


def _ratio(candidate: dict, sdpa: dict | None, key: str) -> str:
    return f"{candidate[key] / sdpa[key]:.2f}" if sdpa and candidate[key] else ""


def table(rows: list[dict]) -> str:
    header = [
        "setting",
        "L",
        "dtype",
        "cand",
        "fwd ms",
        "f+b ms",
        "fwd GF/s",
        "peak f+b MiB",
        "fwd / sdpa",
        "f+b / sdpa",
    ]
    lines = []
    for r in rows:
        sdpa = r["by"].get("sdpa")
        for name, c in r["by"].items():
            lines.append(
                [
                    r["setting"],
                    r["L"],
                    r["dtype"],
                    name,
                    f"{c['fwd_s'] * 1e3:.1f}",
                    f"{c['fb_s'] * 1e3:.1f}" if c["fb_s"] else "-",
                    f"{c['fwd_gflops']:.1f}",
                    f"{c['peak_fb_bytes'] / 2**20:.1f}" if c["peak_fb_bytes"] else "-",
                    _ratio(c, sdpa, "fwd_s"),
                    _ratio(c, sdpa, "fb_s"),
                ]
            )
    return format_table(lines, header)


def verdicts(rows: list[dict], dtypes: list[str]) -> list[str]:
    out = []
    for dtype in dtypes:
        causal = [
            r
            for r in rows
            if r["setting"] == "causal"
            and r["dtype"] == dtype
            and r["L"] >= 2048
            and "sdpa" in r["by"]
        ]
        if causal:
            worst = max(r["by"]["tiled"]["fwd_s"] / r["by"]["sdpa"]["fwd_s"] for r in causal)
            out.append(
                f"{dtype}: tiled fwd / sdpa fwd, causal, L >= 2048: worst {worst:.2f} "
                f"(target <= 2, aim 1.3)"
            )
        exponent = fitted_exponent(rows, "tiled", dtype)
        if exponent is not None:
            out.append(
                f"{dtype}: tiled f+b peak memory ~ L^{exponent:.2f} (target <= 1.1); "
                f"naive ~ L^{fitted_exponent(rows, 'naive', dtype) or float('nan'):.2f}"
            )
        at_16k = [
            r
            for r in rows
            if r["L"] == 16384
            and r["dtype"] == dtype
            and r["setting"] == "causal"
            and "sdpa" in r["by"]
        ]
        naive_16k = extrapolated_naive_peak(rows, dtype, 16384)
        if at_16k and naive_16k:
            tiled = at_16k[0]["by"]["tiled"]["peak_fb_bytes"]
            out.append(
                f"{dtype}: at 16k tiled f+b peak {tiled / 2**20:.0f} MiB = 1/"
                f"{naive_16k / tiled:.0f} of naive's (extrapolated {naive_16k / 2**30:.1f} "
                f"GiB; target >= 8)"
            )
        window = [r for r in rows if r["setting"] == "window" and r["dtype"] == dtype]
        if window:
            last = max(window, key=lambda r: r["L"])
            speedup = last["by"]["sdpa"]["fwd_s"] / last["by"]["tiled"]["fwd_s"]
            out.append(
                f"{dtype}: window {WINDOW} at L={last['L']}: tiled {speedup:.1f}x faster "
                f"than SDPA with its dense mask (target >= 3 at 16k)"
            )
        with_flex = [r for r in rows if r["dtype"] == dtype and "flex" in r["by"]]
        if with_flex:
            ratio = {id(r): r["by"]["tiled"]["fwd_s"] / r["by"]["flex"]["fwd_s"] for r in with_flex}
            worst = max(with_flex, key=lambda r: ratio[id(r)])
            out.append(
                f"{dtype}: tiled fwd / FlexAttention fwd: worst {ratio[id(worst)]:.2f} "
                f"({worst['setting']} L={worst['L']}; > 1: FlexAttention is faster)"
            )
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = try_import_pyplot()
    if plt is None:
        return
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for setting in ("causal", "window"):
        for name in ("naive", "sdpa", "tiled", "flex"):
            points = [
                (r["L"], r["by"][name])
                for r in rows
                if r["setting"] == setting and r["dtype"] == "float32" and name in r["by"]
            ]
            if not points:
                continue
            label = f"{name} ({setting})"
            ax_time.loglog(
                [L for L, _ in points], [c["fwd_s"] for _, c in points], "o-", label=label
            )
            if setting == "causal" and all(c["peak_fb_bytes"] for _, c in points):
                ax_mem.loglog(
                    [L for L, _ in points],
                    [c["peak_fb_bytes"] / 2**20 for _, c in points],
                    "o-",
                    label=name,
                )
    ax_time.set(xlabel="L", ylabel="forward seconds (fp32)", title="time")
    ax_mem.set(xlabel="L", ylabel="peak MiB, forward + backward", title="memory (causal)")
    for ax in (ax_time, ax_mem):
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of timing per set")
    parser.add_argument("--naive-max", type=int, default=4096, help="largest L for naive math")
    parser.add_argument("--long", action="store_true", help="also tiled alone at 32k and 64k")
    parser.add_argument("--quick", action="store_true", help="L = 1k, 2k, fp32 only")
    parser.add_argument("--out", type=Path, default=RESULTS / "flash.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.dtypes, args.repeats = [1024, 2048], ["fp32"], 3
        args.out = args.out.with_name("flash_quick.json")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for setting in ("causal", "window"):
            for L in args.lengths:
                if setting == "window" and L <= WINDOW:
                    continue
                rows.append(bench(setting, L, dtype, args))
        if args.long:
            rows += [bench_tiled_alone(L, dtype, args) for L in (32768, 65536)]
    dtype_names = [str(DTYPES[d]).removeprefix("torch.") for d in args.dtypes]
    peaks = {d: matmul_rate(DTYPES[d], args.device)["peak"] / 1e9 for d in args.dtypes}
    info = machine_info(args.device)
    print(
        f"tiled FlashAttention vs SDPA vs naive: B=1, H={HEADS}, D={HEAD_DIM}; "
        f"{info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}"
    )
    print(
        "matmul GFLOP/s (the hardware proxy): "
        + ", ".join(f"{d} {p:.0f}" for d, p in peaks.items())
    )
    print(table(rows))
    for line in verdicts(rows, dtype_names):
        print(line)
    write_json(
        args.out,
        {
            "machine": info,
            "matmul_gflops": peaks,
            "rows": rows,
            "verdicts": verdicts(rows, dtype_names),
        },
    )
    plot(rows, args.out.with_suffix(".png"))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
