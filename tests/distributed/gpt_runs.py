"""Runs of `qkv train gpt` as a user starts them, on 1 process or under torchrun, for the tests
of sharded and sequence-parallel training: small documents, the command, its losses, and a
rank killed with SIGKILL after the first checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}
DEADLINE_S = 180


def write_documents(folder: Path) -> Path:
    """25 documents of the CPython documentation, one blank line between them."""
    import pydoc_data.topics

    texts = [text.strip().replace("\n\n", "\n") for text in pydoc_data.topics.topics.values()]
    path = folder / "documents.txt"
    path.write_text("\n\n".join(texts[:25]), encoding="utf-8")
    return path


def command(documents, out, flags, *, processes=1, parallel=(), extra=()) -> list[str]:
    """`qkv train gpt` on one process, or under torchrun on `processes` with `parallel` flags."""
    train = ["-m", "qkv.cli", "train", "gpt", "--data", str(documents), *flags, "--out", str(out)]
    if processes == 1:
        return [sys.executable, *train, *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes)]  # fmt: skip
    return [*launcher, *train, *parallel, *extra]


def run(arguments: list[str]) -> None:
    result = subprocess.run(arguments, env=ENVIRONMENT, capture_output=True, text=True,
                            timeout=DEADLINE_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["kind"] == "train"]


def kill_one_rank_after_a_checkpoint(arguments: list[str], out: Path) -> None:
    """Start a 2-process run and SIGKILL one of its ranks right after its first checkpoint;
    torchrun then stops the other and fails."""
    launcher = subprocess.Popen(arguments, env=ENVIRONMENT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    while not (out / "checkpoint.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.02)  # into a later step: the tests leave 25 more to come
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    pids = [int(pid) for pid in workers.stdout.split()]
    assert len(pids) == 2, f"expected 2 workers under torchrun, found {pids}"
    os.kill(pids[-1], signal.SIGKILL)
    assert launcher.wait(timeout=DEADLINE_S) != 0, "the run ended before a rank was killed"
