"""`qkv train gpt --context-parallel 2` under torchrun (gloo), as a user runs it: the two
processes share every sequence through ring attention, and

- its loss trajectory equals one process's on the same global batches (fp32, 1e-5);
- a rank killed with SIGKILL brings the run down, and `--resume` on 2 processes ends on
  weights bitwise equal to the uninterrupted run's;
- its checkpoint resumes on ONE process, which ends on the weights of the 1-process run.

The runs and their flags are gpt_runs.py's (the 1-process run is shared with the FSDP test);
those that do not wait on one another run side by side. The blocks hold 30 tokens: 2 processes
cut them in 4 zigzag chunks, so they are padded to 32.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.distributed.gpt_runs import (
    STEPS,
    Launch,
    command,
    documents,
    kill_one_rank_after_a_checkpoint,
    losses,
    one_process,
)


def _start(tmp_path_factory, out, *, processes=1, extra=()) -> Launch:
    parallel = ["--context-parallel", str(processes)]
    arguments = command(documents(tmp_path_factory), out, processes=processes,
                        parallel=parallel, extra=extra)  # fmt: skip
    return Launch(arguments, out)


def _weights(out):
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        step = json.loads(file.metadata()["qkv"])["step"]
        tensors = {k: file.get_tensor(k) for k in file.keys() if k.startswith("model/")}  # noqa: SIM118
    return step, tensors


@pytest.mark.slow
def test_context_parallel_training_matches_one_process_and_resumes_on_any_count(
    tmp_path, tmp_path_factory
):
    started = [  # the one to kill first: its resumed runs then overlap the others
        _start(tmp_path_factory, tmp_path / "killed", processes=2),
        one_process(tmp_path_factory),
        _start(tmp_path_factory, tmp_path / "two", processes=2),
    ]
    kill_one_rank_after_a_checkpoint(started[0])
    killed, on_one = tmp_path / "killed", tmp_path / "on_one"
    step_at_kill, _ = _weights(killed)
    shutil.copytree(killed, on_one)
    resumed = [
        _start(tmp_path_factory, killed, processes=2, extra=["--resume"]),
        _start(tmp_path_factory, on_one, extra=["--resume"]),
    ]
    one, two = (run.wait() for run in started[1:])
    for run in resumed:
        run.wait()

    single, double = losses(one), losses(two)
    assert len(single) == len(double) == STEPS
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained

    assert 0 < step_at_kill < STEPS
    (final_step, resumed_weights), (_, expected) = _weights(killed), _weights(two)
    assert final_step == STEPS
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=0, atol=0, msg=name)

    final_step, weights = _weights(on_one)
    _, reference = _weights(one)
    assert final_step == STEPS
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
