"""Nothing lost, more than one process: `qkv train` killed with SIGKILL resumes to the same final
weights bit for bit, and 2 processes under torchrun (gloo) follow the 1-process loss trajectory.

Both run the real command in subprocesses, as a user would, on the tiny translate task; the
runs that do not wait on one another start side by side (`Launch`): starting a process is most
of a run's time."""

import json
import os
import signal
import sys
import time

import pytest
import torch
from safetensors import safe_open

from tests.distributed.gpt_runs import Launch

from .tiny import TINY_FLAGS

COMMAND = [sys.executable, "-m", "qkv.cli", "train", "translate", *TINY_FLAGS]


def _model_tensors(out_dir):
    with safe_open(str(out_dir / "checkpoint.safetensors"), framework="pt") as file:
        step = json.loads(file.metadata()["qkv"])["step"]
        tensors = {k: file.get_tensor(k) for k in file.keys() if k.startswith("model/")}  # noqa: SIM118
    return step, tensors


def _losses(out_dir):
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _start(arguments, out) -> Launch:
    return Launch([*arguments, "--out", str(out)], out)


def test_a_run_killed_with_sigkill_resumes_to_the_same_final_weights(tmp_path):
    steps = 60  # dropout on: the resumed run must also restore the random state
    flags = ["--steps", str(steps), "--batch-size", "16", "--checkpoint-every", "5",
             "--log-every", "5"]  # fmt: skip
    straight = _start([*COMMAND, *flags], tmp_path / "straight")
    killed = _start([*COMMAND, *flags], tmp_path / "killed")
    while (
        not (killed.out / "checkpoint.safetensors").exists() and time.monotonic() < killed.deadline
    ):
        time.sleep(0.01)
    time.sleep(0.05)  # into the middle of some later step, or of writing a checkpoint
    os.kill(killed.process.pid, signal.SIGKILL)
    assert killed.returncode() == -signal.SIGKILL, "the run ended before it could be killed"
    step_at_kill, _ = _model_tensors(killed.out)
    resumed = _start([*COMMAND, *flags, "--resume"], killed.out).wait()
    final_step, weights = _model_tensors(resumed)
    _, expected = _model_tensors(straight.wait())
    assert 0 < step_at_kill < steps
    assert final_step == steps
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
    assert _losses(resumed) == _losses(straight.out)


@pytest.mark.slow
def test_two_processes_with_torchrun_match_one_process_with_the_same_global_batch(tmp_path):
    steps = 20
    flags = ["--steps", str(steps), "--batch-size", "16", "--log-every", "1", "--dropout", "0",
             "--warmup-steps", "2"]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", *COMMAND[1:]]  # fmt: skip
    one = _start([*COMMAND, *flags], tmp_path / "one")
    two = _start([*torchrun, *flags], tmp_path / "two")
    one, two = one.wait(), two.wait()
    single, double = _losses(one), _losses(two)
    assert len(single) == len(double) == steps
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained
    _, weights_one = _model_tensors(one)
    _, weights_two = _model_tensors(two)
    for name, tensor in weights_one.items():
        if not name.endswith("k_proj.bias"):  # no true gradient: see test_loop's accumulation
            torch.testing.assert_close(weights_two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
