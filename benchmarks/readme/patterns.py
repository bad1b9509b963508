"""The section of benchmarks/patterns.py: attention patterns against SDPA and FlexAttention.

One table per result file (forward; forward + backward), a row per (pattern, L, dtype): every
candidate's median time, the backend `auto` ran, the best peer and auto's paired ratio to it
(target <= 1), and the tiled path's paired ratio to SDPA (target <= 2 on the causal rows).
"""

from __future__ import annotations

from .format import dtype_name, dtype_rank, get, md_table, num, prose
from .machine import machine_table

# The default run, and the same run with PyTorch's kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2: the CPU kind without AVX-512).
# The long rows (L = 16384) run apart: a forward run over every length takes half an hour.
PATTERN_FILES = (
    "patterns",
    "patterns_backward",
    "patterns_long",
    "patterns_backward_long",
    "patterns_avx2",
    "patterns_backward_avx2",
)
CANDIDATES = ("auto", "tiled", "sdpa", "flex", "eager")
ORDER = ("causal", "window", "sinks", "alibi", "softcap")

PATTERNS_TEXT = """\
`qkv.attention` with a pattern, on (B, H, L, D) = (1, 8, L, 64) self-attention, against what a
user would write for the same pattern: `F.scaled_dot_product_attention` (`is_causal=True`, or the
pattern's dense bool mask or float bias, built outside the timed call; it cannot soft-cap) and
PyTorch's FlexAttention (`torch.compile(flex_attention)` with the pattern's `score_mod` and the
`BlockMask` from `create_block_mask`, built outside the timed call; forward only on the CPU,
where torch has no FlexAttention backward). Eager math (the scores materialised) is the peer
where neither runs: soft-capping with gradients. Patterns: causal; a causal window of 1024
keys; the window with 4 attention sinks; causal ALiBi; causal soft-capping at 30. `tiled` is
the same qkv call with `backend="tiled"`. Every candidate's output is compared with float64
eager math before timing; a wrong one is not timed. "auto/best" is the median of per-round
ratios of auto's time to the best peer's (target: at most 1; '!' marks a miss);
"tiled/sdpa" likewise (target on the causal rows: at most 2)."""


def patterns_section(results: dict[str, dict]) -> list[str]:
    files = [(stem, results[stem]) for stem in PATTERN_FILES if stem in results]
    if not files:
        return []
    lines = ["## Attention patterns: qkv against SDPA and FlexAttention", ""]
    lines += prose(PATTERNS_TEXT)
    for stem, data in files:
        rows = sorted(
            data.get("rows", []),
            key=lambda r: (dtype_rank(r["dtype"]), r["L"], _rank(r["pattern"])),
        )
        ratios = [r["paired_auto_vs_best_peer"] for r in rows]
        ratios = [x for x in ratios if isinstance(x, int | float)]
        met = sum(x <= 1.0 for x in ratios)
        kernels = get(data, "machine", "torch_cpu_capability", default=None) or "?"
        title = f"{data.get('mode', stem)}, {kernels} kernels"
        lines += ["", f"### {title} (`results/{stem}.json`)", ""]
        if ratios:
            lines += prose(
                f"auto at most the best peer's time on {met} of {len(ratios)} rows; auto/best "
                f"from {min(ratios):.2f} to {max(ratios):.2f}."
            )
            lines.append("")
        lines += md_table(
            ["pattern", "L", "dtype", *(f"{n} ms" for n in CANDIDATES)]
            + ["auto ran", "best peer", "auto/best", "tiled/sdpa"],
            [_row(r) for r in rows],
        )
    lines += ["", *machine_table(files)]
    return lines


def _rank(pattern: str) -> int:
    return ORDER.index(pattern) if pattern in ORDER else len(ORDER)


def _row(r: dict) -> list[str]:
    ratio = r.get("paired_auto_vs_best_peer")
    shown = num(ratio, ".2f") + ("!" if isinstance(ratio, int | float) and ratio > 1.0 else "")
    return [
        r["pattern"],
        str(r["L"]),
        dtype_name(r["dtype"]),
        *(num(get(r, "ms", n), ".1f") for n in CANDIDATES),
        str(r.get("auto_backend", "-")),
        str(r.get("best_peer") or "-"),
        shown,
        num(r.get("paired_tiled_vs_sdpa"), ".2f"),
    ]
