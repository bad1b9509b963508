"""One FSDP training step counted against `qkv cost --fsdp` (`parallel_training_cost`), run
inside the 2- and 4-process spawns of test_ring_attention.py.

A tiny GPT is sharded as `qkv train --fsdp` shards it (`qkv.training.sharded.shard_training`:
each block, then the root) and takes one step: forward, backward, AdamW. A dispatch mode sees
every collective the step issues (every op of torch's c10d namespace, whoever calls it), and
counts what this rank sends: an all-gather sends its shard to the F - 1 others, a
reduce-scatter the F - 1 shards of the others. The sums must EQUAL the plan's bytes, and the
shards FSDP keeps (the storage of its parameters, gradients and AdamW moments) the plan's
memory. The sizes are odd (vocabularies of 41 and 43 tokens, 6 key rows, FFNs of 34 and 38)
so that FSDP pads rows to a multiple of the number of processes; one model ties its head.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from qkv.analysis.cost.parallel import parallel_training_cost
from qkv.models import GPT, GPTConfig
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler
from qkv.training.sharded import shard_training

CONFIGS = (
    GPTConfig.from_name("tiny-gpt2", vocab_size=41, embed_dim=18, num_layers=2, num_heads=3,
                        num_kv_heads=1, ffn_dim=34, max_positions=30),  # tied head, biases
    GPTConfig.from_name("tiny-llama", vocab_size=43, embed_dim=16, num_layers=3, num_heads=4,
                        num_kv_heads=2, ffn_dim=38, max_positions=30, position="t5",
                        relative_buckets=7),  # SwiGLU, untied head, T5 buckets at the root
)  # fmt: skip
BATCH_PER_RANK, LENGTH = 2, 12


class CollectiveCounter(TorchDispatchMode):
    """Bytes this rank sends, by collective, of every c10d op dispatched while it is on, and
    the calls by collective and phase (set `phase` as the step goes)."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size, self.phase = world_size, "forward"
        self.sent: Counter = Counter()
        self.calls: Counter = Counter()  # (collective, phase) -> calls
        self.outputs: list[int] = []  # bytes of each all-gather's output, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            if name == "_allgather_base_":  # (output, input, group, ...)
                name = "all_gather"
                self.sent[name] += (self.world_size - 1) * args[1].nbytes
                self.outputs.append(args[0].nbytes)
            elif name == "_reduce_scatter_base_":  # (output, input, group, op, ...)
                name = "reduce_scatter"
                self.sent[name] += (self.world_size - 1) * args[0].nbytes
            self.calls[name, self.phase] += 1  # any other collective: FSDP alone has none
        return func(*args, **(kwargs or {}))


def _build(model: torch.nn.Module) -> tuple:
    """AdamW with its schedule, as `qkv train` builds them."""
    optimizer = build_optimizer(model, learning_rate=1e-3)
    return optimizer, build_scheduler(optimizer, warmup_steps=1, total_steps=2, kind="cosine")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under these tensors (a shard's padding included)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _step(config: GPTConfig, world_size: int) -> tuple:
    """(model, optimizer, counter) after one counted step of a sharded GPT."""
    torch.manual_seed(0)
    model = GPT(config)
    model, optimizer, _, _ = shard_training(model, *_build(model), build=_build)
    ids = torch.randint(0, config.vocab_size, (BATCH_PER_RANK, LENGTH + 1))
    counter = CollectiveCounter(world_size)
    with counter:
        logits = model(ids[:, :-1]).logits
        counter.phase = "backward"
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        counter.phase = "optimizer"
        optimizer.step()
    return model, optimizer, counter


def _check_one(config: GPTConfig, rank: int, world_size: int) -> None:
    model, optimizer, counter = _step(config, world_size)
    plan = parallel_training_cost(config, fsdp=world_size, context=LENGTH,
                                  batch=BATCH_PER_RANK * world_size)  # fmt: skip
    blocks = config.num_layers
    assert counter.calls == {  # the root is gathered once: it stays gathered until backward ends
        ("all_gather", "forward"): 1 + blocks, ("all_gather", "backward"): blocks,
        ("reduce_scatter", "backward"): 1 + blocks,
    }, counter.calls  # fmt: skip
    assert dict(counter.sent) == {
        "all_gather": plan.all_gather_bytes,
        "reduce_scatter": plan.reduce_scatter_bytes,
    }, (counter.sent, plan)
    assert plan.all_reduce_bytes == plan.all_reduce_payload_bytes == 0
    # what FSDP keeps: the root's gathered weights (the first all-gather) and a block's
    assert counter.outputs[0] + counter.outputs[1] == plan.gathered_bytes, (counter.outputs, plan)
    local = [p.to_local() for p in model.parameters()]
    assert _storage_bytes(local) == plan.weights_bytes, (_storage_bytes(local), plan)
    gradients = [p.grad.to_local() for p in model.parameters()]
    assert _storage_bytes(gradients) == plan.gradients_bytes, (_storage_bytes(gradients), plan)
    moments = [v.to_local() for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    moment_bytes = sum(m.nbytes for m in moments)  # unpadded, the first rank's the largest
    if rank == 0:
        assert moment_bytes == plan.optimizer_bytes, (moment_bytes, plan)
    assert moment_bytes <= plan.optimizer_bytes, (moment_bytes, plan)


def check_fsdp_step_bytes(rank: int, world_size: int) -> None:
    """Every config's step on the default group (all processes), as `qkv train --fsdp`."""
    assert dist.get_world_size() == world_size
    for config in CONFIGS:
        _check_one(config, rank, world_size)
