"""`qkv train gpt` on 2 processes under torchrun (gloo), as a user runs it, with each way of
sharing the work: `--fsdp` (PyTorch's fully_shard: each process keeps half of every parameter,
gradient and AdamW moment) and `--context-parallel 2` (the processes share every sequence
through ring attention). For each:

- the loss trajectory equals one process's on the same global batches (fp32, 1e-5);
- a rank killed with SIGKILL brings the run down, and `--resume` on 2 processes ends on
  weights bitwise equal to the uninterrupted run's;
- its checkpoint (the full state, gathered) resumes on ONE process, which ends on the weights
  of the 1-process run.

The runs and their flags are gpt_runs.py's; the 1-process run both compare with runs once in
this module, and the runs that do not wait on one another start side by side. Context
parallelism on 2 processes cuts a sequence in 4 zigzag chunks: the blocks of 30 tokens are
padded to 32. The fast checks of the pieces are tests/training/test_fsdp.py's.
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

PARALLEL = {"fsdp": ["--fsdp"], "context-parallel": ["--context-parallel", "2"]}


def _checkpoint(out):
    """(metadata, every tensor) of a run's checkpoint."""
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        document = json.loads(file.metadata()["qkv"])
        tensors = {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
    return document, tensors


@pytest.mark.slow
@pytest.mark.parametrize("parallel", PARALLEL)
def test_training_matches_one_process_and_resumes_on_any_count(
    tmp_path, tmp_path_factory, parallel
):
    def start(out, *, processes=1, extra=()) -> Launch:
        flags = PARALLEL[parallel] if processes > 1 else []
        arguments = command(documents(tmp_path_factory), out, processes=processes,
                            parallel=flags, extra=extra)  # fmt: skip
        return Launch(arguments, out)

    started = [  # the one to kill first: its resumed runs then overlap the others
        start(tmp_path / "killed", processes=2),
        one_process(tmp_path_factory),
        start(tmp_path / "two", processes=2),
    ]
    kill_one_rank_after_a_checkpoint(started[0])
    killed, on_one = tmp_path / "killed", tmp_path / "on_one"
    step_at_kill = _checkpoint(killed)[0]["step"]
    shutil.copytree(killed, on_one)
    resumed = [
        start(killed, processes=2, extra=["--resume"]),
        start(on_one, extra=["--resume"]),
    ]
    one, two = (run.wait() for run in started[1:])
    for run in resumed:
        run.wait()

    single, double = losses(one), losses(two)
    assert len(single) == len(double) == STEPS
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained
    (document_one, state_one), (document_two, state_two) = _checkpoint(one), _checkpoint(two)
    assert document_two["tied_weights"] == document_one["tied_weights"] != {}  # gpt2 ties
    assert sorted(state_two) == sorted(state_one)  # the same file an unsharded run writes
    for name, tensor in state_one.items():  # weights and AdamW moments, gathered
        if name != "rng/torch":
            torch.testing.assert_close(state_two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    assert 0 < step_at_kill < STEPS
    document, state = _checkpoint(killed)
    assert document["step"] == STEPS
    for name, tensor in state_two.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)

    document, weights = _checkpoint(on_one)
    assert document["step"] == STEPS
    for name, tensor in state_one.items():
        if name.startswith("model/"):
            torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
