"""The template mechanism of benchmarks/README.md: Markdown files of named parts with fields.

`templates/NAME.md` holds the text of one section, as parts that each start with a line
`<!-- part: PART -->`. `fill(NAME, PART, **values)` renders a part block by block (blocks are
separated by blank lines). Fields follow `str.format`: `{name}`, `{r[ms][qkv]:.2f}`; a figure
the result file lacks (a missing key, None, or not a finite number under a numeric format)
prints "-", so a partial file still gives a page.
- A block of table lines (starting with "|") and fields alone on their line: a field alone is
  replaced by its value as it is (lines already rendered: another part, a list); a table line
  whose fields name a list, such as `| {r[L]} | {r[ms]:.1f} |` with `r=rows`, is filled once
  per item of the list, the row of the table; an empty value or list takes its line out.
- Any other block is prose: filled, then refilled to 100 columns (the values change its
  length), unless the part is marked `<!-- part: PART verbatim -->`.
A block left empty goes with its blank line. Every field of a part must get a value and every
value must be a field of the part: a misspelt name fails the rendering instead of leaving
`{name}` on the page or a figure off it.
"""

from __future__ import annotations

import math
import re
import string
from functools import cache
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
PART = re.compile(r"^<!-- part: (\w+)( verbatim)? -->$", re.MULTILINE)
ALONE = re.compile(r"\{(\w+)\}")
NUMERIC = tuple("eEfFgGn%")  # the format types of a number
# A word that would turn a line it starts into markdown structure (a quote, a list item, a
# heading, a setext underline, a table row) instead of continuing a paragraph.
MARKUP = re.compile(r"[>+*#=|-]|\d+[.)]$|<=?$")


def get(data: object, *keys: str | int, default: object = None) -> object:
    """data[k0][k1]..., or `default` where any level is missing."""
    for key in keys:
        try:
            data = data[key]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return default
    return data


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _Formatter(string.Formatter):
    """`str.format`, where `{r[ms][qkv]}` looks its keys up leniently: "-" for a missing one."""

    def get_field(self, field_name: str, args, kwargs) -> tuple[object, str]:
        name, *keys = re.split(r"\]?\[", field_name.removesuffix("]"))
        return get(kwargs[name], *(int(k) if k.isdigit() else k for k in keys)), name

    def format_field(self, value: object, format_spec: str) -> str:
        finite = is_number(value) and math.isfinite(value)  # type: ignore[arg-type]
        if value is None or (format_spec.endswith(NUMERIC) and not finite):
            return "-"
        return format(value, format_spec)


FORMAT = _Formatter()


@cache
def parts(name: str) -> dict[str, tuple[str, bool]]:
    """{part: (its text, whether verbatim)} of templates/NAME.md."""
    pieces = PART.split((TEMPLATES / f"{name}.md").read_text(encoding="utf-8"))
    if pieces[0].strip():
        raise ValueError(f"templates/{name}.md: text before its first part")
    names, flags, texts = pieces[1::3], pieces[2::3], pieces[3::3]
    found = {part: (text.strip("\n"), bool(flag))
             for part, flag, text in zip(names, flags, texts, strict=True)}  # fmt: skip
    if len(found) != len(names):
        raise ValueError(f"templates/{name}.md: two parts of one name")
    return found


def fields(text: str) -> set[str]:
    """The names that the fields of `text` start with: {"r"} for `{r[ms][qkv]:.2f}`."""
    found = (field for _, field, _, _ in FORMAT.parse(text) if field is not None)
    return {field.split("[")[0] for field in found}


def fill(name: str, part: str, /, **values: object) -> str:
    """Part PART of templates/NAME.md, its fields filled with `values`."""
    text, verbatim = parts(name)[part]
    if fields(text) != values.keys():
        missing, unused = fields(text) - values.keys(), values.keys() - fields(text)
        raise KeyError(f"templates/{name}.md, part {part}: no value for {sorted(missing)}, "
                       f"no field for {sorted(unused)}")  # fmt: skip
    blocks = []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = block.split("\n")
        if all(line.startswith("|") or ALONE.fullmatch(line) for line in lines):
            block = "\n".join(filter(None, (_table_line(line, values) for line in lines)))
        elif verbatim:
            block = FORMAT.vformat(block, (), values)
        else:  # a paragraph and "- " items, as the template has them, each filled and refilled
            items = (FORMAT.vformat(item, (), values) for item in re.split(r"\n(?=- )", block))
            block = "\n".join(filter(None, map(wrap, items)))
        if block:
            blocks.append(block)
    return "\n\n".join(blocks)


def _table_line(line: str, values: dict[str, object]) -> str:
    """A field alone: its value; a table line: filled, once per item where a field names a list."""
    if alone := ALONE.fullmatch(line):
        return str(values[alone[1]])
    listed = [name for name in fields(line) if isinstance(values[name], list)]
    if not listed:
        return FORMAT.vformat(line, (), values)
    if len(listed) > 1:
        raise ValueError(f"a table line repeats over one list, not {listed}: {line}")
    rows = values[listed[0]]
    return "\n".join(FORMAT.vformat(line, (), {**values, listed[0]: row}) for row in rows)


def wrap(text: str, width: int = 100) -> str:
    """`text` refilled to `width` columns, as one paragraph, or as a list item (indented under
    its "- ") if it starts with one."""
    words = text.split()
    return "\n".join(_fill(words, width, "  " if words[:1] == ["-"] else "")) if words else ""


def _fill(words: list[str], width: int, indent: str) -> list[str]:
    """Greedy filling to `width` columns that never starts a continuation line with markup."""
    lines: list[list[str]] = [[]]
    for word in words:
        line = lines[-1]
        prefix = indent if len(lines) > 1 else ""
        if line and len(prefix + " ".join([*line, word])) > width:
            carried = []
            while MARKUP.match((carried or [word])[0]) and len(line) > 1:
                carried.insert(0, line.pop())
            lines.append([*carried])
            line = lines[-1]
        line.append(word)
    return [(indent if i else "") + " ".join(line) for i, line in enumerate(lines)]
