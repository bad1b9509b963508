"""FlashAttention's I/O: the bytes tiled attention moves, modelled exactly and counted per tile.

Dao et al. 2022 (s3.2, Theorem 2) bound the HBM traffic of standard attention (Algorithm 0) by
Theta(N d + N^2) and that of FlashAttention (Algorithm 1) by Theta(N^2 d^2 / M) for an SRAM of M
elements. `qkv.analysis.cost.flash_io` gives the exact counts behind both, and the exact count
of the loop `qkv.flash_attention` runs (FlashAttention-2's order, Dao 2023: query blocks
outside, key blocks inside, causal tiles above the diagonal skipped). This study runs that loop
inside `qkv.attention.tiled.count_tile_traffic`, which records every Q, K, V, output and
log-sum-exp slice it moves, and sets the count beside the three models:

- the table: one head of N queries and keys, head dimension d, in fp32 (4 bytes per element,
  the dtype the loop computes in), with the paper's blocks B_r, B_c for each SRAM size M;
  standard attention and Algorithm 1 compute every score, causal or not, so their columns do
  not change with `causal`;
- the sweep: bytes against the block size B for a few N, with B_c = B (and the paper's
  B_r = min(B, d)) for Algorithm 1, B_r = B_c = B for qkv's loop (counted where N is at most
  `count_up_to`), standard attention, and Theorem 2's N^2 d^2 / M at the M = 4 d B for which
  the paper's rule gives B_c = B, drawn where the theorem applies (d <= M <= N d).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from qkv.analysis.cost.flash_io import (
    flash_attention_io,
    paper_block_sizes,
    standard_attention_io,
    theorem2_flash,
    tiled_forward_io,
)
from qkv.attention.tiled import TileTraffic, count_tile_traffic, flash_attention
from qkv.studies.record import StudyResult, Verdict, grade

__all__ = ["CLAIM", "SIZES", "TITLE", "figure", "run", "verdicts"]

TITLE = "FlashAttention's HBM traffic: modelled and counted per tile"
CLAIM = (
    "FlashAttention moves Theta(N^2 d^2 / M) elements between HBM and SRAM where standard "
    "attention moves Theta(N d + N^2) (Dao et al. 2022, Theorem 2); the exact count of qkv's "
    "tiled loop (FlashAttention-2's order, Dao 2023) equals the bytes it moves, counted tile "
    "by tile."
)
ELEMENT_BYTES = torch.float32.itemsize  # the loop computes in fp32
TENSORS = ("q", "k", "v", "o", "s", "p", "l", "m", "lse")  # the breakdown's stacking order
STANDARD, PAPER, MODEL, COUNTED = (
    "standard bytes", "Algorithm 1 bytes", "qkv model bytes", "qkv counted bytes"
)  # fmt: skip
Q_READS = "of which Q reads"
SWEEP_CURVES = ("standard", "Algorithm 1", "qkv model", "qkv counted", "theorem 2")
BREAKDOWN = ("standard", "Algorithm 1", "qkv counted")

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "head_dim": 8, "lengths": [24, 37], "sram_elements": [64, 160],
        "sweep_lengths": [32, 64], "sweep_blocks": [4, 8, 16], "count_up_to": 64,
    },
    "default": {
        "head_dim": 64, "lengths": [256, 1000, 2048, 4096], "sram_elements": [16384, 49152],
        "sweep_lengths": [1024, 4096, 16384], "sweep_blocks": [16, 32, 64, 128, 256, 512, 1024],
        "count_up_to": 4096,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Count the tiled forward's traffic on every table shape and sweep point; model them."""
    generator = torch.Generator().manual_seed(seed)
    rows, breakdown = _table(settings, generator)
    series = {
        "head_dim": settings["head_dim"],
        "element_bytes": ELEMENT_BYTES,
        "sweep": _sweep(settings, generator),
        "breakdown": breakdown,
    }
    return StudyResult(
        name="flash-io", title=TITLE, claim=CLAIM, columns=list(rows[0]), rows=rows,
        findings=_findings(series, rows), series=series,
    )  # fmt: skip


def count_forward(
    *, length: int, head_dim: int, block_q: int, block_k: int, causal: bool, generator
) -> TileTraffic:
    """The transfers of one `qkv.flash_attention` forward on random fp32 (1, 1, N, d) inputs."""
    q, k, v = (torch.randn(1, 1, length, head_dim, generator=generator) for _ in range(3))
    with torch.no_grad(), count_tile_traffic() as traffic:
        flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    return traffic


def _table(settings: dict[str, Any], generator) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per (N, M, causal); and the per-tensor bytes of the largest non-causal shape."""
    d, rows, breakdown = settings["head_dim"], [], {}
    largest = (max(settings["lengths"]), max(settings["sram_elements"]))
    for length in settings["lengths"]:
        standard = standard_attention_io(seq_len=length, head_dim=d, element_bytes=ELEMENT_BYTES)
        for sram in settings["sram_elements"]:
            block_q, block_k = paper_block_sizes(sram_elements=sram, head_dim=d)
            blocks = {"block_q": block_q, "block_k": block_k}
            paper = flash_attention_io(seq_len=length, head_dim=d, **blocks,
                                       element_bytes=ELEMENT_BYTES)  # fmt: skip
            for causal in (False, True):
                model = tiled_forward_io(query_len=length, key_len=length, head_dim=d, **blocks,
                                         causal=causal, element_bytes=ELEMENT_BYTES)  # fmt: skip
                counted = count_forward(length=length, head_dim=d, **blocks, causal=causal,
                                        generator=generator)  # fmt: skip
                rows.append(_row(length, d, sram, blocks, causal, standard, paper, model, counted))
                if not causal and (length, sram) == largest:
                    breakdown = _breakdown(rows[-1], standard, paper, counted)
    return rows, breakdown


def _row(length, d, sram, blocks, causal, standard, paper, model, counted) -> dict[str, Any]:
    logger.info("N=%d M=%d causal=%s: counted %d bytes, model %d", length, sram, causal,
                counted.bytes(), model.bytes)  # fmt: skip
    return {
        "N": length, "d": d, "causal": causal, "M": sram, "B_r": blocks["block_q"],
        "B_c": blocks["block_k"], STANDARD: standard.bytes, PAPER: paper.bytes,
        MODEL: model.bytes, COUNTED: counted.bytes(),
        "counted / model": counted.bytes() / model.bytes,
        "standard / counted": standard.bytes / counted.bytes(),
        Q_READS: counted.bytes(direction="read", tensor="q"),
    }  # fmt: skip


def _breakdown(row: dict[str, Any], standard, paper, counted: TileTraffic) -> dict[str, Any]:
    """Bytes per tensor (read + written) of standard attention, Algorithm 1 and qkv's count."""
    per_tensor = {
        "standard": {t: standard.tensor_bytes(t) for t in TENSORS},
        "Algorithm 1": {t: paper.tensor_bytes(t) for t in TENSORS},
        "qkv counted": {t: counted.bytes(tensor=t) for t in TENSORS},
    }
    shape = {key: row[key] for key in ("N", "d", "M", "B_r", "B_c")}
    return {"shape": shape, **{name: {t: b for t, b in bytes_.items() if b}
                               for name, bytes_ in per_tensor.items()}}  # fmt: skip


def _sweep(settings: dict[str, Any], generator) -> dict[str, Any]:
    """Bytes against the block size B: per curve, one list per N (None where not counted, or
    outside Theorem 2's range)."""
    d, blocks = settings["head_dim"], settings["sweep_blocks"]
    curves: dict[str, list] = {name: [] for name in SWEEP_CURVES}
    for length in settings["sweep_lengths"]:
        standard = standard_attention_io(seq_len=length, head_dim=d, element_bytes=ELEMENT_BYTES)
        curves["standard"].append(standard.bytes)
        points = [_sweep_point(length, d, block, settings, generator) for block in blocks]
        for name in SWEEP_CURVES[1:]:
            curves[name].append([point[name] for point in points])
    return {"lengths": settings["sweep_lengths"], "blocks": blocks, **curves}


def _sweep_point(length: int, d: int, block: int, settings, generator) -> dict[str, Any]:
    paper = flash_attention_io(seq_len=length, head_dim=d, block_q=min(block, d),
                               block_k=block, element_bytes=ELEMENT_BYTES)  # fmt: skip
    model = tiled_forward_io(query_len=length, key_len=length, head_dim=d, block_q=block,
                             block_k=block, element_bytes=ELEMENT_BYTES)  # fmt: skip
    counted = None
    if length <= settings["count_up_to"]:
        counted = count_forward(length=length, head_dim=d, block_q=block, block_k=block,
                                causal=False, generator=generator).bytes()  # fmt: skip
        logger.info("sweep N=%d B=%d: counted %d bytes, model %d", length, block, counted,
                    model.bytes)  # fmt: skip
    sram = 4 * d * block  # the M whose paper blocks have B_c = B
    bound = None
    if d <= sram <= length * d:
        bound = theorem2_flash(seq_len=length, head_dim=d, sram_elements=sram) * ELEMENT_BYTES
    return {"Algorithm 1": paper.bytes, "qkv model": model.bytes, "qkv counted": counted,
            "theorem 2": bound}  # fmt: skip


def _findings(series: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Sentences read off the numbers: exactness, the savings, where tiling starts to pay,
    Theorem 2's hidden constant, what Q's re-reads and causal skipping weigh."""
    return [
        _exactness(series["sweep"], rows),
        _savings(series["breakdown"]),
        _kv_passes(series["breakdown"], series["element_bytes"]),
        _crossovers(series["sweep"]),
        _theorem_constant(series["sweep"], series["head_dim"]),
        _q_share(rows, series["element_bytes"]),
        _causal(rows),
    ]


def _exactness(sweep: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    pairs = [(row[COUNTED], row[MODEL]) for row in rows]
    for counted, model in zip(sweep["qkv counted"], sweep["qkv model"], strict=True):
        pairs += [(c, m) for c, m in zip(counted, model, strict=True) if c is not None]
    off = [abs(c / m - 1) for c, m in pairs if c != m]
    if not off:
        return (
            f"Counted bytes equal qkv's exact model at all {len(pairs)} counted shapes "
            f"({len(rows)} table rows, {len(pairs) - len(rows)} sweep points): counted / model "
            f"= 1 exactly."
        )
    return (
        f"Counted bytes differ from qkv's model at {len(off)} of {len(pairs)} counted shapes; "
        f"largest |counted / model - 1| = {max(off):.3g}."
    )


def _savings(breakdown: dict[str, Any]) -> str:
    shape = breakdown["shape"]
    mib = {name: sum(breakdown[name].values()) / 2**20 for name in BREAKDOWN}
    standard, paper, counted = (mib[name] for name in BREAKDOWN)
    return (
        f"At N = {shape['N']}, d = {shape['d']}, M = {shape['M']} (B_r = {shape['B_r']}, "
        f"B_c = {shape['B_c']}): standard attention moves {standard:.3g} MiB, Algorithm 1 "
        f"{paper:.3g} MiB (standard / Algorithm 1 = {standard / paper:.3g}), qkv's loop "
        f"(counted) {counted:.3g} MiB (standard / qkv = {standard / counted:.3g})."
    )


def _kv_passes(breakdown: dict[str, Any], element_bytes: int) -> str:
    shape, counted = breakdown["shape"], breakdown["qkv counted"]
    once = 2 * shape["N"] * shape["d"] * element_bytes  # K and V, each read once
    passes = (counted["k"] + counted["v"]) / once
    share = (counted["k"] + counted["v"]) / sum(counted.values())
    return (
        f"There qkv's loop reads K and V {passes:.3g} times (once per query block of "
        f"B_r = {shape['B_r']}), {share:.1%} of its counted bytes; Algorithm 1 reads them once "
        f"and makes its passes over Q and O instead, so its count depends on B_c alone and qkv's "
        f"on B_r as well."
    )


def _crossovers(sweep: dict[str, Any]) -> str:
    parts = []
    for length, standard, paper in zip(
        sweep["lengths"], sweep["standard"], sweep["Algorithm 1"], strict=True
    ):
        below = [b for b, value in zip(sweep["blocks"], paper, strict=True) if value < standard]
        parts.append(f"N = {length}: from B_c = {min(below)}" if below else f"N = {length}: none")
    return (
        "Smallest swept block at which Algorithm 1 moves fewer bytes than standard attention: "
        + "; ".join(parts) + "."
    )  # fmt: skip


def _theorem_constant(sweep: dict[str, Any], d: int) -> str:
    paper, bound = sweep["Algorithm 1"][-1], sweep["theorem 2"][-1]
    ratios = [p / b for p, b in zip(paper, bound, strict=True) if b is not None]
    if not ratios:
        return f"No swept block puts M = 4 d B in Theorem 2's range at N = {sweep['lengths'][-1]}."
    return (
        f"At N = {sweep['lengths'][-1]}, Algorithm 1's exact count is {min(ratios):.3g}x to "
        f"{max(ratios):.3g}x N^2 d^2 / M over the swept blocks: the constant Theta hides, "
        f"12 + 16 / d = {12 + 16 / d:.3g} for large N (3 N d + 4 N elements per pass, "
        f"N / B_c = 4 d N / M passes)."
    )


def _q_share(rows: list[dict[str, Any]], element_bytes: int) -> str:
    row = max((r for r in rows if not r["causal"]), key=lambda r: (r["N"], r["M"]))
    q_once = row["N"] * row["d"] * element_bytes
    kept = row[COUNTED] - row[Q_READS] + q_once
    return (
        f"Q re-reads are {row[Q_READS] / row[COUNTED]:.1%} of qkv's counted bytes at "
        f"N = {row['N']}, M = {row['M']}: the PyTorch loop takes Q_i at every tile; a kernel "
        f"keeping Q_i in SRAM (FlashAttention-2) would move {row[COUNTED] / kept:.3g}x fewer."
    )


def _causal(rows: list[dict[str, Any]]) -> str:
    longest, parts = max(row["N"] for row in rows), []
    for sram in sorted({row["M"] for row in rows}):
        pair = {r["causal"]: r[COUNTED] for r in rows if r["N"] == longest and r["M"] == sram}
        parts.append(f"{pair[True] / pair[False]:.3g}x at M = {sram}")
    return (
        f"Causal masking, its hidden tiles skipped, leaves qkv's loop at N = {longest} with "
        + ", ".join(parts) + " the counted bytes of full attention."
    )  # fmt: skip


def figure(result: StudyResult):
    """Left: bytes against block size (log-log) per N: standard attention, Algorithm 1, qkv's
    loop (modelled line, counted markers), Theorem 2's form. Right: bytes per tensor."""
    from matplotlib.figure import Figure

    series = result.series
    fig = Figure(figsize=(12, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    _draw_sweep(left, series["sweep"])
    _draw_breakdown(right, series["breakdown"])
    fig.suptitle(TITLE)
    return fig


def _draw_sweep(ax, sweep: dict[str, Any]) -> None:
    blocks = sweep["blocks"]
    colours = ["C0", "C1", "C2", "C3", "C4", "C5"]
    for index, length in enumerate(sweep["lengths"]):
        colour = colours[index % len(colours)]
        ax.axhline(sweep["standard"][index], color=colour, linestyle=":", linewidth=1)
        ax.plot(blocks, sweep["Algorithm 1"][index], "-", color=colour, label=f"N = {length}")
        ax.plot(blocks, sweep["qkv model"][index], "--", color=colour)
        xs, ys = _known(blocks, sweep["qkv counted"][index])
        ax.plot(xs, ys, "o", color=colour, markersize=4, fillstyle="none")
        xs, ys = _known(blocks, sweep["theorem 2"][index])
        ax.plot(xs, ys, "-.", color=colour, linewidth=1)
    for style, label in (
        (":", "standard attention"),
        ("-", "Algorithm 1 (B_c = B)"),
        ("--", "qkv's loop (B_r = B_c = B)"),
        ("-.", "N^2 d^2 / M, M = 4dB"),
    ):
        ax.plot([], [], style, color="grey", label=label)  # fmt: skip
    ax.plot([], [], "o", color="grey", fillstyle="none", label="qkv counted")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size B (keys per block)")
    ax.set_ylabel("HBM bytes, forward, one head (fp32)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def _known(blocks: list[int], values: list) -> tuple[list[int], list]:
    """The (block, value) points whose value is known (not None), as two lists."""
    kept = [
        (block, value) for block, value in zip(blocks, values, strict=True) if value is not None
    ]
    return [block for block, _ in kept], [value for _, value in kept]


def _draw_breakdown(ax, breakdown: dict[str, Any]) -> None:
    names = list(BREAKDOWN)
    for index, tensor in enumerate(TENSORS):
        left = [sum(breakdown[n].get(t, 0) for t in TENSORS[:index]) / 2**20 for n in names]
        width = [breakdown[n].get(tensor, 0) / 2**20 for n in names]
        if any(width):
            ax.barh(names, width, left=left, label=tensor, color=f"C{index}")
    shape = breakdown["shape"]
    ax.set_title(f"N = {shape['N']}, d = {shape['d']}, B_r = {shape['B_r']}, "
                 f"B_c = {shape['B_c']}", fontsize=9)  # fmt: skip
    ax.set_xlabel("MiB read + written, by tensor")
    ax.invert_yaxis()
    ax.legend(fontsize=7, title="tensor", title_fontsize=7)


THETA_BAND = 2.0  # Theta(N^2 d^2 / M): the bytes over N^2 d^2 / M vary by less than 2x
WHY = "the counts are exact models of a few shapes and block sizes, not a GPU's measured traffic."


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table: the byte counts per shape and block size."""
    largest = [row for row in rows if row["N"] == max(r["N"] for r in rows)]
    per = [row["Algorithm 1 bytes"] / (row["N"] ** 2 * row["d"] ** 2 / row["M"]) for row in largest]
    fewer = sum(row["Algorithm 1 bytes"] < row["standard bytes"] for row in rows)
    exact = sum(row["qkv counted bytes"] == row["qkv model bytes"] for row in rows)
    return [
        Verdict("FlashAttention moves Theta(N^2 d^2 / M) bytes, fewer than standard attention",
                grade((max(per) / min(per) < THETA_BAND) + (fewer == len(rows)), 2),
                f"Supported if Algorithm 1 moves fewer bytes than standard attention in every row "
                f"and, at the largest N, its bytes over N^2 d^2 / M vary by less than "
                f"{THETA_BAND:g}x; mixed if one holds.",
                f"fewer in {fewer} of {len(rows)} rows; at N = {largest[0]['N']:,} "
                f"{min(per):.3g} to {max(per):.3g} bytes per N^2 d^2 / M", WHY),
        Verdict("qkv's exact count equals the bytes its loop moves", grade(exact, len(rows)),
                "Supported if the counted bytes equal the model's in every row, mixed if in some.",
                f"equal in {exact} of {len(rows)} rows", WHY),
    ]  # fmt: skip
