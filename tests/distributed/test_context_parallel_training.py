"""`qkv train gpt --context-parallel 2` under torchrun (gloo), as a user runs it: the two
processes share every sequence through ring attention, and

- its loss trajectory equals one process's on the same global batches (fp32, 1e-5);
- a rank killed with SIGKILL brings the run down, and `--resume` on 2 processes ends on
  weights bitwise equal to the uninterrupted run's;
- its checkpoint resumes on ONE process, which ends on the weights of the 1-process run.

The blocks hold 30 tokens: 2 processes cut them in 4 zigzag chunks, so they are padded to 32.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

STEPS = 30
FLAGS = [
    "--vocab-size", "300", "--block-size", "30", "--embed-dim", "32", "--num-layers", "2",
    "--num-heads", "4", "--num-kv-heads", "2", "--family", "llama", "--ffn-dim", "64",
    "--dropout", "0", "--steps", str(STEPS), "--batch-size", "4", "--warmup-steps", "2",
    "--log-every", "1", "--checkpoint-every", "5", "--threads", "1",
]  # fmt: skip
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}
DEADLINE_S = 180


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    import pydoc_data.topics

    texts = [text.strip().replace("\n\n", "\n") for text in pydoc_data.topics.topics.values()]
    path = tmp_path_factory.mktemp("data") / "documents.txt"
    path.write_text("\n\n".join(texts[:25]), encoding="utf-8")
    return path


def _command(documents, out, *, processes=1, extra=()):
    train = ["-m", "qkv.cli", "train", "gpt", "--data", str(documents), *FLAGS, "--out", str(out)]
    if processes == 1:
        return [sys.executable, *train, *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes)]  # fmt: skip
    return [*launcher, *train, "--context-parallel", str(processes), *extra]


def _run(command):
    result = subprocess.run(command, env=ENVIRONMENT, capture_output=True, text=True,
                            timeout=DEADLINE_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def _weights(out):
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        step = json.loads(file.metadata()["qkv"])["step"]
        tensors = {k: file.get_tensor(k) for k in file.keys() if k.startswith("model/")}  # noqa: SIM118
    return step, tensors


def _losses(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["kind"] == "train"]


def _kill_one_rank_after_a_checkpoint(command, out):
    launcher = subprocess.Popen(command, env=ENVIRONMENT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    while not (out / "checkpoint.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.02)  # into a later step: 25 more steps are still to come
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    pids = [int(pid) for pid in workers.stdout.split()]
    assert len(pids) == 2, f"expected 2 workers under torchrun, found {pids}"
    os.kill(pids[-1], signal.SIGKILL)
    assert launcher.wait(timeout=DEADLINE_S) != 0, "the run ended before a rank was killed"


@pytest.mark.slow
def test_context_parallel_training_matches_one_process_and_resumes_on_any_count(
    tmp_path, documents
):
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    _run(_command(documents, one))
    _run(_command(documents, two, processes=2))
    single, double = _losses(one), _losses(two)
    assert len(single) == len(double) == STEPS
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained

    _kill_one_rank_after_a_checkpoint(_command(documents, killed, processes=2), killed)
    step_at_kill, _ = _weights(killed)
    assert 0 < step_at_kill < STEPS
    on_one = tmp_path / "on_one"
    shutil.copytree(killed, on_one)
    _run(_command(documents, killed, processes=2, extra=["--resume"]))
    (final_step, resumed), (_, expected) = _weights(killed), _weights(two)
    assert final_step == STEPS
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)

    _run(_command(documents, on_one, extra=["--resume"]))
    final_step, weights = _weights(on_one)
    _, reference = _weights(one)
    assert final_step == STEPS
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
