"""The pieces of `qkv train gpt --fsdp`, on one process: the checkpoint identity leaves fsdp out
(a sharded run resumes unsharded and back), and `gather_state` of an unsharded model is its
own state. The runs on 2 processes are tests/distributed/test_parallel_training.py's.
"""

from __future__ import annotations

import torch

from qkv.training import TrainingConfig
from qkv.training.sharded import gather_state


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
