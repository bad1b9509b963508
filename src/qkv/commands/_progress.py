"""A one-line progress bar on stderr, shared by the sub-commands."""

from __future__ import annotations

import sys


def progress_bar(done: int, total: int, width: int = 30, label: str = "embedding") -> None:
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    print(
        f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
        end=end,
        file=sys.stderr,
        flush=True,
    )
