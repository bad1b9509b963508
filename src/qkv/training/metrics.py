"""metrics.jsonl: one JSON record a line, appended as a run goes, cut back when it resumes.

A record is appended with write(2) on a file opened O_APPEND; if that fails (ENOSPC on a full
disk, EFBIG past a file-size limit) the file is cut back to its length before the write, so a
failed write leaves no half line, and the error names the file. A run killed in the middle of
a write, or a machine that lost power, can still leave one: on resume a last line that does not
parse is dropped with a logged warning naming the file, and so are blank lines (and a tail of
NUL bytes, which some filesystems leave after a crash). A line before the last that does not
parse is an error naming the file and the line, as dropping it would lose a record silently.
The file is then rewritten with the records up to the checkpoint's step, atomically.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from qkv.models.safetensors_io import write_atomically
from qkv.training.distributed import Distributed

__all__ = [
    "METRICS_NAME",
    "MetricsFileError",
    "RunLogger",
    "Throughput",
    "append_record",
    "kept_lines",
]

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


class MetricsFileError(ValueError):
    """metrics.jsonl has a line before its last that is not a record."""


def kept_lines(path: Path, up_to_step: int) -> list[str]:
    """The lines of the records of steps <= up_to_step, a torn last line and blank lines left
    out (with a warning); MetricsFileError for a damaged line before the last."""
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    if lines[-1] == "":  # the newline that ends the last record
        lines.pop()
    filled = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    if len(filled) < len(lines):
        logger.warning("%s: ignored %d blank line(s)", path, len(lines) - len(filled))
    kept = []
    for position, (number, line) in enumerate(filled):
        step = _step_of(line)
        if step is None and position == len(filled) - 1:
            logger.warning(
                "%s: dropped line %d, cut short by a run that stopped while writing it: %r",
                path, number, line[:80],
            )  # fmt: skip
            break
        if step is None:
            raise MetricsFileError(
                f"{path}, line {number}: {line[:80]!r} is not a metrics record; expected one "
                f'JSON object with an integer "step" a line. Fix or delete that line, then '
                f"resume again"
            )
        if step <= up_to_step:
            kept.append(line)
    return kept


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def append_record(path: Path, record: dict) -> None:
    """Add one line to `path`: all of it, or (OSError naming the file) none of it."""
    data = (json.dumps(record) + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(descriptor).st_size
        try:
            while data:  # write(2) may take part of it, then fail on the rest
                data = data[os.write(descriptor, data) :]
        except OSError as error:
            os.ftruncate(descriptor, size)  # cutting frees space: it works on a full disk
            raise _write_error(error, path, f"the record of step {record.get('step')}") from error
    finally:
        os.close(descriptor)


def _rewrite(path: Path, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    try:
        write_atomically(path, lambda temporary: temporary.write_text(text))
    except OSError as error:
        raise _write_error(error, path, f"{len(lines)} records") from error


def _write_error(error: OSError, path: Path, what: str) -> OSError:
    reason = error.strerror or str(error)
    message = (
        f"{path}: could not write {what} ({reason}); the file keeps whole records only. Make "
        f"room, then resume the run"
    )
    return OSError(error.errno, message) if error.errno else OSError(message)


class RunLogger:
    """Records to metrics.jsonl (main process), to TensorBoard where it is installed, and to
    on_log. On resume, records after the checkpoint's step are dropped from the file: the
    resumed run writes them again."""

    def __init__(
        self,
        out_dir: Path,
        context: Distributed,
        on_log: Callable[[dict], None] | None,
        *,
        keep_up_to: int,
    ) -> None:
        self.path, self.context, self.on_log = out_dir / METRICS_NAME, context, on_log
        self.board = None
        if context.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            resumed = keep_up_to and self.path.is_file()
            _rewrite(self.path, kept_lines(self.path, keep_up_to) if resumed else [])
            self.board = _tensorboard(out_dir / "tensorboard")

    def write(self, record: dict) -> None:
        if not self.context.is_main:
            return
        append_record(self.path, record)
        if self.board is not None:
            for name, value in record.items():
                if name not in ("step", "kind"):
                    self.board.add_scalar(f"{record['kind']}/{name}", value, record["step"])
            self.board.flush()
        if self.on_log is not None:
            self.on_log(record)


def _tensorboard(folder: Path):
    """A SummaryWriter when the tensorboard package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(folder))


class Throughput:
    """Tokens per second since the last read."""

    def __init__(self) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> dict[str, float]:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.tokens, self.start = 0, now
        return {"tokens_per_s": rate}
