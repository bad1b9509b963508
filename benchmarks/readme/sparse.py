"""The section of benchmarks/sparse.py: a BigBird pattern on the tiled path against SDPA with
the dense mask and FlexAttention with the BlockMask."""

from __future__ import annotations

from .format import get, md_table, num, prose
from .machine import machine_table

SPARSE_TEXT = """\
`qkv.attention(q, k, v, pattern=...)` with BigBird's pattern (Zaheer et al. 2020: a window of
{window} keys on each side, the first {global_tokens} tokens global, {random} random blocks of
{block} keys per query block), forward, fp32, (B, H, D) = (1, 8, 64), against
`F.scaled_dot_product_attention` with the pattern's dense bool mask (built outside the timed
call; up to the longest length whose mask fits) and `torch.compile(flex_attention)` with a
BlockMask of the same blocks and a mask_mod from the paper's definition. The outputs are compared
before timing. "blocks computed" is the share of {block} x {block} tiles the pattern leaves
visible; "sdpa / qkv" and "flex / qkv" are time ratios (above 1: qkv is faster); peak memory is
how far one call lifts the resident set of a fresh process that built only that candidate's
inputs, SDPA's dense mask (built before its call) apart. Targets: qkv's time grows
like L (fitted exponent ~1) and SDPA with the mask takes >= 5x qkv's time at L = 16384."""


def sparse_section(data: dict) -> list[str]:
    pattern = data.get("pattern", {})
    text = SPARSE_TEXT.format(
        window=pattern.get("window", "?"), global_tokens=pattern.get("global_tokens", "?"),
        random=pattern.get("random_blocks", "?"), block=pattern.get("block", "?"),
    )  # fmt: skip
    lines = ["## Sparse patterns (`sparse.py`)", "", *prose(text), ""]
    exponents = data.get("fitted_exponent", {})
    at_16k = data.get("sdpa_over_qkv_at_16k")
    verdict = "-" if at_16k is None else ("met" if at_16k >= 5.0 else "not met")
    lines += prose(
        f"Fitted exponent of time in L: qkv {num(exponents.get('qkv'), '.2f')}, SDPA "
        f"{num(exponents.get('sdpa'), '.2f')}, FlexAttention {num(exponents.get('flex'), '.2f')}."
        f" SDPA / qkv at L = 16384: {num(at_16k, '.2f')} (target >= 5: {verdict})."
    )
    header = ["L", "auto ran", "blocks computed", "qkv s", "sdpa s", "flex s", "sdpa / qkv"]
    header += ["flex / qkv", "qkv peak MiB", "sdpa peak MiB", "dense mask MiB"]
    body = [
        [
            r.get("length"),
            r.get("auto_backend", "-"),
            num(r.get("computed_fraction"), ".1%"),
            *(num(get(r, "seconds", n), ".3f") for n in ("qkv", "sdpa", "flex")),
            *(num(get(r, "ratios", n), ".2f") for n in ("sdpa", "flex")),
            *(num(get(r, "peak_memory_mib", n), ".0f") for n in ("qkv", "sdpa")),
            num(r.get("dense_mask_mib"), ".0f") if "sdpa" in r.get("seconds", {}) else "-",
        ]
        for r in data.get("rows", [])
    ]
    return [*lines, "", *md_table(header, body), "", *machine_table([("sparse", data)])]
