"""The section of benchmarks/linear.py: linear attention against softmax attention."""

from __future__ import annotations

from .format import get, md_table, num, prose
from .machine import machine_table

LINEAR_TEXT = """\
Causal self-attention, forward, fp32, (B, H, D) = (1, 8, 64): `qkv.attention(..., causal=True)`
(softmax; `auto` runs SDPA's fused kernel) against `linear_attention` with elu(x) + 1 features
(Katharopoulos et al. 2020; F = {elu} features) and FAVOR+ random features (Choromanski et al.
2021; F = {favor}), whose causal form runs chunked prefix sums. Decoding: the cost of one new
token after a context of L tokens, softmax reading a KV cache of L keys, linear attention
updating its (F, D) state (`linear_attention_step`). The crossover is the shortest length from
which a linear form's forward stays faster than softmax's."""

NAMES = ("softmax", "elu", "favor")


def linear_section(data: dict) -> list[str]:
    features = data.get("features", {})
    text = LINEAR_TEXT.format(elu=features.get("elu", "?"), favor=features.get("favor", "?"))
    lines = ["## Linear attention (`linear.py`)", "", *prose(text), ""]
    crossover = data.get("crossover_length", {})
    flat = data.get("decode_longest_over_shortest", {})
    lines += prose(
        f"Crossover: elu from L = {crossover.get('elu', '-')}, FAVOR+ from L = "
        f"{crossover.get('favor', '-')}. Decoding step at the longest context over the shortest: "
        + ", ".join(f"{n} {num(flat.get(n), '.2f')}x" for n in NAMES)
        + " (flat: about 1)."
    )
    header = ["L", *(f"{n} forward ms" for n in NAMES), *(f"{n} step us" for n in NAMES)]
    body = [
        [
            f.get("length"),
            *(num(1e3 * get(f, "seconds", n, default=float("nan")), ".2f") for n in NAMES),
            *(num(1e6 * get(d, "seconds_per_step", n, default=float("nan")), ".1f") for n in NAMES),
        ]
        for f, d in zip(data.get("forward", []), data.get("decode", []), strict=False)
    ]
    return [*lines, "", *md_table(header, body), "", *machine_table([("linear", data)])]
