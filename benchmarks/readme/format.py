"""Formatting helpers of the page: numbers, markdown tables and prose.

A number that a result file lacks (or holds as something else) prints as "-" rather than
failing, so a partial file still gives a page. `prose` refills the method texts of the sections
to 100 columns and never starts a continuation line with something that markdown would read as
structure (a list item, a quote, a heading). dtypes print short (fp32, bf16, fp16) and sort in
that order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

NOT_RECORDED = "not recorded"
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2}


def get(data: object, *keys: str | int, default: object = None) -> object:
    """data[k0][k1]..., or `default` where any level is missing."""
    for key in keys:
        try:
            data = data[key]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return default
    return data


def num(value: object, spec: str, *, missing: str = "-") -> str:
    """`value` formatted with `spec` ('.3f', ',.0f', ...), or `missing` if it is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return missing
    if isinstance(value, float) and not math.isfinite(value):
        return missing
    return format(value, spec)


def pct(fraction: object, spec: str = ".0f") -> str:
    """A fraction as a percentage: 0.745 -> '75%'."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        return "-"
    return format(100 * fraction, spec) + "%"


def span(values: Iterable[float], spec: str, unit: str = "") -> str:
    """'a-b' (or 'a' when both ends print alike) over `values`; '-' for none."""
    values = sorted(values)
    if not values:
        return "-"
    low, high = format(values[0], spec), format(values[-1], spec)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def dtype_name(name: object) -> str:
    return DTYPE_NAMES.get(str(name), str(name))


def dtype_rank(name: object) -> int:
    return DTYPE_ORDER.get(dtype_name(name), len(DTYPE_ORDER))


def _starts_markup(word: str) -> bool:
    """Whether a line that starts with `word` would turn into markdown structure (a quote, a
    list item, a heading, a setext underline) instead of continuing a paragraph."""
    return (
        word[:1] in (">", "-", "+", "*", "#", "=", "|")
        or (word[:-1].isdigit() and word[-1:] in (".", ")"))
        or word in ("<=", "<")
    )


def _fill(words: list[str], width: int, indent: str) -> list[str]:
    """Greedy filling to `width` columns that never starts a continuation line with markup."""
    lines: list[list[str]] = [[]]
    for word in words:
        line = lines[-1]
        prefix = indent if len(lines) > 1 else ""
        if line and len(prefix + " ".join([*line, word])) > width:
            carried = []
            while _starts_markup((carried or [word])[0]) and len(line) > 1:
                carried.insert(0, line.pop())
            lines.append([*carried])
            line = lines[-1]
        line.append(word)
    return [(indent if i else "") + " ".join(line) for i, line in enumerate(lines)]


def prose(text: str, width: int = 100) -> list[str]:
    """Paragraphs and "- " bullets of `text`, each refilled to `width` columns."""
    blocks: list[list[str]] = []
    for line in text.split("\n"):
        if not line.strip():
            blocks.append([])
        elif line.startswith("- ") or not blocks or not blocks[-1]:
            blocks.append([line.strip()])
        else:
            blocks[-1].append(line.strip())
    out: list[str] = []
    for block in blocks:
        if not block:
            if out and out[-1] != "":
                out.append("")
            continue
        words = " ".join(block).split()
        out += _fill(words, width, "  " if words[0] == "-" else "")
    while out and out[-1] == "":
        out.pop()
    return out


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def paired(ratio: object, paired_ratio: object, spec: str = ".3f") -> str:
    """'1.088 (1.089)': the ratio of the medians, and the median of the per-round ratios."""
    text = num(ratio, spec)
    if isinstance(paired_ratio, int | float):
        text += f" ({paired_ratio:{spec}})"
    return text
