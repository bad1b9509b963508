"""What a study leaves behind: one `StudyResult`, written as JSON, Markdown and a PNG.

The JSON is the record: the command that produced it, the seed, the size ("tiny" for tests,
"default" for the committed figures), the settings, the machine (CPU model and the ISA its
kernels use, threads, torch) and the wall time, beside the table and the raw series behind the
figure. The Markdown and the PNG are drawn from the JSON alone, so they can be redrawn without
re-running anything (`write_result` after `read_result`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.capabilities import cpu_isa

__all__ = [
    "StudyResult",
    "command_line",
    "machine",
    "markdown",
    "markdown_cell",
    "read_result",
    "write_result",
]


@dataclass
class StudyResult:
    """One run of a study.

    name: the study (`qkv study NAME`); title and claim: what it tests, in a sentence citing
    the paper; columns and rows: the table (each row a dict over columns); findings: sentences
    computed from the numbers (never written by hand); series: whatever the figure is drawn
    from (JSON-serialisable); settings, size, seed, command, machine, seconds: how to repeat it.
    """

    name: str
    title: str
    claim: str
    columns: list[str]
    rows: list[dict[str, Any]]
    findings: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    size: str = "default"
    seed: int = 0
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    files: dict[str, Path] = field(default_factory=dict, compare=False, repr=False)


def machine() -> dict[str, Any]:
    """Where a result came from: CPU model and ISA, threads, torch, Python, the time."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "arch": platform.machine(),
        "isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def command_line() -> str:
    """The command as typed: `qkv study ...` when run from the console script."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return shlex.join([program, *sys.argv[1:]])


def write_result(result: StudyResult, out: str | Path, figure=None) -> dict[str, Path]:
    """NAME.json, NAME.md (and NAME.png when `figure`, a matplotlib Figure, is given) in `out`.
    Files are written whole and renamed into place, so a killed run leaves the old ones."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{result.name}.json", "md": out / f"{result.name}.md"}
    recorded = {key: value for key, value in dataclasses.asdict(result).items() if key != "files"}
    payload = json.dumps(recorded, indent=2, default=_json_value) + "\n"
    _replace(paths["json"], payload.encode())
    if figure is not None:
        paths["png"] = out / f"{result.name}.png"
        temporary = paths["png"].with_suffix(".png.tmp")
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
        os.replace(temporary, paths["png"])
    _replace(paths["md"], markdown(result, figure="png" in paths).encode())
    return paths


def read_result(path: str | Path) -> StudyResult:
    """A StudyResult from its JSON file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(StudyResult)}
    return StudyResult(**{key: value for key, value in data.items() if key in known})


def markdown(result: StudyResult, *, figure: bool = True) -> str:
    """The result as a page: claim, table, findings, figure, and how it was made."""
    lines = [f"# {result.title}", "", result.claim, ""]
    lines += [_row(result.columns), _row(["---"] * len(result.columns))]
    lines += [
        _row([markdown_cell(row.get(column)) for column in result.columns]) for row in result.rows
    ]
    if result.findings:
        lines += ["", *[f"- {finding}" for finding in result.findings]]
    if figure:
        lines += ["", f"![{result.title}]({result.name}.png)"]
    isa = result.machine.get("isa", {}).get("aten_capability", "?")
    lines += [
        "",
        f"`{result.command}` (size {result.size}, seed {result.seed}): {result.seconds:.0f} s on "
        f"{result.machine.get('cpu_model', '?')} ({isa}, {result.machine.get('torch_threads')} "
        f"threads), torch {result.machine.get('torch', '?')}.",
        "",
    ]
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_cell(value: Any) -> str:
    """A table cell: 3 significant digits, thousands separated, '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _replace(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _cpu_model() -> str:
    """'model name' of /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
