"""The values of the page: numbers as the tables print them, dtypes, the machine of a file.

A number that a result file lacks (or holds as something else) prints as "-" rather than
failing, so a partial file still gives a page; a machine field that a file lacks (older files
have no ISA flags) reads "not recorded". dtypes print short (fp32, bf16, fp16), in that order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .template import fill, get, is_number

NOT_RECORDED = "not recorded"
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2}


def num(value: object, spec: str, *, missing: str = "-") -> str:
    """`value` formatted with `spec` ('.3f', ',.0f', ...), or `missing` if it is not a number."""
    if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def span(values: Iterable[float], spec: str, unit: str = "") -> str:
    """'a-b' (or 'a' when both ends print alike) over `values`; '-' for none."""
    values = sorted(values)
    if not values:
        return "-"
    low, high = format(values[0], spec), format(values[-1], spec)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def paired(ratio: object, paired_ratio: object, spec: str = ".3f") -> str:
    """'1.088 (1.089)': the ratio of the medians, and the median of the per-round ratios."""
    return num(ratio, spec) + (f" ({paired_ratio:{spec}})" if is_number(paired_ratio) else "")


def listing(pairs: Iterable[tuple[object, object]], spec: str, unit: str = "", scale=1) -> str:
    """'fp32 170.0 GFLOP/s, bf16 ...': each (name, value) as the name (a dtype's short one,
    dtypes in their order) and the value over `scale`, formatted with `spec`."""
    found = sorted(((dtype_name(n), x) for n, x in pairs), key=lambda kv: dtype_rank(kv[0]))
    return ", ".join(f"{n} {num(x / scale if is_number(x) else x, spec)}{unit}" for n, x in found)


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def dtype_name(name: object) -> str:
    return DTYPE_NAMES.get(str(name), str(name))


def dtype_rank(name: object) -> int:
    return DTYPE_ORDER.get(dtype_name(name), len(DTYPE_ORDER))


# the fields of a machine record that print as the file holds them, and those of a GPU
TEXT_KEYS = (
    "cpu_model", "torch_cpu_capability", "torch", "python", "device", "git_commit", "timestamp",
    "load_average",
)  # fmt: skip
GPU_KEYS = ("device_name", "cuda", "cuda_capability")


def machine_table(files: Sequence[tuple[str, dict]]) -> str:
    """One column per result file: the machine it was measured on and the command that wrote
    it; the rows of a GPU where one of them ran on a GPU."""
    columns = [_column(data.get("machine") or {}) for _, data in files]
    cells = {key: " | ".join(column[key] for column in columns) for key in columns[0]}
    gpu = {key: cells.pop(key) for key in GPU_KEYS}
    on_gpu = any(get(data, "machine", "device") == "cuda" for _, data in files)
    return fill(
        "machine", "table", files=" | ".join(f"`results/{stem}.json`" for stem, _ in files),
        columns="---|" * len(files), gpu=fill("machine", "gpu", **gpu) if on_gpu else "", **cells,
    )  # fmt: skip


def _column(machine: dict) -> dict[str, str]:
    """The cells of one file's column, "not recorded" where the file lacks a field."""
    cells = {key: _text(machine.get(key)) for key in TEXT_KEYS + GPU_KEYS}
    command, threads = machine.get("command"), machine.get("torch_threads")
    cells["command"] = f"`{command}`" if command else NOT_RECORDED
    if threads is not None and machine.get("cpu_count") is not None:
        threads = f"{threads} (of {machine['cpu_count']} CPUs)"
    cells["torch_threads"], cells["isa_flags"] = _text(threads), _isa(machine)
    return cells


def _text(value: object) -> str:
    if value is None or value == "":
        return NOT_RECORDED
    return ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _isa(machine: dict) -> str:
    if "isa_flags" not in machine:
        return NOT_RECORDED
    if machine["isa_flags"] is None:
        return NOT_RECORDED + " (unreadable on that system)"
    if not machine["isa_flags"]:
        checked = machine.get("isa_flags_checked") or []
        return "none of " + ", ".join(checked) if checked else "none"
    return ", ".join(str(flag) for flag in machine["isa_flags"])
