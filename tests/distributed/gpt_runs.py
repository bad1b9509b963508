"""Runs of `qkv train gpt` as a user starts them, on 1 process or under torchrun, for the tests
of sharded and sequence-parallel training: small documents, one set of model flags, the
command, its losses, and a rank killed with SIGKILL after the first checkpoint.

Starting the processes (importing torch and qkv) is most of a run's time, so the runs start in
the background and the tests start side by side those that do not wait on one another; the
1-process run of FLAGS, which both tests compare with, runs once per pytest process
(`one_process`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}
DEADLINE_S = 900  # a guard against a hang, far above any run on a loaded 2-core machine
STEPS = 20
# a tied head (gpt2), GQA, blocks of 30 tokens (2 processes sharing a sequence cut it in 4
# zigzag chunks, so pad it to 32), two micro-batches per step
FLAGS = [
    "--vocab-size", "300", "--block-size", "30", "--embed-dim", "32", "--num-layers", "2",
    "--num-heads", "4", "--num-kv-heads", "2", "--family", "gpt2", "--ffn-dim", "64",
    "--dropout", "0", "--steps", str(STEPS), "--batch-size", "4", "--accumulation-steps", "2",
    "--warmup-steps", "2", "--log-every", "1", "--checkpoint-every", "5", "--threads", "1",
]  # fmt: skip

_SHARED: dict[str, object] = {}  # what the tests of one pytest process share


def write_documents(folder: Path) -> Path:
    """25 documents of the CPython documentation, one blank line between them."""
    import pydoc_data.topics

    texts = [text.strip().replace("\n\n", "\n") for text in pydoc_data.topics.topics.values()]
    path = folder / "documents.txt"
    path.write_text("\n\n".join(texts[:25]), encoding="utf-8")
    return path


def documents(tmp_path_factory) -> Path:
    """The documents every run reads, written once per pytest process."""
    if "documents" not in _SHARED:
        _SHARED["documents"] = write_documents(tmp_path_factory.mktemp("documents"))
    return _SHARED["documents"]


def command(documents, out, *, processes=1, parallel=(), extra=()) -> list[str]:
    """`qkv train gpt` with FLAGS on one process, or under torchrun on `processes` with the
    `parallel` flags."""
    train = ["-m", "qkv.cli", "train", "gpt", "--data", str(documents), *FLAGS, "--out", str(out)]
    if processes == 1:
        return [sys.executable, *train, *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes)]  # fmt: skip
    return [*launcher, *train, *parallel, *extra]


class Launch:
    """A run started in the background; `wait` fails with its stderr unless it succeeds."""

    def __init__(self, arguments: list[str], out: Path):
        self.out, self.stderr = out, out.with_name(f"{out.name}.stderr")
        with open(self.stderr, "w") as stderr:  # a file: a full pipe would stall the run
            self.process = subprocess.Popen(
                arguments, env=ENVIRONMENT, stdout=subprocess.DEVNULL, stderr=stderr,
                start_new_session=True,  # its own group: a timeout stops torchrun's workers too
            )  # fmt: skip
        self.deadline = time.monotonic() + DEADLINE_S

    def returncode(self) -> int:
        try:
            return self.process.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise AssertionError(f"{self.out.name}: no end within {DEADLINE_S} s") from None

    def wait(self) -> Path:
        """The run's folder, once it has ended well."""
        assert self.returncode() == 0, self.stderr.read_text()[-3000:]
        return self.out


def one_process(tmp_path_factory) -> Launch:
    """The 1-process run of FLAGS: started by the first test that asks, shared by all."""
    if "one" not in _SHARED:
        out = tmp_path_factory.mktemp("runs") / "one"
        _SHARED["one"] = Launch(command(documents(tmp_path_factory), out), out)
    return _SHARED["one"]


def losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["kind"] == "train"]


def kill_one_rank_after_a_checkpoint(run: Launch) -> None:
    """SIGKILL one of the 2 ranks of a torchrun run right after its first checkpoint; torchrun
    then stops the other and fails."""
    while not (run.out / "checkpoint.safetensors").exists() and time.monotonic() < run.deadline:
        time.sleep(0.01)
    time.sleep(0.02)  # into a later step: the tests leave 15 more to come
    workers = subprocess.run(["pgrep", "-P", str(run.process.pid)], capture_output=True, text=True)
    pids = [int(pid) for pid in workers.stdout.split()]
    assert len(pids) == 2, f"expected 2 workers under torchrun, found {pids}"
    os.kill(pids[-1], signal.SIGKILL)
    assert run.returncode() != 0, "the run ended before a rank was killed"
