"""Benchmark: block-sparse attention (a BigBird pattern) against SDPA with its dense mask and
FlexAttention with its BlockMask.

    .venv/bin/python benchmarks/sparse.py              # L = 4096 .. 65536, forward, fp32
    .venv/bin/python benchmarks/sparse.py --quick      # smoke run: L = 1024, 2048

The pattern (Zaheer et al. 2020, s2, with their block of 64 tokens): a window of 64 keys on
each side, the first 128 tokens global, 3 random key blocks per query block, on (B, H, L, D) =
(1, 8, L, 64) self-attention. Every query sees O(1) blocks, so the work is O(L).

Candidates:
    qkv    qkv.attention(q, k, v, pattern=...), backend "auto" (its choice is recorded); the
           tiled FlashAttention visits only the tiles the pattern leaves visible
    sdpa   F.scaled_dot_product_attention with the pattern's dense (L, L) bool mask, built
           outside the timed call (up to --dense-max: the mask alone is L^2 bytes)
    flex   torch.compile(flex_attention) with a BlockMask of the same blocks and a mask_mod
           written from the paper's definition (built outside the timed call)

The outputs are compared with each other before timing (and with float64 eager attention at the
smallest length). Peak memory: how far one call of each candidate lifts the resident set, in a
fresh process that built only its inputs (SDPA's dense mask, L^2 bytes, is built before the
call and reported apart; `--no-memory` skips it). Targets: qkv's time grows like L (the
exponent fitted to its times, ~1), and at 16k qkv is >= 5x faster than SDPA with the mask.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import format_table, log, machine_info, time_interleaved, write_json
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import qkv
from qkv.attention import sparse

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, HEADS, HEAD_DIM = 1, 8, 64
WINDOW, GLOBAL, RANDOM, BLOCK, SEED = 64, 128, 3, 64, 0
FLEX_BLOCK = 128
PATTERN = sparse.bigbird(
    window=WINDOW, global_tokens=GLOBAL, random_blocks=RANDOM, block=BLOCK, seed=SEED
)
COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
TARGET_RATIO_16K = 5.0


def inputs(L: int, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(L)
    return tuple(torch.randn(BATCH, HEADS, L, HEAD_DIM, generator=generator, dtype=dtype)
                 for _ in "qkv")  # fmt: skip


def flex_block_mask(L: int) -> BlockMask:
    """FlexAttention's BlockMask: the pattern's occupied blocks (qkv.attention.sparse.layout),
    and a mask_mod for the partly visible ones, from BigBird's definition."""
    table = PATTERN.parts[2].table(L)  # (L / BLOCK, L / BLOCK): the random blocks

    def mask_mod(batch, head, q_idx, k_idx):
        near = (k_idx - q_idx).abs() <= WINDOW
        is_global = (q_idx < GLOBAL) | (k_idx < GLOBAL)
        return near | is_global | table[q_idx // BLOCK, k_idx // BLOCK]

    computed, full = sparse.layout(PATTERN, L, L, FLEX_BLOCK, FLEX_BLOCK)
    partial = computed & ~full

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = blocks.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return count[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(L, L))  # fmt: skip


def candidates(L: int, dense_max: int, only: tuple[str, ...] = ("qkv", "sdpa", "flex")) -> dict:
    """{name: call} of the candidates in `only`, their masks built here, outside the call."""
    q, k, v = inputs(L)
    calls = {}
    if "qkv" in only:
        calls["qkv"] = lambda: qkv.attention(q, k, v, pattern=PATTERN)
    if "sdpa" in only and dense_max >= L:
        mask = sparse.dense_mask(PATTERN, L, L)
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if "flex" in only:
        block_mask = flex_block_mask(L)
        calls["flex"] = lambda: COMPILED_FLEX(q, k, v, block_mask=block_mask)
    return calls


def check(calls: dict, L: int) -> dict:
    """Largest difference of each candidate from qkv's output (and qkv's from float64 eager
    attention at small L); raises if one is off."""
    with torch.no_grad():
        outputs = {name: call() for name, call in calls.items()}
    differences = {name: float((out - outputs["qkv"]).abs().max()) for name, out in outputs.items()}
    if L <= 2048:
        q, k, v = (t.double() for t in inputs(L))
        visible = sparse.dense_mask(PATTERN, L, L)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~visible, -math.inf)
        exact = scores.softmax(dim=-1) @ v
        differences["qkv_vs_float64"] = float((outputs["qkv"].double() - exact).abs().max())
    for name, difference in differences.items():
        if difference > 1e-3:
            raise RuntimeError(f"L={L}: {name} differs by {difference:.2e}: not timed")
    return differences


def peak_memory(name: str, L: int, dense_max: int) -> float:
    """MiB the resident set peaks above its level before one call, in a fresh process that
    builds only this candidate's inputs (and mask) first. Linux's VmHWM, reset before the call
    (`/proc/self/clear_refs`): a child's ru_maxrss would start from its parent's peak."""
    here = str(Path(__file__).resolve().parent)
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, here, name, str(L), str(dense_max)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(result.stdout.split()[-1]) / 1024  # kB -> MiB


_PEAK_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import sparse

def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(field))

name = sys.argv[2]
call = sparse.candidates(int(sys.argv[3]), int(sys.argv[4]), only=(name,))[name]
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as reset:
    reset.write("5")  # the peak (VmHWM) starts again from the present resident set
call()
print(status("VmHWM:") - before)
"""


def bench_row(L: int, args) -> dict:
    log(f"L={L}: preparing ...")
    calls = candidates(L, args.dense_max)
    q = inputs(L)[0]
    chosen = qkv.explain(q, q, q, pattern=PATTERN).split("'")[1]
    differences = check(calls, L)
    computed, _ = sparse.layout(PATTERN, L, L, BLOCK, BLOCK)
    log(f"L={L}: timing {', '.join(calls)} ...")
    with torch.no_grad():
        timings = time_interleaved(calls, device="cpu", warmup=1, repeats=args.repeats,
                                   min_repeats=min(args.repeats, 3))  # fmt: skip
    seconds = {name: t.median for name, t in timings.items()}
    row = {
        "length": L,
        "auto_backend": chosen,
        "computed_fraction": float(computed.float().mean()),
        "dense_mask_mib": L * L / 2**20,  # what SDPA is handed (bool), built before its call
        "seconds": seconds,
        "ratios": {name: seconds[name] / seconds["qkv"] for name in seconds if name != "qkv"},
        "max_abs_difference": differences,
        "timings": {name: t.as_dict() for name, t in timings.items()},
    }
    if args.memory:
        log(f"L={L}: peak memory ...")
        names = [n for n in ("qkv", "sdpa") if n in calls]
        row["peak_memory_mib"] = {n: peak_memory(n, L, args.dense_max) for n in names}
    return row


def fitted_exponent(rows: list[dict], name: str) -> float | None:
    """The slope of log(time) against log(L), least squares: ~1 for work proportional to L."""
    points = [(math.log(r["length"]), math.log(r["seconds"][name]))
              for r in rows if name in r["seconds"]]  # fmt: skip
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return covariance / sum((x - mean_x) ** 2 for x, _ in points)


def table(rows: list[dict]) -> str:
    header = ["L", "auto", "blocks computed", "qkv s", "sdpa s", "flex s", "sdpa / qkv",
              "flex / qkv", "qkv MiB", "sdpa MiB"]  # fmt: skip
    body = []
    for r in rows:
        s, ratio, memory = r["seconds"], r["ratios"], r.get("peak_memory_mib", {})
        times = [f"{s[n]:.3f}" if n in s else "-" for n in ("qkv", "sdpa", "flex")]
        ratios = [f"{ratio[n]:.2f}" if n in ratio else "-" for n in ("sdpa", "flex")]
        memories = [f"{memory[n]:.0f}" if n in memory else "-" for n in ("qkv", "sdpa")]
        fraction = f"{r['computed_fraction']:.1%}"
        body.append([r["length"], r["auto_backend"], fraction, *times, *ratios, *memories])
    return format_table(body, header)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 1024, 2048: a smoke run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--dense-max", type=int, default=16384, help="longest L given to SDPA")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats = [1024, 2048], 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = [bench_row(L, args) for L in args.lengths]
    at_16k = next((r for r in rows if r["length"] == 16384), None)
    payload = {
        "machine": machine_info("cpu"),
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "fp32"},
        "pattern": {
            "window": WINDOW,
            "global_tokens": GLOBAL,
            "random_blocks": RANDOM,
            "block": BLOCK,
            "seed": SEED,
            "flex_block": FLEX_BLOCK,
        },  # fmt: skip
        "targets": {"exponent": 1.0, "sdpa_over_qkv_at_16k": TARGET_RATIO_16K},
        "fitted_exponent": {n: fitted_exponent(rows, n) for n in ("qkv", "sdpa", "flex")},
        "sdpa_over_qkv_at_16k": None if at_16k is None else at_16k["ratios"].get("sdpa"),
        "rows": rows,
    }
    name = "sparse_quick.json" if args.quick else "sparse.json"
    write_json(RESULTS / name, payload)
    print(table(rows))
    print(f"fitted exponents: {payload['fitted_exponent']}")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
