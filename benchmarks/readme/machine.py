"""The machine a result file was measured on, as a table with one column per file.

Each benchmark script records its machine (CPU model, ISA flags, threads, torch and Python
versions, the GPU where there is one) and the command that wrote the file. A field that a file
does not hold, as in older files without ISA flags, reads "not recorded".
"""

from __future__ import annotations

from collections.abc import Sequence

from .format import NOT_RECORDED, md_table


def _isa(machine: dict) -> str:
    if "isa_flags" not in machine:
        return NOT_RECORDED
    flags = machine["isa_flags"]
    if flags is None:
        return NOT_RECORDED + " (unreadable on that system)"
    if not flags:
        checked = machine.get("isa_flags_checked") or []
        return "none of " + ", ".join(checked) if checked else "none"
    return ", ".join(str(f) for f in flags)


def _threads(machine: dict) -> str:
    threads = machine.get("torch_threads")
    if threads is None:
        return NOT_RECORDED
    cpus = machine.get("cpu_count")
    return f"{threads} (of {cpus} CPUs)" if cpus is not None else str(threads)


def _text(value: object) -> str:
    if value is None or value == "":
        return NOT_RECORDED
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def machine_fields(machine: dict) -> list[tuple[str, str]]:
    """(field, value) pairs of one file's machine record, NOT_RECORDED where a field is absent."""
    command = machine.get("command")
    fields = [
        ("command", f"`{command}`" if command else NOT_RECORDED),
        ("CPU", _text(machine.get("cpu_model"))),
        ("ISA flags", _isa(machine)),
        ("PyTorch CPU capability", _text(machine.get("torch_cpu_capability"))),
        ("threads (torch)", _threads(machine)),
        ("torch", _text(machine.get("torch"))),
        ("Python", _text(machine.get("python"))),
        ("device", _text(machine.get("device"))),
    ]
    if machine.get("device") == "cuda":
        fields += [
            ("GPU", _text(machine.get("device_name"))),
            ("CUDA", _text(machine.get("cuda"))),
            ("compute capability", _text(machine.get("cuda_capability"))),
        ]
    fields += [
        ("git commit", _text(machine.get("git_commit"))),
        ("written at (UTC)", _text(machine.get("timestamp"))),
        ("load average at start (1, 5, 15 min)", _text(machine.get("load_average"))),
    ]
    return fields


def machine_table(files: Sequence[tuple[str, dict]]) -> list[str]:
    """One column per result file: where its figures come from."""
    columns = [machine_fields(data.get("machine") or {}) for _, data in files]
    header = ["", *(f"`results/{stem}.json`" for stem, _ in files)]
    rows = [[name, *(column[i][1] for column in columns)] for i, (name, _) in enumerate(columns[0])]
    return md_table(header, rows)


def machine_summary(data: dict) -> str:
    """'AMD EPYC, 2 threads, torch 2.13.0+cpu (ISA flags not recorded)'."""
    machine = data.get("machine") or {}
    if machine.get("device") == "cuda":
        where = _text(machine.get("device_name"))
    else:
        where = _text(machine.get("cpu_model"))
    threads = machine.get("torch_threads")
    text = where + (f", {threads} threads" if threads is not None else "")
    text += f", torch {_text(machine.get('torch'))}"
    isa = _isa(machine)
    return text + (f" (ISA flags {isa})" if isa.startswith(NOT_RECORDED) else f" ({isa})")
