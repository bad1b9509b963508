"""The section of benchmarks/flash.py: tiled FlashAttention against SDPA and naive math.

The rows of `results/flash.json` and of the files that measure some of its rows again are
merged, a later file's row replacing an earlier one's (the replaced rows are listed after the
table). Peak memory growth is fitted in log-log space, naive math's peak beyond its largest
measured length is extrapolated with that fit, and each target gets a verdict.
"""

from __future__ import annotations

import math

from .format import dtype_name, dtype_rank, get, md_table, num, prose
from .machine import machine_table

WINDOW = 1024
FLASH_FILES = ("flash", "flash_bf16_recheck")  # a later file's rows replace an earlier one's

FLASH_TEXT = """\
`qkv.flash_attention`, FlashAttention-2 written in PyTorch (online softmax over tiles,
recomputation in the backward pass, memory linear in L), against
`F.scaled_dot_product_attention` and naive eager math, on (B, H, L, D) = (1, 8, L, 64)
self-attention, in two settings:
- causal: SDPA with `is_causal=True`, the tiled path with `causal=True`, naive math with a
  causal mask;
- a sliding window of {window} keys: SDPA gets the dense (L, L) mask that
  `qkv.attention(window={window}, backend="sdpa")` builds for it and computes every hidden
  score, while the tiled path skips the tiles the window hides.
In both, PyTorch's FlexAttention (`torch.compile(flex_attention)` with the `BlockMask` of the same
pattern, built outside the timing; its output checked against the tiled path's) is the peer a
PyTorch user would write for a pattern; torch 2.13 has no FlexAttention backward on the CPU, so
its rows are forward only there.

Each candidate is timed forward ("fwd") and forward + backward ("f+b"), and its peak memory of
forward + backward is measured once (the profiler's allocation events on the CPU): the bytes
beyond the inputs at the worst moment. Naive math runs only up to L = 4096 (`--naive-max`); its
peak at larger L is extrapolated from its largest measured peak with the exponent fitted to its
measured peaks (log-log least squares), and marked so. Targets: tiled forward within 2x of
SDPA's time at L >= 2048, causal; tiled peak memory growing as L^1.1 or slower, and at 16k at
most 1/8 of naive math's; with the window at L = 16384, tiled at least 3x faster than SDPA.
`results/flash.png` plots the fp32 rows of `results/flash.json` (time, and memory of the causal
setting)."""


def merged_flash_rows(results: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """(rows shown, rows replaced): the rows of the flash files keyed by (setting, L, dtype), a
    later file's row replacing an earlier one's; each row carries its file in "file"."""
    shown: dict[tuple, dict] = {}
    replaced: list[dict] = []
    for stem in FLASH_FILES:
        for row in get(results, stem, "rows", default=[]) or []:
            row = {**row, "file": stem}
            key = (row["setting"], row["L"], row["dtype"])
            if key in shown:
                replaced.append(shown[key])
            shown[key] = row
    order = {"causal": 0, "window": 1}

    def sort_key(r: dict) -> tuple:
        return (dtype_rank(r["dtype"]), order.get(r["setting"], 2), r["L"], r["file"])

    return sorted(shown.values(), key=sort_key), sorted(replaced, key=sort_key)


def fitted_exponent(rows: list[dict], name: str, dtype: str) -> float | None:
    """Slope of log(peak bytes) against log(L) over the causal rows: 1 for O(L), 2 for O(L^2)."""
    points = [
        (math.log(r["L"]), math.log(get(r, "by", name, "peak_fb_bytes")))
        for r in rows
        if r["setting"] == "causal"
        and r["dtype"] == dtype
        and (get(r, "by", name, "peak_fb_bytes") or 0) > 0
    ]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )


def extrapolated_naive_peak(rows: list[dict], dtype: str, L: int) -> float | None:
    """Naive math's peak bytes at L: its largest measured peak, scaled by the fitted exponent."""
    measured = [
        r
        for r in rows
        if r["setting"] == "causal" and r["dtype"] == dtype and get(r, "by", "naive")
    ]
    exponent = fitted_exponent(rows, "naive", dtype)
    if not measured or exponent is None:
        return None
    last = max(measured, key=lambda r: r["L"])
    return last["by"]["naive"]["peak_fb_bytes"] * (L / last["L"]) ** exponent


def _mib(value: object) -> str:
    return num(value / 2**20, ",.0f") if isinstance(value, int | float) else "-"


def _ratio_of(row: dict, key: str, other: str = "sdpa") -> str:
    tiled, theirs = get(row, "by", "tiled", key), get(row, "by", other, key)
    if isinstance(tiled, int | float) and isinstance(theirs, int | float) and theirs:
        return f"{tiled / theirs:.2f}"
    return "-"


def flash_table(rows: list[dict], all_rows: list[dict]) -> list[str]:
    header = [
        "setting",
        "L",
        "dtype",
        "sdpa fwd ms",
        "tiled fwd ms",
        "naive fwd ms",
        "flex fwd ms",
        "tiled / sdpa fwd",
        "tiled / flex fwd",
        "tiled / sdpa f+b",
        "sdpa f+b peak MiB",
        "tiled f+b peak MiB",
        "naive f+b peak MiB",
        "file",
    ]
    body = []
    for r in rows:
        naive = get(r, "by", "naive")
        if naive:
            naive_ms, naive_mib = num(1e3 * naive["fwd_s"], ".1f"), _mib(naive["peak_fb_bytes"])
        elif r["setting"] == "causal" and get(r, "by", "sdpa"):
            naive_ms = "-"
            guess = extrapolated_naive_peak(all_rows, r["dtype"], r["L"])
            naive_mib = f"~{_mib(guess)} (extrapolated)" if guess else "-"
        else:
            naive_ms = naive_mib = "-"
        setting = f"window {WINDOW}" if r["setting"] == "window" else r["setting"]
        body.append(
            [
                setting,
                r["L"],
                dtype_name(r["dtype"]),
                num(1e3 * (get(r, "by", "sdpa", "fwd_s") or math.nan), ".1f"),
                num(1e3 * (get(r, "by", "tiled", "fwd_s") or math.nan), ".1f"),
                naive_ms,
                num(1e3 * (get(r, "by", "flex", "fwd_s") or math.nan), ".1f"),
                _ratio_of(r, "fwd_s"),
                _ratio_of(r, "fwd_s", "flex"),
                _ratio_of(r, "fb_s"),
                _mib(get(r, "by", "sdpa", "peak_fb_bytes")),
                _mib(get(r, "by", "tiled", "peak_fb_bytes")),
                naive_mib,
                f"`{r['file']}.json`",
            ]
        )
    return md_table(header, body)


def flash_verdicts(rows: list[dict]) -> list[str]:
    out = []
    for dtype in sorted({r["dtype"] for r in rows}, key=dtype_rank):
        name = dtype_name(dtype)
        causal = [
            r
            for r in rows
            if r["setting"] == "causal"
            and r["dtype"] == dtype
            and r["L"] >= 2048
            and get(r, "by", "sdpa")
        ]
        if causal:
            worst = max(r["by"]["tiled"]["fwd_s"] / r["by"]["sdpa"]["fwd_s"] for r in causal)
            verdict = "met" if worst <= 2 else "not met"
            out.append(
                f"{name}: tiled forward / SDPA forward, causal, L >= 2048: worst "
                f"**{worst:.2f}** (target <= 2: {verdict})."
            )
        tiled_exp = fitted_exponent(rows, "tiled", dtype)
        naive_exp = fitted_exponent(rows, "naive", dtype)
        if tiled_exp is not None:
            naive_text = f"; naive math's as L^{naive_exp:.2f}" if naive_exp is not None else ""
            out.append(
                f"{name}: tiled f+b peak memory grows as L^{tiled_exp:.2f} (target <= 1.1)"
                f"{naive_text}."
            )
        at_16k = [
            r
            for r in rows
            if r["setting"] == "causal"
            and r["dtype"] == dtype
            and r["L"] == 16384
            and get(r, "by", "tiled", "peak_fb_bytes")
        ]
        naive_16k = extrapolated_naive_peak(rows, dtype, 16384)
        if at_16k and naive_16k:
            tiled = at_16k[0]["by"]["tiled"]["peak_fb_bytes"]
            out.append(
                f"{name}: at L = 16384 the tiled f+b peak, {tiled / 2**20:.0f} MiB, is "
                f"1/{naive_16k / tiled:.0f} of naive math's (extrapolated: "
                f"{naive_16k / 2**30:.1f} GiB; target: at most 1/8)."
            )
        window = [
            r for r in rows if r["setting"] == "window" and r["dtype"] == dtype and get(r, "by")
        ]
        if window:
            last = max(window, key=lambda r: r["L"])
            speedup = last["by"]["sdpa"]["fwd_s"] / last["by"]["tiled"]["fwd_s"]
            out.append(
                f"{name}: window {WINDOW} at L = {last['L']}: tiled **{speedup:.1f}x** faster "
                f"than SDPA with its dense mask (target at L = 16384: >= 3x)."
            )
    return out


def flash_section(results: dict[str, dict]) -> list[str]:
    files = [(stem, results[stem]) for stem in FLASH_FILES if stem in results]
    shown, replaced = merged_flash_rows(results)
    lines = [
        "## Tiled FlashAttention (`flash.py`)",
        "",
        *prose(FLASH_TEXT.format(window=WINDOW)),
        "",
        *machine_table(files),
        "",
    ]
    if replaced:
        by_dtype: dict[str, set[int]] = {}
        for r in replaced:
            by_dtype.setdefault(dtype_name(r["dtype"]), set()).add(r["L"])
        what = "; ".join(
            f"{d} at L = {' and '.join(str(L) for L in sorted(Ls))}"
            for d, Ls in sorted(by_dtype.items(), key=lambda kv: dtype_rank(kv[0]))
        )
        later = sorted({r["file"] for r in shown if r["file"] != FLASH_FILES[0]})
        lines += [
            *prose(
                f"{' and '.join(f'`results/{s}.json`' for s in later)} measures again the rows "
                f"of `results/{FLASH_FILES[0]}.json` for {what}, whose times there are out of "
                "line with the neighbouring lengths (compare the tiled / sdpa columns of the "
                "two tables). Where a row is in both files, the first table shows the later "
                "measurement, and the earlier one is listed after it."
            ),
            "",
        ]
    verdicts = flash_verdicts(shown)
    if verdicts:
        lines += [line for v in verdicts for line in prose(f"- {v}")] + [""]
    lines += flash_table(shown, shown)
    if replaced:
        lines += ["", "Rows measured again (the table above shows the later measurement):", ""]
        lines += flash_table(replaced, shown)
    lines += [
        "",
        "fwd ms: median ms per forward call. Peaks: MiB beyond the inputs during forward + "
        "backward.",
    ]
    return lines
