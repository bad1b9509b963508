"""Kill-and-resume under load (`make stress`; not part of `make test`, whose runs take minutes).

Two CPU-bound processes keep the machine busy while a training run is killed with SIGKILL at
random moments (while it starts, in the middle of a step, or of writing a checkpoint) and
resumed each time; its final checkpoint must equal, bit for bit, the one of a run never
killed, made first under the same load. The same holds for sharded (FSDP) and
context-parallel training on 2 processes, whose whole process group is killed. The kill
moments are drawn from a seeded generator over the uninterrupted run's own duration, so each
attempt gets through a share of the run before its kill, and a summary line gives the counts.

    make stress                      # QKV_STRESS_KILLS (default 20) kills per run
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.distributed.gpt_runs import Launch, command, documents

from .tiny import TINY_FLAGS

pytestmark = pytest.mark.stress

KILLS = int(os.environ.get("QKV_STRESS_KILLS", "20"))
TRANSLATE = [sys.executable, "-m", "qkv.cli", "train", "translate", *TINY_FLAGS,
             "--steps", "100", "--batch-size", "16", "--checkpoint-every", "2",
             "--log-every", "1"]  # fmt: skip
# the gpt runs of tests/distributed, longer, with a checkpoint every other step
GPT_LONGER = ["--steps", "60", "--checkpoint-every", "2"]


@contextlib.contextmanager
def busy_machine(processes: int = 2) -> Iterator[None]:
    """`processes` busy loops, one per core of a 2-core machine, for the duration."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def _checkpoint(out: Path) -> tuple[int, dict[str, torch.Tensor]]:
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        step = json.loads(file.metadata()["qkv"])["step"]
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
    return step, tensors


def _step_times(run: Launch, steps: int) -> tuple[float, float]:
    """Seconds from the run's start until it logged its first step (its start-up: imports,
    data, model) and its step `steps` (the last)."""
    started, first = time.monotonic(), None
    metrics = run.out / "metrics.jsonl"
    while True:
        assert run.process.poll() is None, run.stderr.read_text()[-3000:]
        assert time.monotonic() < run.deadline, f"step {steps} was not reached"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        done = [json.loads(line)["step"] for line in lines[:-1]]  # the last may be half written
        if done and first is None:
            first = time.monotonic() - started
        if steps in done:
            return first, time.monotonic() - started
        time.sleep(0.01)


def kill_and_resume(start: Callable[[Path, bool], Launch], steps: int, tmp_path: Path) -> dict:
    """A run never killed, then the same run killed KILLS times at random moments and resumed
    each time, then once more to its end: both end on the same checkpoint, bit for bit.
    Returns the counts (where the kills landed, the checkpoint's step after each)."""
    rng = random.Random(0)
    straight = start(tmp_path / "straight", False)
    startup, last_step = _step_times(straight, steps)
    straight.wait()
    killed_out = tmp_path / "killed"
    landed, steps = {"in start-up": 0, "after the first step": 0, "finished first": 0}, []
    for attempt in range(KILLS):
        run = start(killed_out, attempt > 0)
        # about its start-up, then a share of its steps: the kills get through ~3/4 of them
        share = rng.uniform(0, 1.5 * (last_step - startup) / KILLS)
        delay = startup * rng.uniform(0.8, 1.2) + share
        try:
            run.process.wait(timeout=delay)
            landed["finished first"] += 1
            break  # it finished before this kill: the run is done
        except subprocess.TimeoutExpired:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.wait()
        metrics = killed_out / "metrics.jsonl"
        logged = metrics.exists() and metrics.read_text().strip()
        landed["after the first step" if logged else "in start-up"] += 1
        checkpoint = killed_out / "checkpoint.safetensors"
        steps.append(_checkpoint(killed_out)[0] if checkpoint.exists() else 0)
    start(killed_out, True).wait()
    (final_step, expected), (step, got) = _checkpoint(straight.out), _checkpoint(killed_out)
    assert step == final_step
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():  # model, AdamW moments and the RNG state
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    return {"kills": len(steps), **landed, "checkpoint steps after each kill": steps}


def _translate(out: Path, resume: bool) -> Launch:
    return Launch([*TRANSLATE, "--out", str(out), *(["--resume"] if resume else [])], out)


def _gpt(tmp_path_factory, parallel: list[str]) -> Callable[[Path, bool], Launch]:
    def start(out: Path, resume: bool) -> Launch:
        extra = [*GPT_LONGER, *(["--resume"] if resume else [])]
        arguments = command(documents(tmp_path_factory), out, processes=2,
                            parallel=parallel, extra=extra)  # fmt: skip
        return Launch(arguments, out)

    return start


def test_a_training_run_killed_at_random_moments_under_load_ends_bit_for_bit(tmp_path):
    with busy_machine():
        counts = kill_and_resume(_translate, 100, tmp_path)
    print(f"\nstress, translate on 1 process: {counts}")


@pytest.mark.parametrize(
    "parallel", [["--fsdp"], ["--context-parallel", "2"]], ids=["fsdp", "context-parallel"]
)
def test_sharded_runs_killed_at_random_moments_under_load_end_bit_for_bit(
    tmp_path, tmp_path_factory, parallel
):
    with busy_machine():
        counts = kill_and_resume(_gpt(tmp_path_factory, parallel), 60, tmp_path)
    print(f"\nstress, gpt {' '.join(parallel)} on 2 processes: {counts}")
