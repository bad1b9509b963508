"""Compiled decoding steps kept on disk: AOTInductor's work for an architecture is paid once
per machine, not once per process.

The step compiled ahead of time (qkv.acceleration.exported) is a library, stored as

    $QKV_COMPILE_CACHE/<key>/exported-b<B>-<ids dtype>-<positions dtype>.pt2
                          (default ~/.cache/qkv/compiled; QKV_COMPILE_CACHE=off: nothing stored)

and a later process decoding a model with the same key loads it instead of compiling (well
under a second, against tens for a compile: benchmarks/decode.py reports both).

The key names everything a library was compiled for: qkv's source
(a changed qkv never loads an old library), torch and Python versions, the CPU (its model and
the instruction set inductor targets), the thread count the kernels were generated for, and
the model (its class, its modules' names and types, config, and each parameter's and buffer's
name, shape, dtype and device). Weights are not part of it: the library reads the model's own
tensors.

A library is a shared object: loading it runs code with the rights of the user who loads it.
So a file is loaded only where the store could not have been written by anyone else
(`untrusted`): the file and every folder from the store down to it belong to this user, and
neither group nor others may write them. Another file is refused with a warning, and the step
compiled again; so is a file that cannot be read (written by another torch, or damaged).
Folders the store creates are the user's alone (0700).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["make_folder", "model_key", "store_directory", "untrusted"]

logger = logging.getLogger(__name__)

_OFF = ("", "0", "off", "false", "no")


def store_directory() -> Path | None:
    """Where compiled steps are kept: $QKV_COMPILE_CACHE, else $XDG_CACHE_HOME/qkv/compiled,
    else ~/.cache/qkv/compiled; None when QKV_COMPILE_CACHE is "off" (or "0", "", "no")."""
    configured = os.environ.get("QKV_COMPILE_CACHE")
    if configured is not None:
        return None if configured.strip().lower() in _OFF else Path(configured).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "qkv" / "compiled"


def model_key(model: nn.Module, options: dict[str, Any]) -> str:
    """A digest of what `model`'s libraries were compiled for (see the module doc); `options`
    are the inductor options they were compiled with."""
    tensors = [
        (name, list(t.shape), str(t.dtype), str(t.device))
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    described = {
        "machine": _machine(),
        "threads": torch.get_num_threads(),
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        # names and types, not repr(): a module's repr may tell its state (packed yet or not)
        "modules": [
            (name, f"{type(m).__module__}.{type(m).__qualname__}")
            for name, m in model.named_modules()
        ],  # fmt: skip
        "config": repr(getattr(model, "config", None)),
        "tensors": tensors,
        "options": sorted(options.items()),
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _machine() -> dict[str, str]:
    """The software and CPU a library's code was generated for (once per process)."""
    return {
        "qkv source": _source_digest(),
        "torch": torch.__version__,
        "python": sys.version,
        "cpu": _cpu_model(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "arch": platform.machine(),
    }


def _source_digest() -> str:
    """sha256 over every .py file of the qkv package, by relative path and content."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def untrusted(path: Path, store: Path) -> str | None:
    """Why the store's file `path` must not be loaded, or None: the file and each folder from
    `store` down to it must belong to this user and be writable by no one else (a file planted
    by another user would run as this one). Links are judged as themselves, not followed.
    Where the OS has no owners and modes (Windows: its ACLs), nothing is refused."""
    if not hasattr(os, "getuid"):
        return None
    uid, path, store = os.getuid(), Path(path), Path(store)
    try:
        chain = [path, *[folder for folder in path.parents if folder.is_relative_to(store)]]
        for item in chain:
            status = item.lstat()
            if status.st_uid != uid:
                return f"{item} belongs to user id {status.st_uid}, not to this user ({uid})"
            if status.st_mode & 0o022:
                mode = f"{status.st_mode & 0o777:o}"
                return f"{item} can be written by its group or others (mode {mode})"
    except OSError as error:
        return f"{path} cannot be checked: {error}"
    return None


def make_folder(folder: Path) -> Path:
    """`folder`, readable and writable by this user alone (the store's files run code when
    loaded: see `untrusted`), and the folders above it that do not exist yet (by the umask)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder
