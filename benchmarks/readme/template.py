"""The template mechanism of benchmarks/README.md: Markdown files of named parts with fields.

`templates/NAME.md` holds the text of one section, as parts that each start with a line
`<!-- part: PART -->`. `fill(NAME, PART, **values)` renders a part block by block (blocks are
separated by blank lines). Fields follow `str.format`, looked up leniently:
- `{d[pattern][window]}`: a key the value lacks (or None) prints "-", as does anything but a
  finite number under a numeric format, so a partial result file still gives a page;
- `{r[fwd_s]:.1f/ms}`: a unit after the format divides by it first (s -> ms, bytes -> MiB, ...);
- `{r[dtype]!d}`: a dtype's short name (fp32, bf16); `{d[labels]!l}`: the length of a list,
  `!x` its extent ("18-32"); True and False print yes and no.
A line or "- " item whose field walks through a list (`| {r[L]} | {r[ms][qkv]:.2f} |` with `r` a
list of rows, or `{d[rows][dtype]}`; `{d[verdicts][*]}` is the item itself) is repeated once per
item of the list, a table's rows; an empty list takes it out, as does an empty value alone on its
line. Table lines, headings and fields alone are kept as they are; any other block is prose,
refilled to 100 columns once filled unless the part is marked `<!-- part: PART verbatim -->`.
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
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
UNITS = {"ms": 1e-3, "us": 1e-6, "M": 1e6, "G": 1e9, "MiB": 2**20, "GiB": 2**30}
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


def _path(field: str) -> list[str | int]:
    """`r[ms][qkv]` -> ["r", "ms", "qkv"]."""
    return [int(k) if k.isdigit() else k for k in re.split(r"\]?\[", field.removesuffix("]"))]


class _Formatter(string.Formatter):
    """`str.format` with lenient lookups, units and list conversions; `item` stands for the list
    at `prefix` while a repeated line is filled."""

    prefix: tuple = ()
    item: object = None

    def get_field(self, field_name: str, args, kwargs) -> tuple[object, str]:
        name, *keys = path = _path(field_name)
        if name not in kwargs:
            raise KeyError(f"no value for field {name!r}")
        n = len(self.prefix)
        if self.prefix and tuple(path[:n]) == self.prefix:
            return get(self.item, *(key for key in path[n:] if key != "*")), name
        return get(kwargs[name], *keys), name

    def convert_field(self, value: object, conversion: str | None) -> object:
        if conversion is None or value is None:
            return value
        items = value if isinstance(value, list) else []
        if conversion == "d":
            return DTYPES.get(str(value), value)
        if conversion == "l":
            return len(items)
        if conversion == "x":
            low, high = (f"{x:g}" for x in (min(items), max(items))) if items else ("-", "-")
            return low if low == high else f"{low}-{high}"
        return super().convert_field(value, conversion)

    def format_field(self, value: object, format_spec: str) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        format_spec, _, unit = format_spec.partition("/")
        finite = is_number(value) and math.isfinite(value)  # type: ignore[arg-type]
        if value is None or (format_spec.endswith(NUMERIC) and not finite):
            return "-"
        if unit:
            value = value / UNITS[unit]  # type: ignore[operator]
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


def fields(text: str) -> list[str]:
    """The fields of `text`, as written: ["r[ms][qkv]"] for `{r[ms][qkv]:.2f}`."""
    return [field for _, field, _, _ in FORMAT.parse(text) if field is not None]


def fill(name: str, part: str, /, **values: object) -> str:
    """Part PART of templates/NAME.md, its fields filled with `values`."""
    text, verbatim = parts(name)[part]
    try:
        return "\n\n".join(filter(None, (_block(b, values, verbatim) for b in
                                         re.split(r"\n[ \t]*\n", text))))  # fmt: skip
    except KeyError as error:
        raise KeyError(f"templates/{name}.md, part {part}: {error.args[0]}") from None


def _block(block: str, values: dict[str, object], verbatim: bool) -> str:
    """One block: table lines and fields alone kept as lines, prose items filled and refilled."""
    lines = block.split("\n")
    if all(line.startswith(("|", "#")) or ALONE.fullmatch(line) for line in lines):
        return "\n".join(x for line in lines for x in _repeated(line, values) if x)
    if verbatim:
        return "\n".join(x for line in lines for x in _repeated(line, values))
    items = re.split(r"\n(?=- )", block)
    return "\n".join(filter(None, (wrap(x) for item in items for x in _repeated(item, values))))


def _repeated(text: str, values: dict[str, object]) -> list[str]:
    """`text` filled once, or once per item of the one list its fields walk through."""
    lists = {prefix for field in fields(text) if (prefix := _list_prefix(_path(field), values))}
    if len(lists) > 1:
        raise ValueError(f"a line repeats over one list, not {sorted(lists)}: {text}")
    if not lists:
        return [FORMAT.vformat(text, (), values)]
    FORMAT.prefix = prefix = lists.pop()
    try:
        found = []
        items = get(values, *prefix)
        for FORMAT.item in items if isinstance(items, list) else []:
            found.append(FORMAT.vformat(text, (), values))
        return found
    finally:
        FORMAT.prefix, FORMAT.item = (), None


def _list_prefix(path: list[str | int], values: dict[str, object]) -> tuple | None:
    """The leading keys of `path` that reach a list which a further key looks into by name, or
    the keys before a `*` (what they reach is a list, or nothing to repeat over)."""
    value = values.get(path[0])  # type: ignore[call-overload]
    for n, key in enumerate(path[1:], start=1):
        if (isinstance(value, list) and isinstance(key, str)) or key == "*":
            return tuple(path[:n])
        value = get(value, key)
    return None


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
