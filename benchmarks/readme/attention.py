"""The section of benchmarks/attention.py: `qkv.attention` against raw SDPA and naive math.

It states the method (what is timed, how throughput is counted), summarizes the ratio of
qkv's time to SDPA's against its target, and lists every configuration of
`results/attention.json` with its times, ratios, share of the matmul rate and output difference.
"""

from __future__ import annotations

import statistics

from .format import (
    NOT_RECORDED,
    dtype_name,
    dtype_rank,
    get,
    md_table,
    num,
    paired,
    pct,
    prose,
    span,
)
from .machine import machine_table

ATTENTION_TEXT = """\
`qkv.attention(q, k, v, causal=c)` (backend "auto") against the call it dispatches to,
`F.scaled_dot_product_attention(q, k, v, is_causal=c)`, and against naive eager math
(`softmax(q k^T / sqrt(D) + mask) v`, the scores materialized; the causal mask is built once,
outside the timed call). qkv/sdpa is what the wrapper costs (target: at most {target}); naive/sdpa
is what the fused kernel buys. Throughput counts the useful FLOPs of exact attention,
4 * B * H * L^2 * D for the forward pass (half of it when causal), and is given as a fraction of
the measured rate of a 2048 x 2048 matmul of the same dtype (the best of the measurements before
and after the rows). Before timing, each configuration compares the outputs with SDPA's. The
peer for attention patterns is PyTorch's FlexAttention: `torch.compile(flex_attention)` with the
causal `BlockMask` (or none), compiled once per shape and dtype, its mask built outside the timed
call; qkv/flex above 1 means FlexAttention is faster."""


def attention_section(data: dict) -> list[str]:
    shape = data.get("shape") or {}
    shape_text = ", ".join(f"{k} = {v}" for k, v in shape.items()) or NOT_RECORDED
    target = data.get("target_qkv_over_sdpa", 1.05)
    lines = [
        "## `qkv.attention` against raw SDPA (`attention.py`)",
        "",
        *prose(ATTENTION_TEXT.format(target=target)),
        "",
        f"Shape: {shape_text}, self-attention; mode: {data.get('mode', NOT_RECORDED)}.",
        "",
        *machine_table([("attention", data)]),
        "",
    ]
    rows = sorted(
        data.get("rows", []),
        key=lambda r: (dtype_rank(r.get("dtype")), bool(r.get("causal")), r.get("L", 0)),
    )
    ratios = [get(r, "ratio_vs_sdpa", "qkv") for r in rows]
    ratios = [x for x in ratios if isinstance(x, int | float)]
    rates = data.get("matmul_gflops") or {}
    summary = []
    if ratios:
        verdict = "met" if max(ratios) <= target else "not met"
        summary.append(
            f"qkv/sdpa: median **{statistics.median(ratios):.3f}**, worst **{max(ratios):.3f}** "
            f"over {len(ratios)} rows (target <= {target}: {verdict})."
        )
    exact = [r for r in rows if get(r, "max_abs_diff_vs_sdpa", "qkv") == 0]
    if rows:
        summary.append(f"qkv's output equals SDPA's exactly in {len(exact)} of {len(rows)} rows.")
    if rates:
        summary.append(
            "Matmul rate: "
            + ", ".join(
                f"{dtype_name(d)} {num(r, '.1f')} GFLOP/s"
                for d, r in sorted(rates.items(), key=lambda kv: dtype_rank(kv[0]))
            )
            + "."
        )
    for dtype in sorted({r.get("dtype") for r in rows}, key=dtype_rank):
        mine = [r for r in rows if r.get("dtype") == dtype]
        sdpa = [get(r, "fraction_of_matmul", "sdpa") for r in mine if r.get("L", 0) >= 2048]
        naive = [get(r, "ratio_vs_sdpa", "naive") for r in mine if r.get("L", 0) >= 1024]
        sdpa = [x for x in sdpa if isinstance(x, int | float)]
        naive = [x for x in naive if isinstance(x, int | float)]
        if sdpa or naive:
            summary.append(
                f"{dtype_name(dtype)}: SDPA reaches {span([100 * x for x in sdpa], '.0f', '%')} "
                f"of the matmul rate at L >= 2048; naive math takes "
                f"{span(naive, '.1f', 'x')} SDPA's time at L >= 1024."
            )
    lines += [*prose(" ".join(summary)), ""] if summary else []
    header = [
        "L",
        "causal",
        "dtype",
        "qkv ms",
        "sdpa ms",
        "naive ms",
        "flex ms",
        "qkv / sdpa (paired)",
        "naive / sdpa",
        "qkv / flex (paired)",
        "qkv GFLOP/s",
        "qkv % of matmul",
        "sdpa % of matmul",
        "max abs diff qkv vs sdpa",
    ]
    body = [
        [
            r.get("L", "-"),
            "yes" if r.get("causal") else "no",
            dtype_name(r.get("dtype")),
            num(get(r, "ms", "qkv"), ".2f"),
            num(get(r, "ms", "sdpa"), ".2f"),
            num(get(r, "ms", "naive"), ".2f"),
            num(get(r, "ms", "flex"), ".2f"),
            paired(get(r, "ratio_vs_sdpa", "qkv"), get(r, "paired_ratio_vs_sdpa", "qkv")),
            num(get(r, "ratio_vs_sdpa", "naive"), ".2f"),
            _vs_flex(r),
            num(get(r, "gflops", "qkv"), ".1f"),
            pct(get(r, "fraction_of_matmul", "qkv")),
            pct(get(r, "fraction_of_matmul", "sdpa")),
            num(get(r, "max_abs_diff_vs_sdpa", "qkv"), ".3g"),
        ]
        for r in rows
    ]
    lines += md_table(header, body)
    lines += ["", "Times are medians in ms per call; the samples are in the JSON file."]
    return lines


def _vs_flex(row: dict) -> str:
    """qkv's time over FlexAttention's (median and paired), or "-" without a flex column."""
    qkv, flex = get(row, "ms", "qkv"), get(row, "ms", "flex")
    if not (isinstance(qkv, int | float) and isinstance(flex, int | float) and flex):
        return "-"
    return paired(qkv / flex, get(row, "paired_ratio_vs_flex", "qkv"))
