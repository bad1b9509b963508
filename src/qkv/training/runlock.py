"""One run per folder: an exclusive lock on the run folder, and the clean-up of what killed runs
leave behind in it.

`RunLock(folder)` takes flock(2) on `.qkv-train.lock` in the folder, without waiting, and writes
its pid there; a second run into the same folder is refused with a RunFolderBusyError naming
the holder's pid. The kernel drops a flock when the process holding it ends, however it ends
(SIGKILL and the OOM killer included), so a lock left by a killed run is stale by construction:
the next run takes it, with no guess from pids or ages. The pid in the file only names the
holder in the error. The file itself is never deleted: a run that deleted it while another
waited to open it would let two runs hold locks on two files of the same name.

flock is local to one machine: on a network filesystem shared between machines, Linux maps it
to an NFS lock only where the server supports them, so two machines should not share `--out`.

Every write of a checkpoint goes through a temporary, `.checkpoint.safetensors.<32 hex>.tmp`
(`qkv.models.safetensors_io.write_atomically`), which a kill leaves behind; once the lock is held
no other run can be writing one, and `remove_temporaries` deletes those that match that exact
pattern for the files a run writes (its checkpoint and metrics, and the model it saves in its
`model` subfolder), nothing else.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from types import TracebackType

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_NAME",
    "RunFolderBusyError",
    "RunFolderInUseError",
    "RunLock",
    "check_fresh_start",
    "remove_temporaries",
]

logger = logging.getLogger(__name__)

LOCK_NAME = ".qkv-train.lock"
# write_atomically's temporaries for the files a run writes: ".<name>.<uuid4 hex>.tmp"
_TEMPORARY = re.compile(r"\.(checkpoint\.safetensors|metrics\.jsonl)\.[0-9a-f]{32}\.tmp")
# ... and those of the model the run saves in its `model` subfolder (qkv.models.save)
MODEL_FOLDER = "model"
_MODEL_TEMPORARY = re.compile(r"\.(model\.safetensors|config\.json)\.[0-9a-f]{32}\.tmp")


class RunFolderBusyError(OSError):
    """Another live process holds the run folder's lock (an OSError, as the folder is busy)."""


class RunFolderInUseError(ValueError):
    """A run starting from step 0 would overwrite what an earlier run left in its folder."""


# What a run leaves in its folder: a fresh start over any of them would destroy that run.
_RUN_FILES = ("checkpoint.safetensors", "metrics.jsonl", "summary.json", MODEL_FOLDER)


def check_fresh_start(folder: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a run from step 0 in a folder an earlier run wrote to (its checkpoint,
    metrics, summary or model would be silently replaced), unless `resume` (go on from it) or
    `overwrite` (replace it, as asked)."""
    folder = Path(folder)
    if resume or overwrite:
        return
    found = [name for name in _RUN_FILES if (folder / name).exists()]
    if found:
        raise RunFolderInUseError(
            f"out_dir: {folder} holds an earlier run ({', '.join(found)}); resume it (--resume), "
            f"replace it (--overwrite), or choose another folder"
        )


class RunLock:
    """The exclusive lock of a run folder (created if needed), held until `release` or the end
    of the `with` block, or the end of the process."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.folder.mkdir(parents=True, exist_ok=True)
        self._descriptor: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        self._held = False
        if fcntl is None:
            logger.warning("no flock on this platform: %s is not locked", self.folder)
            return
        try:
            fcntl.flock(self._descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._descriptor, 32, 0).decode(errors="replace").strip()
            self.release()
            raise RunFolderBusyError(
                f"{self.folder} is in use by another training run (pid {holder or 'unknown'}, "
                f"which holds {self.path}); wait for it to end, or choose another --out"
            ) from None
        self._held = True
        os.ftruncate(self._descriptor, 0)
        os.pwrite(self._descriptor, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Give the lock back (closing the file does); again is a no-op."""
        if self._descriptor is not None:
            if self._held:  # no pid left behind by a run that ended cleanly
                os.ftruncate(self._descriptor, 0)
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def remove_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the checkpoint and metrics temporaries that killed runs left in `folder`, and the
    saved model's in its `model` subfolder; call it only while holding the folder's RunLock.
    Returns what was deleted."""
    folder = Path(folder)
    removed = _remove_matching(folder, _TEMPORARY)
    if (folder / MODEL_FOLDER).is_dir():
        removed += _remove_matching(folder / MODEL_FOLDER, _MODEL_TEMPORARY)
    return removed


def _remove_matching(folder: Path, pattern: re.Pattern) -> list[Path]:
    removed = []
    for path in sorted(folder.iterdir()):
        if pattern.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            logger.warning("removed %s, left by a run killed while writing", path)
            removed.append(path)
    return removed
