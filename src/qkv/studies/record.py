"""What a study leaves behind: one `StudyResult`, written as JSON, Markdown and a PNG.

The JSON is the record: the command that produced it, the seed, the size ("tiny" for tests,
"default" for the committed figures), the settings, the machine (CPU model and the ISA its
kernels use, threads, torch) and the wall time, beside the table and the raw series behind the
figure. The Markdown and the PNG are drawn from the JSON alone, so they can be redrawn without
re-running anything (`write_result` after `read_result`).

A result also states its verdict on the claim: one `Verdict` per part of it ("supported", "not
supported" or "mixed"), each computed from the table rows by a rule said in one sentence, and
the verdict on the whole (`overall`). Where that is not "supported", or where a part of the
claim is left unjudged, the first finding says so and why (`judge`).
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
from typing import Any, Literal

import torch

from qkv.capabilities import cpu_isa

__all__ = [
    "OVERALL_RULE",
    "StudyResult",
    "Verdict",
    "beyond_noise",
    "command_line",
    "grade",
    "judge",
    "machine",
    "markdown",
    "markdown_cell",
    "overall",
    "read_result",
    "write_result",
]

VERDICTS = ("supported", "not supported", "mixed")
OVERALL_RULE = "supported where every part is, not supported where none is, mixed otherwise"
FINDING = "Verdict: "  # how the finding that `judge` writes begins


@dataclass
class Verdict:
    """The verdict on one part of a study's claim, computed from the study's table rows.

    claim: the part, in a few words; verdict: "supported", "not supported" or "mixed"; rule: the
    one sentence that turns the figures into the verdict; evidence: the figures that decided it;
    why: where the verdict is not "supported", what about the study (model size, data, steps)
    may make it disagree with the literature (required there).
    """

    claim: str
    verdict: Literal["supported", "not supported", "mixed"]
    rule: str
    evidence: str
    why: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict: expected one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict != "supported" and not self.why:
            raise ValueError(f"why: a {self.verdict!r} verdict says why it may disagree")


def grade(passed: int, total: int) -> str:
    """Supported when all `total` cases pass, not supported when none does, else mixed."""
    return "supported" if passed == total else "not supported" if passed == 0 else "mixed"


def beyond_noise(gap: float, noise: float) -> str:
    """Supported when the expected difference `gap` exceeds `noise` (a spread over seeds), not
    supported when it is below -noise (the opposite, as clearly), else mixed."""
    return "supported" if gap > noise else "not supported" if gap < -noise else "mixed"


def overall(verdicts: list[Verdict]) -> str | None:
    """The verdict on the whole claim (OVERALL_RULE), None when no part is judged."""
    if not verdicts:
        return None
    kinds = {v.verdict for v in verdicts}
    return kinds.pop() if len(kinds) == 1 else "mixed"


@dataclass
class StudyResult:
    """One run of a study.

    name: the study (`qkv study NAME`); title and claim: what it tests, in a sentence citing
    the paper; columns and rows: the table (each row a dict over columns); findings: sentences
    computed from the numbers (never written by hand); series: whatever the figure is drawn
    from (JSON-serialisable); settings, size, seed, command, machine, seconds: how to repeat it;
    verdicts: the verdict on each part of the claim, unjudged: the parts left out of them, each
    with the reason (`judge` sets both).
    """

    @property
    def verdict(self) -> str | None:
        """The verdict on the whole claim: OVERALL_RULE over `verdicts`."""
        return overall(self.verdicts)

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
    verdicts: list[Verdict] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)
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


def judge(result: StudyResult, verdicts: list[Verdict], unjudged: list[str] = ()) -> None:
    """Set the result's verdicts and unjudged parts, and its first finding from them: where the
    whole is not "supported" or a part is unjudged, a finding beginning "Verdict: " says which
    parts and why (a previous such finding is replaced, so judging again changes nothing)."""
    result.verdicts, result.unjudged = list(verdicts), list(unjudged)
    findings = [finding for finding in result.findings if not finding.startswith(FINDING)]
    note = []
    failed = [v for v in result.verdicts if v.verdict != "supported"]
    if failed:
        note.append(f"{result.verdict}, against what the claim expects: " + "; ".join(
            f"{v.claim}: {v.verdict} ({v.evidence})" for v in failed) + ".")  # fmt: skip
        whys = list(dict.fromkeys(v.why for v in failed))
        note.append("It may disagree with the literature because " + " ".join(whys))
    elif result.verdicts and result.unjudged:
        note.append(f"{result.verdict} on the parts of the claim it measures.")
    note += [f"Not judged: {part}" for part in result.unjudged]
    result.findings = [FINDING + " ".join(note), *findings] if note else findings


def write_result(
    result: StudyResult, out: str | Path, figure=None, *, keep_figure: bool = False
) -> dict[str, Path]:
    """NAME.json, NAME.md (and NAME.png when `figure`, a matplotlib Figure, is given) in `out`.
    keep_figure: link the NAME.png already in `out` (a result redrawn from its JSON).
    Files are written whole and renamed into place, so a killed run leaves the old ones."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{result.name}.json", "md": out / f"{result.name}.md"}
    payload = json.dumps(_recorded(result), indent=2, default=_json_value) + "\n"
    _replace(paths["json"], payload.encode())
    if figure is None and keep_figure and (out / f"{result.name}.png").is_file():
        paths["png"] = out / f"{result.name}.png"
    if figure is not None:
        paths["png"] = out / f"{result.name}.png"
        temporary = paths["png"].with_suffix(".png.tmp")
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
        os.replace(temporary, paths["png"])
    _replace(paths["md"], markdown(result, figure="png" in paths).encode())
    return paths


def _recorded(result: StudyResult) -> dict[str, Any]:
    """The JSON record: the fields in order, the verdicts after the claim (where judged)."""
    fields = {key: value for key, value in dataclasses.asdict(result).items() if key != "files"}
    verdicts, unjudged = fields.pop("verdicts"), fields.pop("unjudged")
    recorded = {}
    for key, value in fields.items():
        recorded[key] = value
        if key == "claim" and verdicts:
            recorded.update(verdict=result.verdict, verdicts=verdicts)
        if key == "claim" and unjudged:
            recorded["unjudged"] = unjudged
    return recorded


def read_result(path: str | Path) -> StudyResult:
    """A StudyResult from its JSON file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(StudyResult)}
    result = StudyResult(**{key: value for key, value in data.items() if key in known})
    result.verdicts = [Verdict(**verdict) for verdict in result.verdicts]
    return result


def markdown(result: StudyResult, *, figure: bool = True) -> str:
    """The result as a page: claim, verdict, table, findings, figure, and how it was made."""
    lines = [f"# {result.title}", "", result.claim, ""]
    if result.verdicts:
        lines += [f"## Verdict: {result.verdict}", "", f"The whole: {OVERALL_RULE}.", ""]
        lines += [f"- {v.claim}: **{v.verdict}**. Rule: {v.rule} Figures: {v.evidence}."
                  for v in result.verdicts]  # fmt: skip
        lines += [f"- Not judged: {part}" for part in result.unjudged] + [""]
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
