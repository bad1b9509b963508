"""Progress on stderr, shared by the sub-commands: a tqdm bar on a terminal, plain lines elsewhere.

A bar redraws itself with carriage returns, which a pipe or a log file keeps as one long line.
So when stderr is not a terminal, `progress` returns a `LineProgress`: a whole line (done/total,
percentage, elapsed < remaining, rate) at each tenth of the work and at least every 30 seconds,
and never a '\\r'. Library code reports through callbacks and logging; the helpers here turn
those into progress: `ProgressCallback` for `progress(done, total)` callbacks, `log_lines` for
the log records of a stage without a count (data preparation), `log_stages` for one record per
step of a known number of steps (the sections of a report).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Protocol

from tqdm import tqdm

# e.g. "training: step 30/300 (10%) [00:04<00:36, 7.50step/s, loss 3.2100]"
LINE_FORMAT = (
    "{desc}: {unit} {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, "
    "{rate_fmt}{postfix}]"
)
LINE_FORMAT_NO_TOTAL = "{desc}: {unit} {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class Progress(Protocol):
    """What the sub-commands use of a progress bar: tqdm's names, so a tqdm bar is one."""

    n: int

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """Progress as whole lines, for a stderr that is not a terminal (see the module docstring)."""

    def __init__(
        self,
        total: int | None,
        *,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        elapsed: float = 0.0,
        file: IO[str] | None = None,
        every_fraction: float = 0.1,
        every_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total: expected None or an int >= 0, got {total}")
        if not 0 < every_fraction <= 1:
            raise ValueError(f"every_fraction: expected a number in (0, 1], got {every_fraction}")
        self.total, self.desc, self.unit, self.initial = total, desc, unit, initial
        self.file = sys.stderr if file is None else file
        self.every_fraction, self.every_seconds, self.clock = every_fraction, every_seconds, clock
        self.n = self.shown_n = initial
        self.lines = 0
        self.postfix = ""
        self.shown_at = clock()
        self.started = self.shown_at - elapsed
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._due(self.clock()):
            self._show()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s  # shown with the next line: a line of its own would be noise

    def close(self) -> None:
        """The last line, if the count moved since the one before (or none was printed)."""
        if not self.closed and (self.n != self.shown_n or (self.lines == 0 and self.n > 0)):
            self._show()
        self.closed = True

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def line(self) -> str:
        """The line for the current state, as `update` and `close` print it."""
        line = tqdm.format_meter(
            self.n, self.total, self.clock() - self.started, prefix=self.desc, unit=self.unit,
            postfix=self.postfix or None, initial=self.initial,
            bar_format=LINE_FORMAT if self.total else LINE_FORMAT_NO_TOTAL,
        )  # fmt: skip
        return re.sub(r", +", ", ", line)  # tqdm pads the rate to a fixed width for its bar

    def _due(self, now: float) -> bool:
        if self.total and self.n != self.shown_n:  # a line at each tenth (every_fraction) crossed
            step = self.every_fraction * self.total
            if self.n >= self.total or int(self.n / step) > int(self.shown_n / step):
                return True
        return now - self.shown_at >= self.every_seconds

    def _show(self) -> None:
        print(self.line(), file=self.file, flush=True)
        self.shown_n, self.shown_at = self.n, self.clock()
        self.lines += 1


def progress(
    total: int | None,
    *,
    desc: str,
    unit: str = "it",
    initial: int = 0,
    elapsed: float = 0.0,
    file: IO[str] | None = None,
) -> Progress:
    """A tqdm bar when `file` (default stderr) is a terminal, else a `LineProgress`.

    initial: the count already done; elapsed: the seconds the work has run before the bar was
    made (for a bar made at the first report of progress, which would else see no time pass).
    """
    file = sys.stderr if file is None else file
    if not _is_terminal(file):
        return LineProgress(
            total, desc=desc, unit=unit, initial=initial, elapsed=elapsed, file=file
        )
    bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, file=file, dynamic_ncols=True)
    bar.start_t -= elapsed  # tqdm's clocks of the rate and of its smoothing
    bar.last_print_t -= elapsed
    return bar


def say(text: str, file: IO[str] | None = None) -> None:
    """Print a line on stderr without breaking a tqdm bar that is being drawn there."""
    tqdm.write(text, file=sys.stderr if file is None else file)


class ProgressCallback:
    """A `progress(done, total)` callback (as `qkv.applications.embed.embed` takes) drawing one bar;
    use it as a context manager so the bar is closed. The bar is made at the first call, with
    that call's count done: the rate and the ETA count from there, since when the work began
    (after loading a model, say) is not known."""

    def __init__(self, *, desc: str, unit: str = "it", file: IO[str] | None = None) -> None:
        self.desc, self.unit, self.file = desc, unit, file
        self.bar: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress(total, desc=self.desc, unit=self.unit, initial=done, file=self.file)
        else:
            self.bar.update(done - self.bar.n)

    def __enter__(self) -> ProgressCallback:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def log_lines(logger_name: str, *, prefix: str = "", file: IO[str] | None = None) -> Iterator[None]:
    """Show the INFO (and louder) records of `logger_name` as lines, with the seconds since
    the block began: the stages of work that has no count to draw a bar from."""
    started = time.perf_counter()

    def show(record: logging.LogRecord) -> None:
        say(f"{prefix}{time.perf_counter() - started:6.1f}s  {record.getMessage()}", file)

    with _handler(logger_name, show):
        yield


@contextmanager
def log_stages(
    logger_name: str, total: int, *, desc: str, unit: str = "it", file: IO[str] | None = None
) -> Iterator[Progress]:
    """A bar of `total` steps, where each INFO record of `logger_name` says that the next step
    begins (its message is shown beside the bar); the block's end completes the last one."""
    bar = progress(total, desc=desc, unit=unit, file=file)
    begun = 0

    def show(record: logging.LogRecord) -> None:
        nonlocal begun
        # the line of a step done names the one that begins ("report: building the cost ...")
        bar.set_postfix_str(record.getMessage().removeprefix(f"{desc}: "), refresh=not begun)
        if begun:
            bar.update(1)
        begun += 1

    try:
        with _handler(logger_name, show):
            yield bar
        bar.update(max(0, min(begun, total) - bar.n))
    finally:
        bar.close()


class _CallbackHandler(logging.Handler):
    def __init__(self, callback: Callable[[logging.LogRecord], None]) -> None:
        super().__init__(logging.INFO)
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        self.callback(record)


@contextmanager
def _handler(logger_name: str, callback: Callable[[logging.LogRecord], None]) -> Iterator[None]:
    """`callback(record)` for the logger's INFO records while the block runs; the logger is
    lowered to INFO for that time (its default, WARNING, would drop them), then restored."""
    logger = logging.getLogger(logger_name)
    handler, level = _CallbackHandler(callback), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _is_terminal(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False
