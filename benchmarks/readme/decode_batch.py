"""The section of benchmarks/decode_batch.py: greedy decoding of B sequences at once against
transformers and llama.cpp's batched decoding."""

from __future__ import annotations

from .format import dtype_name, dtype_rank, get, md_table, num, prose
from .machine import machine_table

BATCH_TEXT = """\
Greedy decoding of B sequences at once (B prompts of {prompt} random tokens, {new} new tokens
each, the prefill included), the model and weights of the batch-1 table above. qkv: `generate`
eager ("qkv") and the packed, compiled path ("compiled"); transformers: `generate`; llama.cpp:
its C API with one context holding B sequences, every prompt in one `llama_decode` and one call
per step for all sequences (llama-cpp-python's `Llama` class decodes one sequence at a time).
Each candidate's tokens are compared with transformers' before timing (rows equal, of B);
llama.cpp is timed in fp32 only if every row agrees or parts at a near-tie of transformers'
logits (top-2 margin below 1e-3; llama.cpp keeps its K/V cache in fp16 by default). tokens/s
counts the tokens of all B sequences; ratios are qkv's faster path over the peer, the median
of per-round ratios (above 1: qkv is faster). Target: at least 1.0 against llama.cpp."""

NAMES = ("qkv", "qkv_compiled", "transformers", "llama_cpp")


def decode_batch_section(data: dict) -> list[str]:
    rows = sorted(data.get("rows", []), key=lambda r: dtype_rank(r.get("dtype")))
    first = rows[0] if rows else {}
    text = BATCH_TEXT.format(prompt=first.get("prompt", "?"), new=first.get("new_tokens", "?"))
    lines = [
        "### Several sequences at once (`decode_batch.py`)",
        "",
        *prose(text),
        "",
        *machine_table([("decode_batch", data)]),
        "",
    ]
    against = [get(r, "paired_ratios", "llama_cpp") for r in rows]
    against = [x for x in against if isinstance(x, int | float)]
    if against:
        verdict = "met" if min(against) >= 1.0 else "not met"
        figures = ", ".join(
            f"{dtype_name(r.get('dtype'))} {num(get(r, 'paired_ratios', 'llama_cpp'), '.2f')}x"
            for r in rows
        )
        lines += [*prose(f"qkv over llama.cpp: {figures} (target >= 1.0: {verdict})."), ""]
    header = ["dtype", "B", "qkv tok/s", "compiled tok/s", "transformers tok/s"]
    header += ["llama.cpp tok/s", "qkv / transformers", "qkv / llama.cpp", "rows equal"]
    body = []
    for r in rows:
        equal = get(r, "peers", "tokens_vs_transformers") or {}
        counts = ", ".join(
            f"{name} {get(equal, name, 'rows_equal')}" for name in NAMES if name in equal
        )
        body.append(
            [
                dtype_name(r.get("dtype")),
                r.get("batch"),
                *(num(get(r, "tokens_per_s", name), ".1f") for name in NAMES),
                num(get(r, "paired_ratios", "transformers"), ".3f"),
                num(get(r, "paired_ratios", "llama_cpp"), ".3f"),
                counts or "-",
            ]
        )
    return lines + md_table(header, body)
