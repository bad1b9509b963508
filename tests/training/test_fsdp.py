"""`qkv train gpt --fsdp` under torchrun (gloo), as a user runs it: 2 processes each keep half
of every parameter, gradient and AdamW moment (PyTorch's fully_shard), and

- the loss trajectory equals one process's on the same global batches (fp32, 1e-5);
- a rank killed with SIGKILL brings the run down, and `--resume` on 2 processes ends on
  weights bitwise equal to the uninterrupted run's;
- its checkpoint (the full state, gathered) resumes on ONE process, unsharded, which ends on
  the weights of the 1-process run.

The runs and their flags are tests/distributed/gpt_runs.py's (the 1-process run is shared with
the context-parallel test); those that do not wait on one another run side by side. The fast
tests check the pieces on one process: the checkpoint identity leaves fsdp out, and
`gather_state` of an unsharded model is its own state.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from qkv.training import TrainingConfig
from qkv.training.sharded import gather_state
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
    arguments = command(documents(tmp_path_factory), out, processes=processes,
                        parallel=["--fsdp"], extra=extra)  # fmt: skip
    return Launch(arguments, out)


def _checkpoint(out):
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        document = json.loads(file.metadata()["qkv"])
        tensors = {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
    return document, tensors


@pytest.mark.slow
def test_fsdp_training_matches_one_process_and_resumes_on_any_count(tmp_path, tmp_path_factory):
    started = [  # the one to kill first: its resumed runs then overlap the others
        _start(tmp_path_factory, tmp_path / "killed", processes=2),
        one_process(tmp_path_factory),
        _start(tmp_path_factory, tmp_path / "two", processes=2),
    ]
    kill_one_rank_after_a_checkpoint(started[0])
    killed, on_one = tmp_path / "killed", tmp_path / "on_one"
    step_at_kill = _checkpoint(killed)[0]["step"]
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


def test_the_checkpoint_identity_leaves_out_fsdp():
    sharded, plain = TrainingConfig(steps=5, fsdp=True), TrainingConfig(steps=5)
    assert sharded.identity() == plain.identity()
    assert "fsdp" not in plain.identity() and sharded.to_json()["fsdp"] is True
    assert TrainingConfig(steps=6).identity() != plain.identity()


def test_gather_state_of_an_unsharded_model_is_its_own_state_with_ties_kept():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    state = gather_state(model, optimizer)
    expected = model.state_dict()
    assert sorted(state["model_state"]) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state["model_state"][name], tensor, rtol=0, atol=0)
    assert state["model_state"]["0.weight"] is state["model_state"]["1.weight"]
    own = optimizer.state_dict()
    assert state["optimizer_state"]["param_groups"] == own["param_groups"]
    for key, value in own["state"][0].items():
        torch.testing.assert_close(state["optimizer_state"]["state"][0][key], value)
