"""The figures the page computes from a result file: verdicts against the targets and ratios
the file does not hold. Everything else the templates read from the file as it is.

`derive(stem, data)` is the file with the stem and these figures added (under "summary", or
on its rows); a file without a function here is shown as it is.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from .template import get, is_number

WINDOW = 1024  # the sliding window of benchmarks/flash.py


def derive(stem: str, data: dict) -> dict:
    kind = max((k for k in KINDS if stem == k or stem.startswith(k + "_")), key=len, default=None)
    return {"stem": stem, **data, **(KINDS[kind](data) if kind else {})}


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def span(values: Iterable[float], spec: str = ".2f", unit: str = "x") -> str:
    """'a-b' (or 'a' when both ends print alike) over `values`; '-' for none."""
    values = sorted(values)
    if not values:
        return "-"
    low, high = format(values[0], spec), format(values[-1], spec)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def _over(a: object, b: object) -> float | None:
    return a / b if is_number(a) and is_number(b) and b else None  # type: ignore[operator]


def _numbers(values: Iterable[object]) -> list[float]:
    return [x for x in values if is_number(x)]  # type: ignore[misc]


def attention(d: dict) -> dict:
    """qkv/sdpa's median and worst against the target, exact rows, qkv/flex per row."""
    rows = d.get("rows", [])
    ratios = _numbers(get(r, "ratio_vs_sdpa", "qkv") for r in rows)
    summary = {"exact": sum(get(r, "max_abs_diff_vs_sdpa", "qkv") == 0 for r in rows)}
    if ratios:
        worst, target = max(ratios), d.get("target_qkv_over_sdpa", 1.05)
        summary |= dict(median=statistics.median(ratios), worst=worst, count=len(ratios),
                        met=met(worst <= target))  # fmt: skip
    rows = [{**r, "vs_flex": _over(get(r, "ms", "qkv"), get(r, "ms", "flex"))} for r in rows]
    return {"summary": summary, "rows": rows}


def patterns(d: dict) -> dict:
    """How often auto is at most the best peer's time, and the range of auto/best."""
    ratios = _numbers(r.get("paired_auto_vs_best_peer") for r in d.get("rows", []))
    return {"summary": dict(met=sum(x <= 1.0 for x in ratios), count=len(ratios),
                            ratios=span(ratios))}  # fmt: skip


def flash(d: dict) -> dict:
    """The tiled path's time over its peers' per row; the window's speed-up per dtype."""
    rows = []
    for r in d.get("rows", []):
        time = {(name, key): get(r, "by", name, key) for name in ("tiled", "sdpa", "flex")
                for key in ("fwd_s", "fb_s")}  # fmt: skip
        over = {"sdpa": _over(time["tiled", "fwd_s"], time["sdpa", "fwd_s"]),
                "flex": _over(time["tiled", "fwd_s"], time["flex", "fwd_s"]),
                "sdpa_fb": _over(time["tiled", "fb_s"], time["sdpa", "fb_s"])}  # fmt: skip
        rows.append({**r, "over": over})
    windows = {}  # per dtype, the window row at the largest L
    for r in sorted(rows, key=lambda r: r["L"]):
        if r["setting"] == "window" and is_number(r["over"]["sdpa"]):
            windows[r["dtype"]] = dict(dtype=r["dtype"], L=r["L"], window=WINDOW,
                                       speedup=1 / r["over"]["sdpa"])  # fmt: skip
    return {"rows": rows, "windows": list(windows.values())}


def sparse(d: dict) -> dict:
    at_16k, target = d.get("sdpa_over_qkv_at_16k"), get(d, "targets", "sdpa_over_qkv_at_16k")
    return {"summary": {"met": met(at_16k >= (target or 5.0)) if is_number(at_16k) else "-"}}


def models(d: dict) -> dict:
    """qkv's default path (for training: inside `speed_up`) and its fastest, over every row."""
    rows = d.get("rows", [])
    default = _numbers(r.get("speed_up_ratio", r.get("ratio")) for r in rows)
    best = [
        max(found)
        for r in rows
        if (found := _numbers(r.get(k) for k in ("ratio", "packed_ratio", "speed_up_ratio")))
    ]
    return {"summary": dict(default=span(default, ".3f"), count=len(default),
                            met=met(bool(default) and min(default) >= 1.0),
                            best=span(best, ".3f"))}  # fmt: skip


def decode(d: dict) -> dict:
    """The tokens/s of qkv's fastest path, compile="aot", over transformers'."""
    aot = (("tokens_per_s", "qkv_aot"), ("tokens_per_s", "transformers"))
    return {"rows": [{**r, "aot_over_transformers": _over(*(get(r, *k) for k in aot))}
                     for r in d.get("rows", [])]}  # fmt: skip


def decode_batch(d: dict) -> dict:
    """qkv's fastest path per row, and the worst ratio to llama.cpp against the target."""
    rows = [{**r, "fastest": get(r, "tokens_per_s", r.get("qkv_fastest", "qkv_compiled"))}
            for r in d.get("rows", [])]  # fmt: skip
    ratios = _numbers(get(r, "paired_ratios", "llama_cpp") for r in rows)
    verdict = met(min(ratios) >= 1.0) if ratios else "-"
    return {"rows": rows, "summary": {"met": verdict, "ratios": span(ratios)}}


def decode_breakdown(d: dict) -> dict:
    """Each part's share of the call; llama.cpp's call against qkv's and its library alone."""
    rows = []
    for r in d.get("rows", []):
        qkv, llama = r.get("qkv_ms", {}), r.get("llama_cpp_ms")
        total, library = qkv.get("total"), qkv.get("library")
        rows.append({**r, "share": {k: _over(x, total) for k, x in qkv.items()}, "ratios": dict(
            qkv=_over(llama, total), library=_over(llama, library),
            threads=_over(qkv.get("library, 1 thread"), library),
            per_step=_over(library, qkv.get("steps")),
        )})  # fmt: skip
    return {"rows": rows}


def context_parallel(d: dict) -> dict:
    rows = d.get("rows", [])
    first = get(rows, 0, "saved_bytes")
    return {"rows": [{**r, "ratio": _over(r.get("saved_bytes"), first)} for r in rows]}


def parity(d: dict) -> dict:
    """The note on a file written by qkv: a list of one, or none."""
    return {"written_by_qkv": [d["written"]] if d.get("written") else []}


def decode_smollm2(d: dict) -> dict:
    """The kernel lines of `explain_quantized` per file; the AOT rows for the headlines."""
    kernels = [f"{kind} file: {line.strip()}" for kind, text in d.get("kernels", {}).items()
               for line in text.splitlines() if line.startswith("  ")]  # fmt: skip
    aot = {key: [r for r in d.get(key, []) if str(r.get("candidate")).endswith("AOT")]
           for key in ("rows", "batch_rows")}  # fmt: skip
    rows = [{**r, "tokens": _same_tokens(r)} for r in d.get("rows", [])]
    peer = d.get("llama_cpp") or {}
    build = (f"llama.cpp (llama-cpp-python {peer['version']}) as built for this run: "
             f"{peer['system_info'].rstrip(' |')}" if peer else "")  # fmt: skip
    return {"kernel_lines": kernels, "aot": aot, "rows": rows, "llama_cpp_build": build}


def _same_tokens(row: dict) -> str:
    """'n of m', and where the tokens part, each library's margin for its own choice there."""
    text = f"{row.get('same_tokens')} of {row.get('new_tokens')}"
    apart = row.get("first_difference")
    if not apart:
        return text
    return (f"{text}; then qkv's choice {apart['qkv_margin']:+.2f}, llama.cpp's "
            f"{apart['llama_cpp_margin']:+.2f} in their logits")  # fmt: skip


def flash_gpu(d: dict) -> dict:
    """One row per candidate, its forward + backward throughput over SDPA flash's."""
    rows = []
    for r in d.get("rows", []):
        sdpa = get(r, "by", "sdpa_flash", "fb_tflops")
        rows += [{**c, "L": r["L"], "D": r["D"], "causal": r["causal"], "name": name,
                  "relative": _over(c.get("fb_tflops"), sdpa)}
                 for name, c in sorted(r.get("by", {}).items())]  # fmt: skip
    return {"rows": rows}


KINDS = {  # a file's stem, or the start of it before "_": its function
    "attention": attention, "patterns": patterns, "flash": flash, "sparse": sparse,
    "models": models, "decode": decode, "decode_batch": decode_batch,
    "decode_breakdown": decode_breakdown, "context_parallel": context_parallel,
    "parity_llama_cpp": parity, "decode_smollm2": decode_smollm2,
    "flash_gpu": flash_gpu,
}  # fmt: skip
