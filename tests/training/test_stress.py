"""Kill-and-resume under load (`make stress`; not part of `make test`, whose runs take minutes).

Two CPU-bound processes keep the machine busy while a training run is killed with SIGKILL at
random moments (while it starts, in the middle of a step, or of writing a checkpoint) and
resumed each time; its final checkpoint must equal, bit for bit, the one of a run never
killed, made first under the same load. The same holds for sharded (FSDP) and
context-parallel training on 2 processes, whose whole process tree is killed. Every fifth
kill lands in the start-up, the others during the steps; the moments are drawn from a seeded
generator, in units of the uninterrupted run's own start-up and step times (`_kill_moment`),
and a summary line gives the counts.

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
GPT_LONGER = ["--steps", "100", "--checkpoint-every", "2"]


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


def _logged_steps(out: Path) -> list[int]:
    """The steps in out's metrics.jsonl so far (the last line may be half written: left out)."""
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines[:-1]]


def _wait_for_step(run: Launch, after: int) -> bool:
    """Wait until the run logs a step past `after`; False if it ended first."""
    while not any(step > after for step in _logged_steps(run.out)):
        if run.process.poll() is not None:
            return False
        assert time.monotonic() < run.deadline, f"no step after {after}"
        time.sleep(0.005)
    return True


def _seconds_per_step(run: Launch, steps: int) -> tuple[float, float]:
    """The run's start-up (seconds until its first step) and then its seconds per step."""
    started = time.monotonic()
    assert _wait_for_step(run, 0), run.stderr.read_text()[-3000:]
    first = time.monotonic()
    assert _wait_for_step(run, steps - 1), run.stderr.read_text()[-3000:]
    return first - started, (time.monotonic() - first) / (steps - 1)


def _kill_moment(
    run: Launch, at: int, startup: float, step: float, rng: random.Random, *, early: bool
) -> str:
    """Sleep until a random moment of the run, SIGKILL its process tree; where it landed.
    `early`: in the start-up (imports, the checkpoint's load); else after the run's first new
    step, within the next 6 steps' time (checkpoints every 2)."""
    if early:
        time.sleep(rng.uniform(0.1, 0.9) * startup)
        where = "in start-up"
    else:
        if not _wait_for_step(run, at):
            return "finished first"
        time.sleep(rng.uniform(0, 6 * step))
        where = "during the steps"
    if run.process.poll() is not None:
        return "finished first"
    _kill_all(run)
    return where


def _kill_all(run: Launch) -> None:
    """SIGKILL the run's process and every process under it (torchrun's workers are out of
    reach of its process group: they call setsid), and wait until all are gone."""
    pids, found = [], [run.process.pid]
    while found:  # the tree, parents first, read before any dies
        pids += found
        children = subprocess.run(["pgrep", "-P", ",".join(map(str, found))],
                                  capture_output=True, text=True)  # fmt: skip
        found = [int(pid) for pid in children.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.process.wait()
    for pid in pids[1:]:  # reaped by init once their parent is gone
        while _alive(pid):
            assert time.monotonic() < run.deadline, f"process {pid} outlived SIGKILL"
            time.sleep(0.005)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_and_resume(start: Callable[[Path, bool], Launch], steps: int, tmp_path: Path) -> dict:
    """A run never killed, then the same run killed KILLS times at random moments and resumed
    each time, then once more to its end: both end on the same checkpoint, bit for bit.
    Returns the counts (where the kills landed, the checkpoint's step after each)."""
    rng = random.Random(0)
    straight = start(tmp_path / "straight", False)
    startup, step = _seconds_per_step(straight, steps)
    straight.wait()
    killed_out = tmp_path / "killed"
    checkpoint = killed_out / "checkpoint.safetensors"
    landed = {"in start-up": 0, "during the steps": 0, "finished first": 0}
    reached = []
    for attempt in range(KILLS):
        logged = max(_logged_steps(killed_out), default=0)  # a new step is one past these
        run = start(killed_out, attempt > 0)
        where = _kill_moment(run, logged, startup, step, rng, early=attempt % 5 == 4)
        landed[where] += 1
        if where == "finished first":
            break
        reached.append(_checkpoint(killed_out)[0] if checkpoint.exists() else 0)
    start(killed_out, True).wait()
    (final_step, expected), (last, got) = _checkpoint(straight.out), _checkpoint(killed_out)
    assert last == final_step
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():  # model, AdamW moments and the RNG state
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    return {"kills": len(reached), **landed, "checkpoint steps after each kill": reached}


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
        counts = kill_and_resume(_gpt(tmp_path_factory, parallel), 100, tmp_path)
    print(f"\nstress, gpt {' '.join(parallel)} on 2 processes: {counts}")
