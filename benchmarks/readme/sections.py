"""The sections of the attention benchmarks: the figures and rows that fill their templates.

One function per benchmark script computes what the page shows of it (ratios, ranges, fitted
exponents, verdicts against targets) and the rows of its tables for `templates/<script>.md`,
which holds the text and the tables' columns. A function given one result file returns the
fields of its part "section" (make_readme.py adds the machine table and fills it); one given
all the files (patterns, flash, gpu) fills its template itself.
"""

from __future__ import annotations

import math
import statistics

from .template import fill, get, is_number
from .values import (
    NOT_RECORDED,
    dtype_name,
    dtype_rank,
    listing,
    machine_table,
    met,
    num,
    paired,
    span,
)


def attention(data: dict) -> dict:
    """qkv.attention against SDPA, naive math and FlexAttention: verdict, rates, every row."""
    target = data.get("target_qkv_over_sdpa", 1.05)
    rows = sorted(data.get("rows", []), key=lambda r: (
        dtype_rank(r.get("dtype")), bool(r.get("causal")), r.get("L", 0)))  # fmt: skip
    summary, verdict, exact, rates = qkv_over_sdpa(rows), "", "", ""
    if data.get("matmul_gflops"):
        rates = listing(data["matmul_gflops"].items(), ".1f", " GFLOP/s")
        rates = fill("attention", "rates", rates=rates)
    if summary:
        ok = met(summary["worst"] <= target)
        verdict = fill("attention", "verdict", target=target, verdict=ok, **summary)
    if rows:
        same = sum(get(r, "max_abs_diff_vs_sdpa", "qkv") == 0 for r in rows)
        exact = fill("attention", "exact", exact=same, count=len(rows))
    dtypes = []
    for dtype in sorted({r.get("dtype") for r in rows}, key=dtype_rank):
        mine = [r for r in rows if r.get("dtype") == dtype]
        sdpa = [100 * x for r in mine if r.get("L", 0) >= 2048
                if is_number(x := get(r, "fraction_of_matmul", "sdpa"))]  # fmt: skip
        naive = [x for r in mine if r.get("L", 0) >= 1024
                 if is_number(x := get(r, "ratio_vs_sdpa", "naive"))]  # fmt: skip
        if sdpa or naive:
            dtypes.append(fill(
                "attention", "dtype", dtype=dtype_name(dtype), sdpa=span(sdpa, ".0f", "%"),
                naive=span(naive, ".1f", "x"),
            ))  # fmt: skip
    shown = [{
        **r, "causal": "yes" if r.get("causal") else "no", "dtype": dtype_name(r.get("dtype")),
        "vs_sdpa": paired(get(r, "ratio_vs_sdpa", "qkv"), get(r, "paired_ratio_vs_sdpa", "qkv")),
        "vs_flex": _vs_flex(r),
    } for r in rows]  # fmt: skip
    shape = ", ".join(f"{k} = {v}" for k, v in (data.get("shape") or {}).items())
    return dict(
        target=target, shape=shape or NOT_RECORDED, mode=data.get("mode", NOT_RECORDED),
        verdict=verdict, exact=exact, rates=rates, dtypes=" ".join(dtypes), r=shown,
    )  # fmt: skip


def qkv_over_sdpa(rows: list[dict]) -> dict | None:
    """qkv's time over SDPA's: median and worst over the rows that have it (None for none)."""
    ratios = [x for r in rows if is_number(x := get(r, "ratio_vs_sdpa", "qkv"))]
    if not ratios:
        return None
    return dict(median=statistics.median(ratios), worst=max(ratios), count=len(ratios))


def _vs_flex(r: dict) -> str:
    """qkv's time over FlexAttention's (median and paired), or "-" without a flex column."""
    qkv, flex = get(r, "ms", "qkv"), get(r, "ms", "flex")
    if not (is_number(qkv) and is_number(flex) and flex):
        return "-"
    return paired(qkv / flex, get(r, "paired_ratio_vs_flex", "qkv"))


# The default runs, the long rows (L = 16384, apart: a forward run over every length takes half
# an hour) and the default runs with PyTorch's kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2: the CPU kind without AVX-512).
PATTERN_FILES = (
    "patterns", "patterns_backward", "patterns_long", "patterns_backward_long", "patterns_avx2",
    "patterns_backward_avx2",
)  # fmt: skip
PATTERNS = ("causal", "window", "sinks", "alibi", "softcap")


def patterns(results: dict[str, dict]) -> str:
    """Every patterns file, its auto-against-best-peer summary and rows; one machine table."""
    files = [(stem, results[stem]) for stem in PATTERN_FILES if stem in results]
    if not files:
        return ""
    tables = []
    for stem, data in files:
        rows = sorted(data.get("rows", []), key=lambda r: (
            dtype_rank(r["dtype"]), r["L"], _pattern_rank(r["pattern"])))  # fmt: skip
        ratios = [x for r in rows if is_number(x := r.get("paired_auto_vs_best_peer"))]
        summary = ""
        if ratios:
            summary = fill(
                "patterns", "summary", met=sum(x <= 1.0 for x in ratios), count=len(ratios),
                low=min(ratios), high=max(ratios),
            )  # fmt: skip
        shown = [{
            **r, "dtype": dtype_name(r["dtype"]),
            "miss": _miss(r.get("paired_auto_vs_best_peer")),
        } for r in rows]  # fmt: skip
        kernels = get(data, "machine", "torch_cpu_capability") or "?"
        tables.append(fill(
            "patterns", "file", mode=data.get("mode", stem), kernels=kernels, stem=stem,
            summary=summary, r=shown,
        ))  # fmt: skip
    return fill("patterns", "section", files="\n\n".join(tables), machine=machine_table(files))


def _miss(ratio: object) -> str:
    """'!' where auto took longer than the best peer."""
    return "!" if is_number(ratio) and ratio > 1.0 else ""


def _pattern_rank(pattern: object) -> int:
    return PATTERNS.index(pattern) if pattern in PATTERNS else len(PATTERNS)


WINDOW = 1024
FLASH_FILES = ("flash", "flash_bf16_recheck")  # a later file's rows replace an earlier one's


def merged_flash_rows(results: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """(rows shown, rows replaced): the rows of the flash files keyed by (setting, L, dtype), a
    later file's row replacing an earlier one's; each row carries its file in "file"."""
    shown: dict[tuple, dict] = {}
    replaced: list[dict] = []
    for stem in FLASH_FILES:
        for r in get(results, stem, "rows", default=[]) or []:
            key = (r["setting"], r["L"], r["dtype"])
            if key in shown:
                replaced.append(shown[key])
            shown[key] = {**r, "file": stem}

    def order(r: dict) -> tuple:
        setting = {"causal": 0, "window": 1}.get(r["setting"], 2)
        return (dtype_rank(r["dtype"]), setting, r["L"], r["file"])

    return sorted(shown.values(), key=order), sorted(replaced, key=order)


def fitted_exponent(rows: list[dict], name: str, dtype: str) -> float | None:
    """Slope of log(peak bytes) against log(L) over the causal rows: 1 for O(L), 2 for O(L^2)."""
    points = [
        (math.log(r["L"]), math.log(get(r, "by", name, "peak_fb_bytes"))) for r in rows
        if r["setting"] == "causal" and r["dtype"] == dtype
        and (get(r, "by", name, "peak_fb_bytes") or 0) > 0
    ]  # fmt: skip
    if len(points) < 2:
        return None
    mean_x, mean_y = (sum(p[i] for p in points) / len(points) for i in (0, 1))
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return covariance / sum((x - mean_x) ** 2 for x, _ in points)


def extrapolated_naive_peak(rows: list[dict], dtype: str, L: int) -> float | None:
    """Naive math's peak bytes at L: its largest measured peak, scaled by the fitted exponent."""
    measured = [r for r in rows if r["setting"] == "causal" and r["dtype"] == dtype
                and get(r, "by", "naive")]  # fmt: skip
    exponent = fitted_exponent(rows, "naive", dtype)
    if not measured or exponent is None:
        return None
    last = max(measured, key=lambda r: r["L"])
    return last["by"]["naive"]["peak_fb_bytes"] * (L / last["L"]) ** exponent


def flash(results: dict[str, dict]) -> str:
    """The tiled path's verdicts and rows, a re-measured row in place of the first one, which
    is listed apart."""
    files = [(stem, results[stem]) for stem in FLASH_FILES if stem in results]
    if not files:
        return ""
    shown, replaced = merged_flash_rows(results)
    remeasured = again = ""
    if replaced:
        lengths: dict[str, set[int]] = {}
        for r in replaced:
            lengths.setdefault(dtype_name(r["dtype"]), set()).add(r["L"])
        which = "; ".join(f"{d} at L = {' and '.join(map(str, sorted(Ls)))}" for d, Ls in
                          sorted(lengths.items(), key=lambda kv: dtype_rank(kv[0])))  # fmt: skip
        later = sorted({r["file"] for r in shown if r["file"] != FLASH_FILES[0]})
        later = " and ".join(f"`results/{stem}.json`" for stem in later)
        remeasured = fill("flash", "remeasured", later=later, first=FLASH_FILES[0], rows=which)
        again = fill("flash", "replaced", table=_flash_table(replaced, shown))
    return fill(
        "flash", "section", window=WINDOW, machine=machine_table(files), remeasured=remeasured,
        verdicts="\n".join(_flash_verdicts(shown)), table=_flash_table(shown, shown),
        replaced=again,
    )  # fmt: skip


def _flash_table(rows: list[dict], all_rows: list[dict]) -> str:
    """The table of `rows`: ms, MiB and the tiled path's time ratios from seconds and bytes."""
    shown = []
    for r in rows:
        by = r["by"] if isinstance(r.get("by"), dict) else {}
        ms = {name: 1e3 * get(c, "fwd_s") for name, c in by.items() if get(c, "fwd_s")}
        mib = {name: c["peak_fb_bytes"] / 2**20 for name, c in by.items()
               if is_number(get(c, "peak_fb_bytes"))}  # fmt: skip
        over = {
            column: get(by, "tiled", time) / get(by, peer, time)
            for column, time, peer in (("fwd", "fwd_s", "sdpa"), ("flex", "fwd_s", "flex"),
                                       ("fb", "fb_s", "sdpa"))
            if is_number(get(by, "tiled", time)) and get(by, peer, time)
        }  # fmt: skip
        naive = num(mib.get("naive"), ",.0f")
        if not by.get("naive") and r["setting"] == "causal" and by.get("sdpa"):
            guess = extrapolated_naive_peak(all_rows, r["dtype"], r["L"])
            naive = fill("flash", "extrapolated", mib=guess / 2**20) if guess else "-"
        shown.append({
            **r, "setting": f"window {WINDOW}" if r["setting"] == "window" else r["setting"],
            "dtype": dtype_name(r["dtype"]), "ms": ms, "mib": mib, "over": over, "naive": naive,
        })  # fmt: skip
    return fill("flash", "table", r=shown)


def _flash_verdicts(rows: list[dict]) -> list[str]:
    """Per dtype: the speed and memory targets, the peak at 16k and the window's speed-up."""
    out = []
    for dtype in sorted({r["dtype"] for r in rows}, key=dtype_rank):
        name, mine = dtype_name(dtype), [r for r in rows if r["dtype"] == dtype]
        causal = [r for r in mine if r["setting"] == "causal" and r["L"] >= 2048
                  and get(r, "by", "sdpa")]  # fmt: skip
        if causal:
            worst = max(r["by"]["tiled"]["fwd_s"] / r["by"]["sdpa"]["fwd_s"] for r in causal)
            out.append(fill("flash", "speed", dtype=name, worst=worst, verdict=met(worst <= 2)))
        tiled, naive = (fitted_exponent(rows, kind, dtype) for kind in ("tiled", "naive"))
        if tiled is not None:
            naive = "" if naive is None else fill("flash", "naive", exponent=naive)
            out.append(fill("flash", "memory", dtype=name, exponent=tiled, naive=naive))
        at_16k = [r for r in mine if r["setting"] == "causal" and r["L"] == 16384
                  and get(r, "by", "tiled", "peak_fb_bytes")]  # fmt: skip
        naive_16k = extrapolated_naive_peak(rows, dtype, 16384)
        if at_16k and naive_16k:
            tiled = at_16k[0]["by"]["tiled"]["peak_fb_bytes"]
            out.append(fill(
                "flash", "at_16k", dtype=name, tiled=tiled / 2**20, share=naive_16k / tiled,
                naive=naive_16k / 2**30,
            ))  # fmt: skip
        if window := window_speedup(rows, dtype):
            out.append(fill("flash", "window", **window))
    return out


def window_speedup(rows: list[dict], dtype: str) -> dict | None:
    """The window setting's speed-up over SDPA at its largest L in `dtype` (None without one):
    the fields of part "window" of templates/flash.md and of templates/page.md."""
    window = [r for r in rows if r["setting"] == "window" and r["dtype"] == dtype and get(r, "by")]
    if not window:
        return None
    last = max(window, key=lambda r: r["L"])
    speedup = last["by"]["sdpa"]["fwd_s"] / last["by"]["tiled"]["fwd_s"]
    return dict(dtype=dtype_name(dtype), window=WINDOW, L=last["L"], speedup=speedup)


def sparse(data: dict) -> dict:
    """BigBird's pattern: fitted exponents, SDPA's time over qkv's at 16k, every length."""
    at_16k = data.get("sdpa_over_qkv_at_16k")
    shown = [{**r, "mask": r.get("dense_mask_mib") if "sdpa" in r.get("seconds", {}) else None}
             for r in data.get("rows", [])]  # fmt: skip
    return dict(d=data, verdict="-" if at_16k is None else met(at_16k >= 5.0), r=shown)


def linear(data: dict) -> dict:
    """Linear attention's features, their crossover lengths and flat decoding cost."""
    flat = data.get("decode_longest_over_shortest", {})
    shown = [
        {"L": get(f, "length"), "ms": _scaled(get(f, "seconds"), 1e3),
         "us": _scaled(get(d, "seconds_per_step"), 1e6)}
        for f, d in zip(data.get("forward", []), data.get("decode", []), strict=False)
    ]  # fmt: skip
    flat = listing([(n, flat.get(n)) for n in ("softmax", "elu", "favor")], ".2f", "x")
    return dict(d=data, flat=flat, r=shown)


def _scaled(values: object, factor: float) -> dict:
    found = values.items() if isinstance(values, dict) else ()
    return {key: factor * x for key, x in found if is_number(x)}


def long_documents(data: dict) -> dict:
    """The long-document classification task: its documents and every row."""
    test = get(data, "documents", "test", default={}) or {}
    return dict(
        d=data, labels=len(data.get("labels", [])) or "?", r=data.get("rows", []),
        share=get(data, "config", "label_share", default=0.6),
        over=test.get("share_over_512_tokens", 0.0),
    )  # fmt: skip


def gpu(data: dict | None) -> str:
    """The Triton kernels on a GPU, each against SDPA's flash kernel; a note without the file."""
    if data is None:
        return fill("gpu", "section", figures=fill("gpu", "missing"))
    shown = []
    for r in sorted(data.get("rows", []), key=lambda r: (r["D"], bool(r["causal"]), r["L"])):
        sdpa = get(r, "by", "sdpa_flash", "fb_tflops")
        for name, c in sorted(r.get("by", {}).items()):
            relative = c["fb_tflops"] / sdpa if is_number(sdpa) and sdpa else None
            shown.append({
                **c, "L": r["L"], "D": r["D"], "causal": "yes" if r["causal"] else "no",
                "name": name, "relative": relative,
            })  # fmt: skip
    figures = fill(
        "gpu", "measured", machine=machine_table([("flash_gpu", data)]),
        peak=num(data.get("peak_tflops"), ".0f", missing=NOT_RECORDED),
        matmul=num(data.get("matmul_tflops"), ".0f", missing=NOT_RECORDED), r=shown,
    )  # fmt: skip
    return fill("gpu", "section", figures=figures)


def context_parallel(data: dict) -> dict:
    """Ring attention's training step: saved, sent and reduced bytes against the plan."""
    rows = data.get("rows", [])
    first = get(rows, 0, "saved_bytes", default=1)
    shown = [{
        **r, "ratio": get(r, "saved_bytes", default=0) / max(first, 1),
        "mib": {key: x / 2**20 for key, x in r.items() if key.endswith("_bytes") and is_number(x)},
    } for r in rows]  # fmt: skip
    return dict(d=data, r=shown)
