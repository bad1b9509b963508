"""Benchmark (GPU): qkv's Triton FlashAttention vs SDPA's flash backend (and flash-attn).

    python benchmarks/flash_gpu.py                 # L = 1k .. 16k, D = 64 and 128, bf16
    python benchmarks/flash_gpu.py --quick         # L = 1k, 4k, D = 128

Candidates, on (B, H, L, D) with B * L = 16k tokens and H * D = 2048 (the FlashAttention-2
paper's setting), bf16, self-attention, side by side in one process:
    triton      qkv.triton_attention(q, k, v, causal=c)
    sdpa_flash  F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    flash_attn  flash_attn.flash_attn_func (only where the package is installed)

FLOPs (FlashAttention-2 paper, section 4.1), useful work only:
    forward            4 * B * H * L^2 * D        (Q K^T and P V: 2 * B * H * L^2 * D each)
    forward + backward 3.5 * forward FLOPs        (backward = 2.5x forward: 5 matmuls, one
                                                   of them the recomputed Q K^T)
    causal             half of each
reported in TFLOP/s and as a fraction of the card's dense bf16 peak (--peak-tflops, default
989 for an H100 SXM; an H200 has the same) and of a measured bf16 matmul.

Targets: forward + backward >= 0.9x SDPA flash's throughput at L >= 4k; forward
>= 50% of the bf16 dense peak at L >= 4k, D = 128.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    format_table,
    log,
    machine_info,
    matmul_rate,
    time_interleaved,
    try_import_pyplot,
    write_json,
)

import qkv

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS, WIDTH = 16384, 2048


def candidates(causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    found = {
        "triton": lambda q, k, v: qkv.triton_attention(q, k, v, causal=causal),
        "sdpa_flash": sdpa_flash,
    }
    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_func

        found["flash_attn"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal
        ).transpose(1, 2)
    return found


def flops(B: int, H: int, L: int, D: int, causal: bool, backward: bool) -> float:
    forward = 4 * B * H * L * L * D / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def bench(L: int, D: int, causal: bool, args, peak: float) -> dict:
    B, H = max(1, TOKENS // L), WIDTH // D
    q, k, v = (
        torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    fns = candidates(causal)
    reference = fns["sdpa_flash"](q, k, v)
    for name, fn in fns.items():
        error = (fn(q, k, v).float() - reference.float()).abs().max().item()
        if error > 2e-2:
            raise RuntimeError(f"{name} differs from SDPA by {error} at L={L}, D={D}")

    def forward_backward(fn):
        def run():
            out = fn(q, k, v)
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

        return run

    with torch.no_grad():
        fwd = time_interleaved(
            {n: (lambda f=f: f(q, k, v)) for n, f in fns.items()},
            device="cuda",
            repeats=args.repeats,
        )
    fb = time_interleaved(
        {n: forward_backward(f) for n, f in fns.items()}, device="cuda", repeats=args.repeats
    )
    row = {"L": L, "D": D, "B": B, "H": H, "causal": causal, "by": {}}
    for name in fns:
        fwd_tflops = flops(B, H, L, D, causal, False) / fwd[name].median / 1e12
        fb_tflops = flops(B, H, L, D, causal, True) / fb[name].median / 1e12
        row["by"][name] = {
            "fwd_tflops": fwd_tflops,
            "fb_tflops": fb_tflops,
            "fwd_of_peak": fwd_tflops / peak,
            "fwd_s": fwd[name].median,
            "fb_s": fb[name].median,
        }
    log(
        f"L={L} D={D} causal={causal}: "
        + ", ".join(
            f"{n} {r['fwd_tflops']:.0f}/{r['fb_tflops']:.0f} TF/s" for n, r in row["by"].items()
        )
    )
    return row


def report(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        sdpa = r["by"]["sdpa_flash"]
        for name, c in r["by"].items():
            lines.append(
                [
                    r["L"],
                    r["D"],
                    "yes" if r["causal"] else "no",
                    name,
                    f"{c['fwd_tflops']:.0f}",
                    f"{c['fb_tflops']:.0f}",
                    f"{100 * c['fwd_of_peak']:.0f}%",
                    f"{c['fb_tflops'] / sdpa['fb_tflops']:.2f}",
                ]
            )
    header = ["L", "D", "causal", "cand", "fwd TF/s", "f+b TF/s", "fwd % peak", "f+b / sdpa"]
    return format_table(lines, header)


def plot(rows: list[dict], path: Path) -> None:
    plt = try_import_pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("fwd_tflops", "fb_tflops"), strict=True):
        for D in sorted({r["D"] for r in rows}):
            for causal in (False, True):
                for name in rows[0]["by"]:
                    pts = [
                        (r["L"], r["by"][name][key])
                        for r in rows
                        if r["D"] == D and r["causal"] == causal and name in r["by"]
                    ]
                    ax.semilogx(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        "o-",
                        label=f"{name} D={D}{' causal' if causal else ''}",
                    )
        ax.set(xlabel="L", ylabel="TFLOP/s", title=key.replace("_tflops", ""))
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "flash_gpu.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flash_gpu.py needs a CUDA GPU (see benchmarks/flash.py for the CPU)")
    if args.quick:
        args.lengths, args.head_dims, args.repeats = [1024, 4096], [128], 5
    measured = matmul_rate(torch.bfloat16, "cuda", n=8192)["peak"] / 1e12
    rows = [
        bench(L, D, causal, args, args.peak_tflops)
        for D in args.head_dims
        for causal in (False, True)
        for L in args.lengths
    ]
    info = machine_info("cuda")
    print(
        f"{info['device_name']}: bf16 dense peak {args.peak_tflops:.0f} TFLOP/s (spec), "
        f"measured matmul {measured:.0f} TFLOP/s"
    )
    print(report(rows))
    write_json(
        args.out,
        {"machine": info, "peak_tflops": args.peak_tflops, "matmul_tflops": measured, "rows": rows},
    )
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
