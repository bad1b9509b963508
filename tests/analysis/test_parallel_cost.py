"""`qkv cost --context-parallel/--fsdp`: the per-process training plan against the real model
and optimizer. (The bytes sent are checked against counted sends in 2- and 4-process training
steps: tests/distributed/test_ring_attention.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from qkv.analysis.cost.parallel import parallel_training_cost
from qkv.cli import main
from qkv.models import GPT, GPTConfig

CONFIG = GPTConfig.from_name("tiny-llama", vocab_size=64, embed_dim=32, num_layers=2,
                             num_heads=4, num_kv_heads=2, ffn_dim=64, max_positions=64)  # fmt: skip


def test_weights_gradients_and_adamw_state_are_those_of_the_real_model_and_optimizer():
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (1, 8))).logits.sum().backward()
    optimizer.step()
    weights = sum(p.nbytes for p in model.parameters())
    gradients = sum(p.grad.nbytes for p in model.parameters())
    moments = sum(
        t.nbytes
        for state in optimizer.state.values()
        for name, t in state.items()
        if name != "step"
    )
    plan = parallel_training_cost(CONFIG, batch=4)
    assert (plan.weights_bytes, plan.gradients_bytes, plan.optimizer_bytes) == (
        weights, gradients, moments,
    )  # fmt: skip
    sharded = parallel_training_cost(CONFIG, fsdp=4, batch=4)
    assert sharded.weights_bytes * 4 == weights and sharded.optimizer_bytes * 4 == moments
    assert sharded.gathered_block_bytes > 0 and plan.gathered_block_bytes == 0


def test_sharing_each_sequence_divides_activations_and_sends_ring_blocks():
    one = parallel_training_cost(CONFIG, context=64, batch=2)
    for processes in (2, 4):
        shared = parallel_training_cost(CONFIG, context_parallel=processes, context=64, batch=2)
        assert shared.activations_bytes * processes == one.activations_bytes
        assert shared.ring_bytes_per_step > 0 and shared.kv_blocks_bytes > 0
        # DDP all-reduce over the processes: the payload is every gradient, 2 (n - 1) / n sent
        assert shared.gradient_payload_bytes == one.weights_bytes
        assert shared.gradient_sent_bytes == 2 * (processes - 1) * one.weights_bytes // processes
    assert one.ring_bytes_per_step == one.gradient_sent_bytes == 0


def test_the_command_prints_the_plan_and_refuses_what_it_cannot_plan(capsys):
    assert main(["cost", "tiny-llama", "--context-parallel", "2", "--fsdp", "2", "--batch", "4",
                 "--json"]) == 0  # fmt: skip
    (plan,) = json.loads(capsys.readouterr().out)
    assert plan["processes"] == 4 and plan["dtype"] == "fp32"
    assert main(["cost", "tiny-llama", "--context-parallel", "2"]) == 0
    assert "memory / process" in capsys.readouterr().out
    assert main(["cost", "--fsdp", "2"]) == 1
    assert "name the MODEL" in capsys.readouterr().err
    assert main(["cost", "bert-base-uncased", "--context-parallel", "2"]) == 1
    assert "not decoder-only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch: expected a multiple of fsdp = 4"):
        parallel_training_cost(CONFIG, fsdp=4, batch=6)
