"""The section of benchmarks/decode_breakdown.py: where a decoding step's time goes."""

from __future__ import annotations

from .format import get, md_table, num, pct, prose
from .machine import machine_table

TEXT = """\
The default call of the decoding benchmark (batch 1, a 32-token prompt, {new} new tokens,
`generate(..., compile="aot")` inside `packed_linears`: what `compile="auto"` takes), split by
timers around the AOTInductor library's run: the library (its C++ wrapper, kernels,
allocations and SDPA calls, and each row's argmax and largest logit, which greedy decoding
takes as its choice and its finiteness check); into it, which calls it serves and the list of
its inputs; after it, the cache's new length; outside the steps, the prefill and the loop's own
work per step (reading the row maxima, the positions, the tokens). llama.cpp's whole call on the
same weights is timed in the same rounds. The fastest round of each. "library alone" is what qkv
would reach with no Python around its steps. "library, 1 thread" is the same library compiled
for one thread: its ratio to the two-thread figure is what the second core buys."""

PARTS = ("library", "into library", "after library", "outside steps", "total")


def decode_breakdown_section(data: dict) -> list[str]:
    rows = data.get("rows", [])
    new = get(rows, 0, "new_tokens", default="?")
    header = ["dtype", "part", "ms per call", "ms per step", "share of the call"]
    body = []
    for row in rows:
        qkv, steps = row.get("qkv_ms", {}), get(row, "qkv_ms", "steps", default=0) or 1
        for part in PARTS:
            value = qkv.get(part)
            per_step = value / steps if isinstance(value, (int, float)) else None
            share = value / qkv["total"] if per_step is not None and qkv.get("total") else None
            body.append([row.get("dtype"), part, num(value, ".1f"), num(per_step, ".3f"),
                         pct(share, ".1f")])  # fmt: skip
        llama = row.get("llama_cpp_ms")
        if isinstance(llama, (int, float)) and qkv.get("total") and qkv.get("library"):
            ratios = (f"qkv {llama / qkv['total']:.2f}x llama.cpp's speed; library alone "
                      f"{llama / qkv['library']:.2f}x")  # fmt: skip
            body.append([row.get("dtype"), "llama.cpp, whole call", num(llama, ".1f"),
                         num(llama / row.get("new_tokens", 1), ".3f"), ratios])  # fmt: skip
        one = qkv.get("library, 1 thread")
        if isinstance(one, (int, float)) and qkv.get("library"):
            body.append([row.get("dtype"), "library, 1 thread", num(one, ".1f"),
                         num(one / steps, ".3f"),
                         f"2 threads {one / qkv['library']:.2f}x as fast"])  # fmt: skip
    lines = ["## Where a decoding step's time goes (`decode_breakdown.py`)", ""]
    lines += [*prose(TEXT.format(new=new)), ""]
    return [*lines, *md_table(header, body), "", *machine_table([("decode_breakdown", data)])]
