"""`qkv cost --context-parallel/--fsdp`: the per-process training plan against the real model
and optimizer, and FSDP's shards against `torch.chunk` of the real parameters (how FSDP cuts
them). (The bytes sent are checked against counted sends in 2- and 4-process training steps:
tests/distributed/test_ring_attention.py and fsdp_step.py.)"""

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
    assert sharded.gathered_bytes > 0 and plan.gathered_bytes == 0


def test_sharing_each_sequence_divides_activations_and_sends_ring_blocks():
    one = parallel_training_cost(CONFIG, context=64, batch=2)
    for processes in (2, 4):
        shared = parallel_training_cost(CONFIG, context_parallel=processes, context=64, batch=2)
        assert shared.activations_bytes * processes == one.activations_bytes
        assert shared.ring_bytes_per_step > 0 and shared.kv_blocks_bytes > 0
        # DDP all-reduce over the processes: the payload is every gradient, 2 (n - 1) / n sent
        assert shared.all_reduce_payload_bytes == one.weights_bytes
        assert shared.all_reduce_bytes == 2 * (processes - 1) * one.weights_bytes // processes
        assert shared.gradient_sent_bytes == shared.all_reduce_bytes  # no FSDP collectives
    assert one.ring_bytes_per_step == one.gradient_sent_bytes == 0


ODD = {"vocab_size": 41, "embed_dim": 18, "num_heads": 3, "num_kv_heads": 1, "ffn_dim": 34,
       "max_positions": 30, "num_layers": 3}  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        GPTConfig.from_name("tiny-gpt2", **ODD),  # tied head, learned positions, biases
        GPTConfig.from_name("tiny-llama", **ODD, position="t5", relative_buckets=7),
        GPTConfig.from_name("tiny-llama", **ODD),  # RoPE: no position table
    ],
)
@pytest.mark.parametrize("F", [2, 3, 4])
def test_fsdp_shards_are_torch_chunks_of_each_unit_and_each_collective_sends_f_minus_1(config, F):
    """FSDP (fully_shard) gives a process the first of torch.chunk(parameter, F) along dim 0,
    padded to it; the units are each block and the root (the rest, a tied weight once)."""
    model = GPT(config)

    def shard(parameters):
        return sum(torch.chunk(p, F, dim=0)[0].numel() * p.itemsize for p in parameters)

    block = shard(model.blocks[0].parameters())
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = shard(p for p in model.parameters() if id(p) not in in_blocks)
    everything = root + config.num_layers * block
    plan = parallel_training_cost(config, fsdp=F, batch=F)
    assert plan.weights_bytes == plan.gradients_bytes == everything
    assert plan.optimizer_bytes == 2 * everything  # two fp32 moments
    assert plan.gathered_bytes == F * (root + block)
    assert plan.all_gather_bytes == (F - 1) * (root + 2 * config.num_layers * block)
    assert plan.reduce_scatter_bytes == (F - 1) * everything
    assert plan.all_reduce_bytes == plan.all_reduce_payload_bytes == 0
    assert plan.weights_bytes > sum(p.nbytes for p in model.parameters()) // F  # padding
    hybrid = parallel_training_cost(config, context_parallel=2, fsdp=F, batch=F, context=8)
    assert hybrid.all_reduce_payload_bytes == everything  # each shard over the 2 that hold it
    assert hybrid.all_reduce_bytes == everything


def test_the_command_prints_the_plan_and_refuses_what_it_cannot_plan(capsys):
    assert main(["cost", "tiny-llama", "--context-parallel", "2", "--fsdp", "2", "--batch", "4",
                 "--json"]) == 0  # fmt: skip
    (plan,) = json.loads(capsys.readouterr().out)
    assert plan["processes"] == 4 and plan["dtype"] == "fp32"
    assert main(["cost", "tiny-llama", "--context-parallel", "2"]) == 0
    assert "memory / process" in capsys.readouterr().out
    assert main(["cost", "tiny-llama", "--fsdp", "2", "--batch", "2"]) == 0
    table = capsys.readouterr().out
    assert "all-gather sends / step (FSDP)" in table and "reduce-scatter sends" in table
    assert main(["cost", "--fsdp", "2"]) == 1
    assert "name the MODEL" in capsys.readouterr().err
    assert main(["cost", "bert-base-uncased", "--context-parallel", "2"]) == 1
    assert "not decoder-only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch: expected a multiple of fsdp = 4"):
        parallel_training_cost(CONFIG, fsdp=4, batch=6)
