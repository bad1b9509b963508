"""The sections of whole models and of decoding: the figures and rows that fill their templates.

`models` compares whole models with transformers (the default run, and the run held to AVX2);
`decode` is greedy decoding at batch 1, memory-bound, so its tables put tokens/s beside the
limit that the measured read bandwidth sets; `decode_batch` decodes several sequences at once;
`decode_breakdown` splits the time of a decoding call; `kv_heads` sets MHA, GQA and MQA side
by side; `inspect_overhead` times decoding with qkv.inspect's points unused and used.
"""

from __future__ import annotations

import statistics

from .template import fill, get, is_number, wrap
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

# The default run, and the same run with PyTorch's kernels, oneDNN and MKL held to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2: the CPU kind
# without AVX-512).
MODELS_FILES = ("models", "models_avx2")


def default_ratios(results: dict[str, dict]) -> list[float]:
    """The default path's ratio of every row of every models file."""
    rows = [r for stem in MODELS_FILES for r in results.get(stem, {}).get("rows", [])]
    return [r["ratio"] for r in rows if is_number(r.get("ratio"))]


def models(results: dict[str, dict]) -> str:
    """The section of the default run and the subsection of the run held to AVX2."""
    found = [fill("models", part, figures=_models_figures(stem, results[stem]))
             for stem, part in zip(MODELS_FILES, ("section", "avx2"), strict=True)
             if stem in results]  # fmt: skip
    return "\n".join(found)  # the AVX2 heading follows the last table line directly


# The second path of a row: the packed forward, or training inside `speed_up`
SECOND_PATHS = (("packed", "packed_ratio"), ("speed_up", "speed_up_ratio"))


def _default_ratio(r: dict) -> float | None:
    """The ratio of the path qkv takes by default: the model as called, and for a training
    step what `qkv.training.train` runs (inside `speed_up`) where the file has it."""
    return r.get("speed_up_ratio", r.get("ratio"))


def _best_ratio(r: dict) -> float | None:
    """The faster of the plain path and the second path's ratio to transformers."""
    found = [r.get(key) for _, key in ((None, "ratio"), *SECOND_PATHS) if is_number(r.get(key))]
    return max(found) if found else None


def _model_cell(r: dict | None) -> str:
    """'0.972 (0.952); packed **1.088 (1.089)**': the faster path in bold."""
    if r is None:
        return "-"
    cells = [("", "ratio")] + [(f"{name} ", key) for name, key in SECOND_PATHS if key in r]
    shown = []
    for label, key in cells:
        text = paired(r.get(key), r.get(key.replace("ratio", "paired_ratio")))
        shown.append(f"{label}**{text}**" if r.get(key) == _best_ratio(r) else f"{label}{text}")
    return "; ".join(shown)


def _models_figures(stem: str, data: dict) -> str:
    """One models file: the verdict, the summary (a cell per dtype) and every row."""
    modes = {"forward": 0, "train": 1}
    rows = sorted(data.get("rows", []), key=lambda r: (
        str(r.get("model")), modes.get(r.get("mode"), 2), dtype_rank(r.get("dtype"))))  # fmt: skip
    default = [x for r in rows if is_number(x := _default_ratio(r))]
    best = [x for r in rows if (x := _best_ratio(r)) is not None]
    verdict = rates = ""
    if default:
        verdict = fill(
            "models", "verdict", default=span(default, ".3f", "x"), count=len(default),
            verdict=met(min(default) >= 1.0), best=span(best, ".3f", "x"),
        )  # fmt: skip
    if data.get("matmul_rate"):
        fractions = [100 * x for r in rows for name in ("qkv", "transformers")
                     if is_number(x := get(r, "fraction_of_matmul", name))]  # fmt: skip
        rates = listing(data["matmul_rate"].items(), ".0f", " GFLOP/s", 1e9)
        rates = fill("models", "rates", rates=rates, fractions=span(fractions, ".0f", "%"))
    shown = [{
        **r, "dtype": dtype_name(r.get("dtype")), "shape": f"{r.get('batch')} x {r.get('length')}",
        "plain": paired(r.get("ratio"), r.get("paired_ratio")),
        "packed": paired(r.get("packed_ratio"), r.get("packed_paired_ratio")),
        "speed_up": paired(r.get("speed_up_ratio"), r.get("speed_up_paired_ratio")),
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


FLOORS = ("matvec_floor", "packed_matvec_floor", "compiled_matvec_floor", "read_floor")


def decode(data: dict) -> dict:
    """Batch-1 decoding: the model, the read probe, targets, the tables, peers, tokens."""
    params = get(data, "model", "parameters")
    params = num(params / 1e6, ".1f") if isinstance(params, int) else "?"
    model = fill("decode", "model", c=get(data, "model", "config") or {}, parameters=params)
    rows = sorted(data.get("rows", []), key=lambda r: dtype_rank(r.get("dtype")))
    band = data.get("bandwidth") or {}
    probe_bytes = band.get("bytes") if isinstance(band.get("bytes"), int) else None
    setup = probe = ""
    if rows:
        transformers = data.get("transformers", NOT_RECORDED)
        setup = fill("decode", "setup", r=rows[0], transformers=transformers)
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
    return dict(
        model=model, setup=setup, probe=probe, targets="\n".join(targets), r=shown,
        peers=_peers(shown), states=_by_memory_state(rows, probe_bytes),
        tokens="\n".join(map(_tokens, rows)),
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
            found.append(fill("decode", "margins", qkv=ours, hf=theirs))
    if t.get("compiled_equals_qkv"):
        found.append(fill("decode", "compiled_equal"))
    else:
        step = get(t, "compiled_first_divergence", "transformers")
        found.append(fill("decode", "compiled_parts", step=step))
    return fill("decode", "tokens", dtype=name, findings="; ".join(found))


STATE_SPLIT = 1.25  # a row's fastest probe over its slowest: below this, one state only


def _by_memory_state(rows: list[dict], probe_bytes: int | None) -> str:
    """qkv's fastest path (compile="aot" where the row timed it, else compile=True) against
    llama.cpp in the rounds whose probe read slow and in those whose probe read fast: medians
    over the rounds of each state, each round against the limit its own probe sets."""
    shown = []
    for r in rows if probe_bytes is not None else []:
        ours = "qkv_aot" if get(r, "timings", "qkv_aot", "samples_ms") else "qkv_compiled"
        rounds = _rounds(r, probe_bytes, ours)
        speeds = [bandwidth for bandwidth, *_ in rounds]
        if not rounds or max(speeds) < STATE_SPLIT * min(speeds):
            continue
        middle = (min(speeds) + max(speeds)) / 2
        for state, chosen in (("slow", [x for x in rounds if x[0] < middle]),
                              ("fast", [x for x in rounds if x[0] >= middle])):  # fmt: skip
            columns = zip(ROUND, zip(*chosen, strict=True), strict=True)
            medians = {key: statistics.median(x) for key, x in columns}
            medians["bandwidth"] /= 1e9
            shown.append({
                "dtype": dtype_name(r.get("dtype")), "path": ours.removeprefix("qkv_"),
                "state": state, "rounds": len(chosen), **medians,
            })  # fmt: skip
    return fill("decode", "states", s=shown) if shown else ""


# The figures of one timing round, in the order _rounds gives them.
ROUND = ("bandwidth", "ours", "theirs", "ratio", "ours_share", "theirs_share")


def _rounds(r: dict, probe_bytes: int, name: str) -> list[tuple[float, ...]]:
    """The row's timing rounds of qkv's candidate `name` and llama.cpp, each as the figures of
    ROUND (bytes/s; tokens/s; shares of the limit that the round's probe sets); [] where a sample
    is missing."""
    probes = r.get("bandwidth_probe_ms") or []
    ours = get(r, "timings", name, "samples_ms") or []
    theirs = get(r, "timings", "llama_cpp", "samples_ms") or []
    tokens, per_token = r.get("new_tokens"), get(r, "bytes_per_token", "total")
    if not (probes and len(probes) == len(ours) == len(theirs)) or not per_token or not tokens:
        return []
    rounds = []
    for probe_ms, our_ms, their_ms in zip(probes, ours, theirs, strict=True):
        bandwidth = probe_bytes / (probe_ms / 1e3)
        us, them, limit = tokens / (our_ms / 1e3), tokens / (their_ms / 1e3), bandwidth / per_token
        rounds.append((bandwidth, us, them, us / them, us / limit, them / limit))
    return rounds


def decode_batch(data: dict) -> dict:
    """Several sequences at once, against transformers and llama.cpp."""
    rows = sorted(data.get("rows", []), key=lambda r: dtype_rank(r.get("dtype")))
    against = [(dtype_name(r.get("dtype")), get(r, "paired_ratios", "llama_cpp")) for r in rows]
    verdict = ""
    if any(is_number(x) for _, x in against):
        worst = min(x for _, x in against if is_number(x))
        verdict = fill("decode_batch", "verdict", ratios=listing(against, ".2f", "x"),
                       verdict=met(worst >= 1.0))  # fmt: skip
    shown = []
    for r in rows:
        equal = get(r, "peers", "tokens_vs_transformers") or {}
        names = [x for x in CANDIDATES if x in equal]
        counts = [f"{name} {get(equal, name, 'rows_equal')}" for name in names]
        shown.append({
            **r, "dtype": dtype_name(r.get("dtype")), "equal": ", ".join(counts) or "-",
            "torch_compile": num(get(r, "tokens_per_s", "torch_compile"), ".1f"),
            "over_torch_compile": num(r.get("compiled_over_torch_compile"), ".3f"),
            "lengths": span(r.get("prompt_lengths") or [], ".0f"),
        })  # fmt: skip
    return dict(first=rows[0] if rows else {}, verdict=verdict, r=shown)


CANDIDATES = ("qkv", "qkv_compiled", "torch_compile", "transformers", "llama_cpp")


PARTS = ("library", "into library", "after library", "outside steps", "total")


def decode_breakdown(data: dict) -> dict:
    """The parts of a decoding call's time; llama.cpp's whole call and one thread beside them."""
    rows, shown = data.get("rows", []), []
    for r in rows:
        qkv = r.get("qkv_ms", {})
        steps, total, library = qkv.get("steps") or 1, qkv.get("total"), qkv.get("library")
        found = []  # (part, ms per call, ms per step, share of the call)
        for part in PARTS:
            value = qkv.get(part)
            per_step = value / steps if is_number(value) else None
            share = value / total if per_step is not None and total else None
            found.append((part, value, per_step, num(share, ".1%")))
        llama, one = r.get("llama_cpp_ms"), qkv.get("library, 1 thread")
        if is_number(llama) and total and library:
            ratio = fill("decode_breakdown", "llama_cpp", qkv=llama / total,
                         library=llama / library)  # fmt: skip
            found.append(("llama.cpp, whole call", llama, llama / r.get("new_tokens", 1), ratio))
        if is_number(one) and library:
            faster = fill("decode_breakdown", "one_thread", ratio=one / library)
            found.append(("library, 1 thread", one, one / steps, faster))
        keys = ("part", "ms", "per_step", "share")
        shown += [dict(zip(keys, x, strict=True), dtype=r.get("dtype")) for x in found]
    return dict(new=get(rows, 0, "new_tokens", default="?"), r=shown)


def kv_heads(data: dict) -> dict:
    """MHA, GQA and MQA decoding steps: every row, predicted and measured ratios to MHA."""
    rows = [{**r, "same": "yes" if r.get("same_tokens") else "no"} for r in data.get("rows", [])]
    return dict(d=data, r=rows)


def inspect_overhead(data: dict) -> dict:
    """Decoding with qkv.inspect's points unused and used, against the model as loaded."""

    def yes(key: str) -> str:
        return {True: "yes", False: "no"}.get(data.get(key), "not recorded")

    return dict(d=data, r=data.get("rows", []), same=yes("same_tokens_after_inspection"),
                changed=yes("ablation_changed_tokens"))  # fmt: skip
