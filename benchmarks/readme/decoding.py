"""The sections of whole models and of decoding: the figures and rows that fill their templates.

`models` compares whole models with transformers (the default run, and the run held to AVX2);
`decode` is greedy decoding at batch 1, memory-bound, so its tables put tokens/s beside the
limit that the measured read bandwidth sets; `decode_batch` decodes several sequences at once;
`decode_breakdown` splits the time of a decoding call.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from .template import fill, get, is_number, wrap
from .values import NOT_RECORDED, dtype_name, dtype_rank, machine_table, met, num, paired, span

# The default run, and the same run with PyTorch's kernels, oneDNN and MKL held to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2: the CPU kind
# without AVX-512).
MODELS_FILES = ("models", "models_avx2")


def default_ratios(results: dict[str, dict]) -> list[float]:
    """The default path's ratio of every row of every models file."""
    rows = [r for stem in MODELS_FILES for r in results.get(stem, {}).get("rows", [])]
    return [r["ratio"] for r in rows if is_number(r.get("ratio"))]


def models(results: dict[str, dict]) -> str:
    found = [fill("models", part, figures=_models_figures(stem, results[stem]))
             for stem, part in zip(MODELS_FILES, ("section", "avx2"), strict=True)
             if stem in results]  # fmt: skip
    return "\n".join(found)  # the AVX2 heading follows the last table line directly


def _best_ratio(r: dict) -> float | None:
    found = [x for x in (r.get("ratio"), r.get("packed_ratio")) if is_number(x)]
    return max(found) if found else None


def _model_cell(r: dict | None) -> str:
    """'0.972 (0.952); packed **1.088 (1.089)**': the faster path in bold."""
    if r is None:
        return "-"
    plain = paired(r.get("ratio"), r.get("paired_ratio"))
    if "packed_ratio" not in r:
        return f"**{plain}**" if r.get("ratio") == _best_ratio(r) else plain
    packed = paired(r.get("packed_ratio"), r.get("packed_paired_ratio"))
    if r.get("packed_ratio") == _best_ratio(r):
        return f"{plain}; packed **{packed}**"
    return f"**{plain}**; packed {packed}"


def _models_figures(stem: str, data: dict) -> str:
    modes = {"forward": 0, "train": 1}
    rows = sorted(data.get("rows", []), key=lambda r: (
        str(r.get("model")), modes.get(r.get("mode"), 2), dtype_rank(r.get("dtype"))))  # fmt: skip
    default = [r["ratio"] for r in rows if is_number(r.get("ratio"))]
    best = [x for r in rows if (x := _best_ratio(r)) is not None]
    verdict = rates = ""
    if default:
        verdict = fill(
            "models", "verdict", default=span(default, ".3f", "x"), count=len(default),
            verdict=met(min(default) >= 1.0), best=span(best, ".3f", "x"),
        )  # fmt: skip
    if data.get("matmul_rate"):
        by_dtype = sorted(data["matmul_rate"].items(), key=lambda kv: dtype_rank(kv[0]))
        fractions = [100 * x for r in rows for name in ("qkv", "transformers")
                     if is_number(x := get(r, "fraction_of_matmul", name))]  # fmt: skip
        rates = ", ".join(f"{dtype_name(d)} {num(x / 1e9, '.0f')} GFLOP/s" for d, x in by_dtype)
        rates = fill("models", "rates", rates=rates, fractions=span(fractions, ".0f", "%"))
    shown = [{
        **r, "dtype": dtype_name(r.get("dtype")), "shape": f"{r.get('batch')} x {r.get('length')}",
        "plain": paired(r.get("ratio"), r.get("paired_ratio")),
        "packed": paired(r.get("packed_ratio"), r.get("packed_paired_ratio")),
    } for r in rows]  # fmt: skip
    dtypes = sorted({r.get("dtype") for r in rows}, key=dtype_rank)
    groups: dict[tuple, dict] = {}  # a row of the summary: a cell per dtype
    for r, row in zip(rows, shown, strict=True):
        groups.setdefault((row.get("model"), row["shape"], row.get("mode")), {})[r.get("dtype")] = r
    summary = [
        {"model": model, "shape": shape, "mode": mode,
         "cells": "".join(f" {_model_cell(by.get(d))} |" for d in dtypes)}
        for (model, shape, mode), by in groups.items()
    ]  # fmt: skip
    skipped = [fill("models", "skipped", reason=reason) for reason in data.get("skipped") or []]
    return fill(
        "models", "figures", machine=machine_table([(stem, data)]), verdict=verdict, rates=rates,
        dtypes="".join(f" {dtype_name(d)} |" for d in dtypes), dtype_columns="---|" * len(dtypes),
        s=summary, r=shown, skipped="\n".join(skipped),
    )  # fmt: skip


MODEL_CONFIG = {
    "hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size",
}  # fmt: skip
FLOORS = ("matvec_floor", "packed_matvec_floor", "compiled_matvec_floor", "read_floor")


def decode(data: dict) -> str:
    config, params = get(data, "model", "config") or {}, get(data, "model", "parameters")
    model = fill(
        "decode", "model", **{field: config.get(key, "?") for field, key in MODEL_CONFIG.items()},
        parameters=num(params / 1e6, ".1f") if isinstance(params, int) else "?",
    )  # fmt: skip
    rows = sorted(data.get("rows", []), key=lambda r: dtype_rank(r.get("dtype")))
    band = data.get("bandwidth") or {}
    probe_bytes = band.get("bytes") if isinstance(band.get("bytes"), int) else None
    setup = probe = ""
    if rows:
        setup = fill(
            "decode", "setup", batch=rows[0].get("batch"), prompt=rows[0].get("prompt"),
            new=rows[0].get("new_tokens"), transformers=data.get("transformers", NOT_RECORDED),
        )  # fmt: skip
    if band:
        samples = _gb_per_s(probe_bytes, band.get("read_samples_ms", []))
        probe = fill(
            "decode", "probe", peak=band.get("read_peak", 0) / 1e9,
            median=band.get("read_median", 0) / 1e9, count=len(samples),
            span=span(samples, ".0f", " GB/s"), copy=band.get("copy_peak", 0) / 1e9,
        )  # fmt: skip
    targets = []
    target = get(data, "targets", "ratio")
    if rows and is_number(target):
        paths = ("ratio", "packed_ratio", "compiled_ratio")
        worst = min(max(r.get(path, 0) for path in paths) for r in rows)
        targets.append(fill(
            "decode", "target_ratio", target=target, worst=worst, verdict=met(worst >= target),
        ))  # fmt: skip
    target = get(data, "targets", "fraction_of_limit")
    if rows and is_number(target):
        limits = ("fraction_of_round_limit", "fraction_of_limit")
        best = [max(get(r, limit, "qkv_compiled", default=0) for limit in limits) for r in rows]
        targets.append(fill(
            "decode", "target_fraction", target=target, span=span(best, ".1%"),
            verdict=met(min(best) >= target),
        ))  # fmt: skip
    shown = []
    for r in rows:
        weights, total = get(r, "bytes_per_token", "weights"), get(r, "bytes_per_token", "total")
        speeds = {name: get(r, "tokens_per_s", name) for name in FLOORS}
        shown.append({
            **r, "dtype": dtype_name(r.get("dtype")),
            "mb": total / 1e6 if is_number(total) else None,
            "compiled": paired(r.get("compiled_ratio"), r.get("compiled_paired_ratio"), ".2f"),
            "plain": paired(r.get("ratio"), r.get("paired_ratio")),
            "packed": paired(r.get("packed_ratio"), r.get("packed_paired_ratio")),
            "gbps": {name: weights * x / 1e9 for name, x in speeds.items()
                     if is_number(weights) and is_number(x)},
            "probes": span(_gb_per_s(probe_bytes, r.get("bandwidth_probe_ms", [])), ".0f"),
        })  # fmt: skip
    return fill(
        "decode", "section", model=model, machine=machine_table([("decode", data)]), setup=setup,
        probe=probe, targets="\n".join(targets), r=shown, peers=_peers(shown),
        states=_by_memory_state(rows, probe_bytes), tokens="\n".join(map(_tokens, rows)),
    )  # fmt: skip


def _gb_per_s(probe_bytes: int | None, probes_ms: list[float]) -> list[float]:
    """The read bandwidth of each probe, in GB/s; none without the probe's size."""
    return [probe_bytes / (ms / 1e3) / 1e9 for ms in probes_ms if probe_bytes is not None]


def _peers(rows: list[dict]) -> str:
    """llama.cpp and compiled transformers, timed in the same rounds, where the file has them."""
    info = next((r["peers"] for r in rows if "peers" in r), None)
    if info is None:
        return ""
    shown = []
    for r in rows:
        steps = get(r, "peers", "first_divergence_from_transformers") or {}
        same = ["equal" if steps.get(name, "-") is None else f"from step {steps.get(name, '-')}"
                for name in ("llama_cpp", "transformers_compiled")]  # fmt: skip
        shown.append({**r, "same": "; ".join(same)})
    llama = info.get("llama_cpp")
    version = llama.get("version", NOT_RECORDED) if isinstance(llama, dict) else NOT_RECORDED
    note = wrap(llama) if isinstance(llama, str) else ""  # why llama.cpp was not timed
    return fill("decode", "peers", version=version, llama_cpp=note, r=shown)


def _tokens(r: dict) -> str:
    """Whether qkv's tokens equal transformers', and where they part if not."""
    t, name, total = r.get("tokens") or {}, dtype_name(r.get("dtype")), r.get("new_tokens", "-")
    if not t:
        return fill("decode", "no_tokens", dtype=name)
    packed = "_packed" if t.get("packed_equals_qkv") else ""
    if t.get("equal"):
        matching = t.get("matching_steps", total)
        found = [fill("decode", "equal" + packed, matching=matching, total=total)]
    else:
        found = [fill("decode", "parts" + packed, step=t.get("first_divergence_step"))]
        ours, theirs = (get(t, "at_divergence", f"{who}_logits") for who in ("qkv", "transformers"))
        if ours and theirs:
            found.append(fill(
                "decode", "margins", ours=ours.get("margin"), theirs=theirs.get("margin"),
                ours_tied=ours.get("tied_at_max"),
                theirs_tied=theirs.get("tied_at_max"),
            ))  # fmt: skip
    if t.get("compiled_equals_qkv"):
        found.append(fill("decode", "compiled_equal"))
    else:
        step = get(t, "compiled_first_divergence", "transformers")
        found.append(fill("decode", "compiled_parts", step=step))
    return fill("decode", "tokens", dtype=name, findings="; ".join(found))


STATE_SPLIT = 1.25  # a row's fastest probe over its slowest: below this, one state only


class Round(NamedTuple):
    """One timing round of a row: its probe's read bandwidth (bytes/s), qkv's and llama.cpp's
    tokens/s, and the limit in tokens/s that the probe sets."""

    bandwidth: float
    ours: float
    theirs: float
    limit: float


def _by_memory_state(rows: list[dict], probe_bytes: int | None) -> str:
    """qkv's fastest path (compile="aot" where the row timed it, else compile=True) against
    llama.cpp in the rounds whose probe read slow and in those whose probe read fast."""
    shown = []
    for r in rows if probe_bytes is not None else []:
        ours = "qkv_aot" if get(r, "timings", "qkv_aot", "samples_ms") else "qkv_compiled"
        rounds = _rounds(r, probe_bytes, ours)
        speeds = [x.bandwidth for x in rounds]
        if not rounds or max(speeds) < STATE_SPLIT * min(speeds):
            continue
        middle = (min(speeds) + max(speeds)) / 2
        for state, chosen in (
            ("slow", [x for x in rounds if x.bandwidth < middle]),
            ("fast", [x for x in rounds if x.bandwidth >= middle]),
        ):
            shown.append({
                "dtype": dtype_name(r.get("dtype")), "path": ours.removeprefix("qkv_"),
                "state": state, **_medians(chosen),
            })  # fmt: skip
    return fill("decode", "states", s=shown) if shown else ""


def _medians(chosen: list[Round]) -> dict[str, float]:
    """The medians over the rounds of one memory state, each round against its own limit."""

    def median(value) -> float:
        return statistics.median(value(x) for x in chosen)

    return {
        "rounds": len(chosen), "bandwidth": median(lambda x: x.bandwidth) / 1e9,
        "ours": median(lambda x: x.ours), "theirs": median(lambda x: x.theirs),
        "ratio": median(lambda x: x.ours / x.theirs),
        "ours_share": median(lambda x: x.ours / x.limit),
        "theirs_share": median(lambda x: x.theirs / x.limit),
    }  # fmt: skip


def _rounds(r: dict, probe_bytes: int, name: str) -> list[Round]:
    """The row's timing rounds of qkv's candidate `name` and llama.cpp; [] where a sample is
    missing."""
    probes = r.get("bandwidth_probe_ms") or []
    ours = get(r, "timings", name, "samples_ms") or []
    theirs = get(r, "timings", "llama_cpp", "samples_ms") or []
    tokens, per_token = r.get("new_tokens"), get(r, "bytes_per_token", "total")
    if not (probes and len(probes) == len(ours) == len(theirs)) or not per_token or not tokens:
        return []
    rounds = []
    for probe_ms, our_ms, their_ms in zip(probes, ours, theirs, strict=True):
        bandwidth = probe_bytes / (probe_ms / 1e3)
        rounds.append(Round(
            bandwidth, tokens / (our_ms / 1e3), tokens / (their_ms / 1e3), bandwidth / per_token,
        ))  # fmt: skip
    return rounds


def decode_batch(data: dict) -> str:
    rows = sorted(data.get("rows", []), key=lambda r: dtype_rank(r.get("dtype")))
    against = [x for r in rows if is_number(x := get(r, "paired_ratios", "llama_cpp"))]
    verdict = ""
    if against:
        ratios = ", ".join(
            f"{dtype_name(r.get('dtype'))} {num(get(r, 'paired_ratios', 'llama_cpp'), '.2f')}x"
            for r in rows
        )
        verdict = fill("decode_batch", "verdict", ratios=ratios, verdict=met(min(against) >= 1.0))
    shown = []
    for r in rows:
        equal = get(r, "peers", "tokens_vs_transformers") or {}
        names = [name for name in ("qkv", "qkv_compiled", "transformers", "llama_cpp")
                 if name in equal]  # fmt: skip
        counts = ", ".join(f"{name} {get(equal, name, 'rows_equal')}" for name in names)
        shown.append({**r, "dtype": dtype_name(r.get("dtype")), "equal": counts or "-"})
    first = rows[0] if rows else {}
    return fill(
        "decode_batch", "section", prompt=first.get("prompt", "?"),
        new=first.get("new_tokens", "?"), verdict=verdict, r=shown,
        machine=machine_table([("decode_batch", data)]),
    )  # fmt: skip


PARTS = ("library", "into library", "after library", "outside steps", "total")


def decode_breakdown(data: dict) -> str:
    rows, shown = data.get("rows", []), []
    for r in rows:
        qkv, dtype = r.get("qkv_ms", {}), r.get("dtype")
        steps, total, library = qkv.get("steps") or 1, qkv.get("total"), qkv.get("library")
        for part in PARTS:
            value = qkv.get(part)
            per_step = value / steps if is_number(value) else None
            share = value / total if per_step is not None and total else None
            shown.append({
                "dtype": dtype, "part": part, "ms": value, "per_step": per_step,
                "share": num(share, ".1%"),
            })  # fmt: skip
        llama = r.get("llama_cpp_ms")
        if is_number(llama) and total and library:
            ratios = fill(
                "decode_breakdown", "llama_cpp", qkv=llama / total, library=llama / library,
            )  # fmt: skip
            shown.append({
                "dtype": dtype, "part": "llama.cpp, whole call", "ms": llama,
                "per_step": llama / r.get("new_tokens", 1), "share": ratios,
            })  # fmt: skip
        one = qkv.get("library, 1 thread")
        if is_number(one) and library:
            faster = fill("decode_breakdown", "one_thread", ratio=one / library)
            shown.append({
                "dtype": dtype, "part": "library, 1 thread", "ms": one, "per_step": one / steps,
                "share": faster,
            })  # fmt: skip
    return fill(
        "decode_breakdown", "section", new=get(rows, 0, "new_tokens", default="?"), r=shown,
        machine=machine_table([("decode_breakdown", data)]),
    )  # fmt: skip
