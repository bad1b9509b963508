"""The machine table of a section: one column per result file, the machine it ran on and the
command that wrote it; a field a file lacks (older files have no ISA flags) reads "not recorded".
"""

from __future__ import annotations

from collections.abc import Sequence

from .template import fill, get

NOT_RECORDED = "not recorded"

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
