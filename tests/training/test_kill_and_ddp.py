"""Nothing lost, more than one process: `qkv train` killed with SIGKILL resumes to the same final
weights bit for bit, and 2 processes under torchrun (gloo) follow the 1-process loss trajectory.

Both run the real command in subprocesses, as a user would, on the tiny translate task."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from .tiny import TINY_FLAGS

COMMAND = [sys.executable, "-m", "qkv.cli", "train", "translate", *TINY_FLAGS]
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}


def _model_tensors(out_dir):
    with safe_open(str(out_dir / "checkpoint.safetensors"), framework="pt") as file:
        step = json.loads(file.metadata()["qkv"])["step"]
        tensors = {k: file.get_tensor(k) for k in file.keys() if k.startswith("model/")}  # noqa: SIM118
    return step, tensors


def _losses(out_dir):
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_a_run_killed_with_sigkill_resumes_to_the_same_final_weights(tmp_path):
    flags = ["--steps", "150", "--batch-size", "16", "--checkpoint-every", "5", "--log-every", "5"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run([*COMMAND, *flags, "--out", str(straight)], env=ENVIRONMENT, check=True,
                   capture_output=True)  # fmt: skip
    process = subprocess.Popen(
        [*COMMAND, *flags, "--out", str(killed)], env=ENVIRONMENT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (killed / "checkpoint.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # into the middle of some later step, or of writing a checkpoint
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    step_at_kill, _ = _model_tensors(killed)
    assert 0 < step_at_kill < 150
    subprocess.run([*COMMAND, *flags, "--out", str(killed), "--resume"], env=ENVIRONMENT,
                   check=True, capture_output=True)  # fmt: skip
    final_step, resumed = _model_tensors(killed)
    _, expected = _model_tensors(straight)
    assert final_step == 150
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)
    assert _losses(killed) == _losses(straight)


@pytest.mark.slow
def test_two_processes_with_torchrun_match_one_process_with_the_same_global_batch(tmp_path):
    flags = ["--steps", "12", "--batch-size", "16", "--log-every", "1", "--dropout", "0",
             "--warmup-steps", "2"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([*COMMAND, *flags, "--out", str(one)], env=ENVIRONMENT, check=True,
                   capture_output=True)  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", *COMMAND[1:]]  # fmt: skip
    result = subprocess.run([*torchrun, *flags, "--out", str(two)], env=ENVIRONMENT,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    single, double = _losses(one), _losses(two)
    assert len(single) == len(double) == 12
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained
    _, weights_one = _model_tensors(one)
    _, weights_two = _model_tensors(two)
    for name, tensor in weights_one.items():
        if not name.endswith("k_proj.bias"):  # no true gradient: see test_loop's accumulation
            torch.testing.assert_close(weights_two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
