"""Compiled forwards kept on disk: torch.compile's work for an architecture is paid once per
machine, not once per process.

`compile=True` (qkv.acceleration.compiled) compiles a model's forward ahead of time; the result
(its graph, guards and bytecode: torch's AOTCompiledFunction) can be serialized. This store
writes each graph it compiles to

    $QKV_COMPILE_CACHE/<key>/<graph digest>.graph     (default ~/.cache/qkv/compiled;
                                                       QKV_COMPILE_CACHE=off: nothing stored)

and a later process decoding a model with the same key loads them instead of compiling (a few
seconds, against tens for a compile: benchmarks/decode.py reports both). Loading does not skip
any check: a loaded graph serves a call only if every one of its guards passes, as a graph
compiled in the process would. The C++ kernels a graph calls live in torch's own inductor cache
(TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_<user>); where that was cleared, loading
builds them again from the graph's source, still without tracing the model.

The key names everything a graph was compiled for that its guards do not check: qkv's source
(a changed library never loads an old graph), torch and Python versions, the CPU (its model and
the instruction set inductor targets), the thread count the kernels were generated for, and
the model (its class, its modules' names and types, config, and each parameter's and buffer's
name, shape, dtype and device). Weights are not part of it: they are inputs of the graph, not
constants.

A graph file is Python pickle data, and compile="aot"'s libraries are shared objects: loading
either runs code with the rights of the user who loads it. So a file is loaded only where the
store could not have been written by anyone else (`untrusted`): the file and every folder from
the store down to it belong to this user, and neither group nor others may write them. Another
file is refused with a warning, and its graph compiled again; so is a file that cannot be read
(written by another torch, or damaged). Folders the store creates are the user's alone (0700).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.models.safetensors_io import write_atomically

__all__ = ["LOAD_SECONDS", "GraphStore", "make_folder", "model_key", "store_directory", "untrusted"]

logger = logging.getLogger(__name__)

_OFF = ("", "0", "off", "false", "no")

# What loading a key's graphs costs, in seconds, as `compile="auto"` counts it: an upper bound
# (benchmarks/decode.py measures a load of the 55M Llama's graph at ~2-3 s, imports included).
LOAD_SECONDS = 5.0


def store_directory() -> Path | None:
    """Where compiled graphs are kept: $QKV_COMPILE_CACHE, else $XDG_CACHE_HOME/qkv/compiled,
    else ~/.cache/qkv/compiled; None when QKV_COMPILE_CACHE is "off" (or "0", "", "no")."""
    configured = os.environ.get("QKV_COMPILE_CACHE")
    if configured is not None:
        return None if configured.strip().lower() in _OFF else Path(configured).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "qkv" / "compiled"


def model_key(model: nn.Module, options: dict[str, Any]) -> str:
    """A digest of what `model`'s graphs were compiled for and their guards do not check (see
    the module doc); `options` are the inductor options they were compiled with."""
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
    """The software and CPU a graph's code was generated for (once per process)."""
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


class GraphStore:
    """The graphs compiled for each key, one file per graph, under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def load(self, key: str, f_globals: dict[str, Any]) -> list[Any]:
        """Every readable graph stored under `key` (none if there is none), deserialized with
        the forward's module globals; the seconds it took are logged at INFO."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        started = time.perf_counter()
        graphs = []
        for path in sorted(self.directory.joinpath(key).glob("*.graph")):
            refused = untrusted(path, self.directory)
            if refused is not None:
                logger.warning("compiled graph %s not loaded (compiling again): %s", path, refused)
                continue
            try:
                with _instruction_sets_known():
                    graph = AOTCompiledFunction.deserialize(path.read_bytes(), f_globals)
                graphs.append(graph)
            except Exception as error:  # another torch's file, or a damaged one
                logger.warning("compiled graph %s not loaded (compiling again): %s", path, error)
        if graphs:
            seconds = time.perf_counter() - started
            logger.info("loaded %d compiled graph(s) in %.2f s from %s", len(graphs), seconds,
                        self.directory / key)  # fmt: skip
        return graphs

    def seconds(self, key: str) -> float | None:
        """What using the graphs of `key` is expected to cost before a first step: LOAD_SECONDS
        where some are stored, else the compile measured when the last was stored (its graphs
        since removed), else None."""
        folder = self.directory / key
        if any(folder.glob("*.graph")):
            return LOAD_SECONDS
        try:
            return float((folder / "compile_seconds").read_text())
        except (OSError, ValueError):
            return None

    def save(self, key: str, graph: Any, compile_seconds: float) -> Path | None:
        """Write `graph` under `key`, with the seconds its compilation took (atomically: a
        concurrent reader sees all of a file or none of it); None, with a warning, where it
        cannot be serialized or written."""
        try:
            data = type(graph).serialize(graph).serialized_data
            folder = make_folder(self.directory / key)
            path = folder / f"{hashlib.sha256(data).hexdigest()[:16]}.graph"
            _write_atomically(path, data)
            _write_atomically(folder / "compile_seconds", f"{compile_seconds:.3f}".encode())
            return path
        except Exception as error:
            logger.warning("compiled graph not stored in %s (compiled again next time): %s",
                           self.directory, error)  # fmt: skip
            return None


def _instruction_sets_known():
    """Loading a graph's kernels, inductor first proves in each process that every vector
    instruction set of this CPU builds and loads (a compile and a dlopen in a subprocess per
    set: about a second). The key already says that a graph was built and loaded here, for
    this CPU and the instruction set torch uses (`_machine`), so the proof is skipped."""
    return torch._inductor.config.patch({"cpp.vec_isa_ok": True})


def make_folder(folder: Path) -> Path:
    """`folder`, readable and writable by this user alone (the store's files run code when
    loaded: see `untrusted`), and the folders above it that do not exist yet (by the umask)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def _write_atomically(path: Path, data: bytes) -> None:
    write_atomically(path, lambda temporary: temporary.write_bytes(data))
