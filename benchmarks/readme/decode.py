"""The section of benchmarks/decode.py: greedy decoding at batch 1 against transformers.

Decoding is memory-bound, so the tables give tokens/s beside the limit that the measured read
bandwidth sets, with the diagnostics (matvec floors, one read per weight tensor) and, per dtype,
whether qkv's tokens equal transformers' and where they part if not.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

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

DECODE_TEXT = """\
Greedy decoding at batch 1, one call timed as a user sees it, the prefill included. The model
is a Llama-style GPT ({model}), built by transformers and saved once, then loaded from that
directory by both libraries; the peer is transformers' `generate` with
`attn_implementation="sdpa"`. Neither stops early (the config has no eos token), and the tokens
of every path are compared with transformers'. Four qkv paths, side by side:
- qkv: `qkv.generation.generate(model, ..., compile=False)`, eager (the default, compile="auto",
  switches to the aot steps below once they pay for themselves), its fp32 products on
  oneDNN where that is faster here (`qkv.layers.Linear`);
- packed: the same inside `with qkv.acceleration.packed_linears(model):` (what `qkv generate` does
  on the CPU unless given `--no-pack`): every linear becomes a `PackedLinear` that holds its
  weight in oneDNN's blocked layout, with q/k/v and SwiGLU's gate/up fused into one product each;
  weights are packed once, at the first call ("pack ms"), for inference only, as a second copy of
  what is used;
- compiled: the packed model with `generate(..., compile=True)` (`qkv generate --compile`): the
  steps after the prefill run the model's forward compiled ahead of time by
  `torch.compile(...).aot_compile` with dynamic shapes (one graph for every step and call).
  Once two consecutive steps have passed the graph's guards, later steps call the compiled
  bytecode directly (`src/qkv/acceleration/compiled.py`). Norms, RoPE, casts and cache writes fuse
  into one C++ kernel per layer, each one-row product is a streaming reduction, and each
  layer's new key and value are written in place into its cache tensor. Compiling is paid once
  per machine and architecture ("compile s: cold": the first call, with torch.compile's caches
  and qkv's compile store empty; "next process": a new process's first call, which loads the
  stored graph instead of compiling);
- aot: the packed model with `generate(..., compile="aot")`: the same step exported once
  (`torch.export`) and compiled ahead of time by AOTInductor into a library whose C++ wrapper
  calls the same kernels, with the model's own weights as its constants
  (`src/qkv/acceleration/exported.py`); no Python runs between a step's kernels ("aot compile
  s": its first call, after compile=True's; "next process": loading the stored library, in the
  same new process after its compile=True call; "aot / compiled": what the library buys).

At batch 1 every step reads every weight once (of the embedding table, the one row looked up)
and the K/V cache so far, at about one FLOP per byte: decoding is memory-bound. The limit in
tokens/s is the read bandwidth over the bytes a token reads (the weights plus the mean K/V
bytes over the call's forward passes). The read bandwidth is that of a `.sum()` over a 1 GiB
fp32 tensor, probed before the models and once in every timing round. "Strict" divides by the
fastest probe of the whole run; "paired" divides each round by the limit from its own probe
and takes the median over rounds, which matters on a machine whose read bandwidth varies from
probe to probe. The diagnostics: the matvec floor (the model's own `F.linear` products alone,
one token, PyTorch's default kernels), the packed matvec floor (the packed products a packed
step calls, alone), the compiled matvec floor (the products of a compiled step, inductor's
one-row reductions, alone: the most compile=True and compile="aot" can reach) and one `.sum()`
per weight tensor a step reads (how fast these tensors can be read one call at a time)."""


def _gbps(bytes_per_token: object, tokens_per_s: object) -> str:
    if isinstance(bytes_per_token, int | float) and isinstance(tokens_per_s, int | float):
        return f"{bytes_per_token * tokens_per_s / 1e9:.1f}"
    return "-"


def _tokens_note(r: dict) -> str:
    t = r.get("tokens") or {}
    name = dtype_name(r.get("dtype"))
    total = r.get("new_tokens", "-")
    if not t:
        return f"{name}: tokens {NOT_RECORDED}."
    parts = []
    if t.get("equal"):
        same = "qkv's tokens equal transformers'"
        same += " (packed too)" if t.get("packed_equals_qkv") else ""
        parts.append(f"{same}, {t.get('matching_steps', total)}/{total}")
    else:
        step = t.get("first_divergence_step")
        text = f"qkv parts from transformers at step {step}"
        text += " (packed too)" if t.get("packed_equals_qkv") else ""
        ours = get(t, "at_divergence", "qkv_logits")
        theirs = get(t, "at_divergence", "transformers_logits")
        if ours and theirs:
            text += (
                f"; there, the margin between the top two logits is "
                f"{num(ours.get('margin'), '.3g')} in qkv ({ours.get('tied_at_max')} tokens at "
                f"the max) and {num(theirs.get('margin'), '.3g')} in transformers "
                f"({theirs.get('tied_at_max')} at the max)"
            )
        parts.append(text)
    if t.get("compiled_equals_qkv"):
        parts.append("compiled equals qkv")
    else:
        step = get(t, "compiled_first_divergence", "transformers")
        parts.append(f"compiled parts from transformers at step {step}")
    return f"{name}: " + "; ".join(parts) + "."


def decode_section(data: dict) -> list[str]:
    config = get(data, "model", "config") or {}
    params = get(data, "model", "parameters")
    rows = sorted(data.get("rows", []), key=lambda r: dtype_rank(r.get("dtype")))
    model = (
        f"{num(params / 1e6, '.1f') if isinstance(params, int) else '?'}M parameters: "
        f"E = {config.get('hidden_size', '?')}, {config.get('num_hidden_layers', '?')} layers, "
        f"{config.get('num_attention_heads', '?')} query heads over "
        f"{config.get('num_key_value_heads', '?')} K/V heads, SwiGLU "
        f"{config.get('intermediate_size', '?')}, vocabulary {config.get('vocab_size', '?')}"
    )
    lines = [
        "## Decoding (`decode.py`)",
        "",
        *prose(DECODE_TEXT.format(model=model)),
        "",
        *machine_table([("decode", data)]),
        "",
    ]
    if rows:
        first = rows[0]
        lines += [
            *prose(
                f"Batch {first.get('batch')}, a {first.get('prompt')}-token prompt, "
                f"{first.get('new_tokens')} new tokens; transformers "
                f"{data.get('transformers', NOT_RECORDED)}."
            ),
            "",
        ]
    band = data.get("bandwidth") or {}
    samples = [
        band["bytes"] / (ms / 1e3)
        for ms in band.get("read_samples_ms", [])
        if isinstance(band.get("bytes"), int)
    ]
    if band:
        lines += [
            *prose(
                f"Read probe (1 GiB `.sum()`): fastest "
                f"{num(band.get('read_peak', 0) / 1e9, '.1f')} GB/s, median "
                f"{num(band.get('read_median', 0) / 1e9, '.1f')} GB/s over the run's "
                f"{len(samples)} probes (before the models and in the timing rounds), which "
                f"span {span([s / 1e9 for s in samples], '.0f', ' GB/s')}. `copy_` (read + "
                f"write): {num(band.get('copy_peak', 0) / 1e9, '.1f')} GB/s."
            ),
            "",
        ]
    targets = data.get("targets") or {}
    target_ratio, target_fraction = targets.get("ratio"), targets.get("fraction_of_limit")
    verdicts = []
    if rows and isinstance(target_ratio, int | float):
        worst = min(
            max(r.get(k, 0) for k in ("ratio", "packed_ratio", "compiled_ratio")) for r in rows
        )
        verdicts.append(
            f"qkv's fastest path at least {target_ratio}x transformers' tokens/s: "
            f"{'met' if worst >= target_ratio else 'not met'} (lowest {worst:.2f}x)."
        )
    if rows and isinstance(target_fraction, int | float):
        best = [
            max(
                get(r, "fraction_of_round_limit", "qkv_compiled", default=0),
                get(r, "fraction_of_limit", "qkv_compiled", default=0),
            )
            for r in rows
        ]
        verdicts.append(
            f"at least {target_fraction:.0%} of the limit: "
            f"{'met' if min(best) >= target_fraction else 'not met'} "
            f"(compiled, the better of strict and paired: {span(best, '.1%')})."
        )
    lines += [line for v in verdicts for line in prose(f"- Target: {v}")]
    lines += [""] if verdicts else []
    header = [
        "dtype",
        "qkv",
        "packed",
        "compiled",
        "compiled, aot",
        "compiled, guarded",
        "transformers",
        "compiled / transformers (paired)",
        "limit",
        "compiled % of limit: strict / paired",
        "one `.sum()` per weight, % of limit",
        "pack ms",
        "compile s: cold / next process",
        "aot compile s: cold / next process",
        "guard-free / guarded (paired)",
        "aot / compiled (paired)",
    ]
    body = [
        [
            dtype_name(r.get("dtype")),
            num(get(r, "tokens_per_s", "qkv"), ".1f"),
            num(get(r, "tokens_per_s", "qkv_packed"), ".1f"),
            f"**{num(get(r, 'tokens_per_s', 'qkv_compiled'), '.1f')}**",
            f"**{num(get(r, 'tokens_per_s', 'qkv_aot'), '.1f')}**",
            num(get(r, "tokens_per_s", "qkv_guarded"), ".1f"),
            num(get(r, "tokens_per_s", "transformers"), ".1f"),
            paired(r.get("compiled_ratio"), r.get("compiled_paired_ratio"), ".2f"),
            num(r.get("bandwidth_limit_tokens_per_s"), ".0f"),
            f"{pct(get(r, 'fraction_of_limit', 'qkv_compiled'), '.1f')} / "
            f"{pct(get(r, 'fraction_of_round_limit', 'qkv_compiled'), '.1f')}",
            pct(get(r, "fraction_of_limit", "read_floor"), ".1f"),
            num(r.get("packing_ms"), ".0f"),
            f"{num(r.get('compile_s'), '.1f')} / "
            f"{num(get(r, 'warm_compile', 'first_call_s'), '.1f')}",
            f"{num(r.get('aot_compile_s'), '.1f')} / "
            f"{num(get(r, 'warm_compile', 'aot_first_call_s'), '.1f')}",
            num(r.get("guard_free_paired_gain"), ".3f"),
            num(r.get("aot_over_compiled_paired"), ".3f"),
        ]
        for r in rows
    ]
    lines += ["Tokens/s (median call):", "", *md_table(header, body), ""]
    header = [
        "dtype",
        "MB read per token",
        "qkv / transformers (paired)",
        "packed / transformers (paired)",
        "matvec floor tok/s (weights GB/s)",
        "packed matvec floor tok/s (weights GB/s)",
        "compiled matvec floor tok/s (weights GB/s)",
        "one `.sum()` per weight tok/s (GB/s)",
        "read probe in the timing rounds, GB/s",
    ]
    body = []
    for r in rows:
        weights = get(r, "bytes_per_token", "weights")
        total = get(r, "bytes_per_token", "total")
        cells = []
        for name in ("matvec_floor", "packed_matvec_floor", "compiled_matvec_floor", "read_floor"):
            speed = get(r, "tokens_per_s", name)
            cells.append(f"{num(speed, '.1f')} ({_gbps(weights, speed)})")
        body.append(
            [
                dtype_name(r.get("dtype")),
                num(total / 1e6 if isinstance(total, int | float) else None, ".1f"),
                paired(r.get("ratio"), r.get("paired_ratio")),
                paired(r.get("packed_ratio"), r.get("packed_paired_ratio")),
                *cells,
                span(
                    [
                        band["bytes"] / (ms / 1e3) / 1e9
                        for ms in r.get("bandwidth_probe_ms", [])
                        if isinstance(band.get("bytes"), int)
                    ],
                    ".0f",
                ),
            ]
        )
    lines += ["The diagnostics:", "", *md_table(header, body), ""]
    lines += _peers(rows)
    lines += _by_memory_state(rows, band.get("bytes"))
    lines += ["Tokens compared with transformers':", ""]
    lines += [line for r in rows for line in prose(f"- {_tokens_note(r)}")]
    return lines


PEERS_TEXT = """\
Against what a CPU user would run instead, in the same interleaved rounds: llama.cpp
(llama-cpp-python {version}) decoding the same weights written as a GGUF file ({gguf}; q/k rows
interleaved for its RoPE; greedy by argmax over its logits, one `eval` per token), and
transformers with a static cache and its forward compiled by `torch.compile` (fullgraph), as its
documentation speeds generation up. llama.cpp is timed only if its fp32 tokens equal
transformers'."""


def _peers(rows: list[dict]) -> list[str]:
    if not any("peers" in r for r in rows):
        return []
    info = next(r["peers"] for r in rows if "peers" in r)
    llama = info.get("llama_cpp")
    version = llama.get("version", NOT_RECORDED) if isinstance(llama, dict) else NOT_RECORDED
    lines = [*prose(PEERS_TEXT.format(version=version, gguf="fp32 or bf16 matrices")), ""]
    if isinstance(llama, str):
        lines += [*prose(llama), ""]
    header = [
        "dtype",
        "qkv compiled",
        "qkv aot",
        "llama.cpp",
        "transformers compiled",
        "qkv compiled / llama.cpp (paired)",
        "qkv aot / llama.cpp (paired)",
        "qkv compiled / transformers compiled (paired)",
        "qkv aot % of limit (paired)",
        "llama.cpp % of limit (paired)",
        "transformers compile s",
        "tokens vs transformers: llama.cpp; transformers compiled",
    ]
    body = []
    for r in rows:
        steps = get(r, "peers", "first_divergence_from_transformers") or {}
        same = [
            "equal" if steps.get(name, "-") is None else f"from step {steps.get(name, '-')}"
            for name in ("llama_cpp", "transformers_compiled")
        ]
        body.append(
            [
                dtype_name(r.get("dtype")),
                num(get(r, "tokens_per_s", "qkv_compiled"), ".1f"),
                num(get(r, "tokens_per_s", "qkv_aot"), ".1f"),
                num(get(r, "tokens_per_s", "llama_cpp"), ".1f"),
                num(get(r, "tokens_per_s", "transformers_compiled"), ".1f"),
                num(get(r, "peer_paired_ratios", "llama_cpp"), ".2f"),
                num(get(r, "aot_peer_paired_ratios", "llama_cpp"), ".2f"),
                num(get(r, "peer_paired_ratios", "transformers_compiled"), ".2f"),
                pct(get(r, "fraction_of_round_limit", "qkv_aot"), ".1f"),
                pct(get(r, "fraction_of_round_limit", "llama_cpp"), ".1f"),
                num(get(r, "peers", "hf_compile_s"), ".1f"),
                "; ".join(same),
            ]
        )
    return [*lines, "Tokens/s (median call):", "", *md_table(header, body), ""]


STATES_TEXT = """\
The read bandwidth of this kind of machine moves between states within a run (the probes above),
and the two decoders do not move alike. Each timing round is put in the state its own probe
found (below or above the midpoint between the row's slowest and fastest probe), and the
medians are taken within each state: what qkv/llama.cpp is when memory is slow and when it is
fast."""

_STATE_SPLIT = 1.25  # a row's fastest probe over its slowest: below this, one state only


def _by_memory_state(rows: list[dict], probe_bytes: object) -> list[str]:
    """qkv's fastest path (compile="aot" where the row timed it, else compile=True) against
    llama.cpp per memory state, from the rounds' raw samples."""
    if not isinstance(probe_bytes, int):
        return []
    body = []
    for r in rows:
        ours = "qkv_aot" if get(r, "timings", "qkv_aot", "samples_ms") else "qkv_compiled"
        per_round = _rounds(r, probe_bytes, ours)
        if not per_round:
            continue
        speeds = [x.bandwidth for x in per_round]
        if max(speeds) < _STATE_SPLIT * min(speeds):
            continue
        middle = (min(speeds) + max(speeds)) / 2
        for state, chosen in (
            ("slow", [x for x in per_round if x.bandwidth < middle]),
            ("fast", [x for x in per_round if x.bandwidth >= middle]),
        ):
            body.append(
                [
                    dtype_name(r.get("dtype")),
                    ours.removeprefix("qkv_"),
                    state,
                    str(len(chosen)),
                    num(statistics.median(x.bandwidth for x in chosen) / 1e9, ".0f"),
                    num(statistics.median(x.ours for x in chosen), ".0f"),
                    num(statistics.median(x.theirs for x in chosen), ".0f"),
                    num(statistics.median(x.ours / x.theirs for x in chosen), ".2f"),
                    pct(statistics.median(x.ours / x.limit for x in chosen), ".1f"),
                    pct(statistics.median(x.theirs / x.limit for x in chosen), ".1f"),
                ]
            )
    if not body:
        return []
    header = [
        "dtype",
        "qkv path",
        "memory",
        "rounds",
        "read probe GB/s",
        "qkv tok/s",
        "llama.cpp tok/s",
        "qkv / llama.cpp (paired)",
        "qkv % of the round's limit",
        "llama.cpp % of the round's limit",
    ]
    return [*prose(STATES_TEXT), "", *md_table(header, body), ""]


class _Round(NamedTuple):
    """One timing round: its probe's read bandwidth (bytes/s), qkv's and llama.cpp's tokens/s,
    and the limit in tokens/s that the probe sets."""

    bandwidth: float
    ours: float
    theirs: float
    limit: float


def _rounds(r: dict, probe_bytes: int, name: str) -> list[_Round]:
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
        rounds.append(
            _Round(bandwidth, tokens / (our_ms / 1e3), tokens / (their_ms / 1e3),
                   bandwidth / per_token)
        )  # fmt: skip
    return rounds
