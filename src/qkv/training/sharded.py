"""Sharded data parallelism (`TrainingConfig.fsdp`): PyTorch's `fully_shard` (FSDP2).

Each of N processes keeps 1/N of every parameter, of its gradient and of AdamW's moments
(Rajbhandari et al. 2020, ZeRO stage 3; Zhao et al. 2023, PyTorch FSDP). Before a block's
forward (and backward) its parameters are gathered from all processes (all-gather) and dropped
after it; the gradients are averaged over processes and scattered back into the shards
(reduce-scatter), so the update is the one one process would make. Every block of the model
(the items of its `blocks` or `layers` lists) is its own unit, the rest (embeddings, final
norm, tied head) is the root's; tied parameters therefore stay together.

Checkpoints stay the one atomic safetensors file of `qkv.training.checkpoint`, with the full
(gathered) tensors, so a run resumes on any number of processes, with or without sharding:
`gather_state` all-gathers every tensor, and a resumed run loads the checkpoint into the plain
model and optimizer before `shard_training` shards them. The price: at each checkpoint and on
resume every process holds the full state in CPU memory (its device one gathered tensor at a
time); for models beyond one process's memory the way out is torch.distributed.checkpoint's
sharded files, one per process.

Evaluation and the result use a `replica`: an unsharded copy of the model made before sharding
(one full set of weights per process, without gradients or optimizer state), refreshed from the
shards (`refresh_replica`) before each evaluation and at the end.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "gather_state",
    "full",
    "gradient_sync_off",
    "local",
    "refresh_replica",
    "shard_training",
]

# (optimizer, scheduler) for a model: `qkv.training.loop` builds them from its config
BuildOptimizer = Callable[[nn.Module], tuple[torch.optim.Optimizer, object]]

_BLOCK_LISTS = ("blocks", "layers")


def shard_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    build: BuildOptimizer,
) -> tuple[nn.Module, torch.optim.Optimizer, object, nn.Module]:
    """Shard `model` in place (each block, then the root) and return it with a new optimizer
    and scheduler (`build(model)`, which must come after sharding: AdamW's moments are then
    shards too) holding the state of the given ones, and an unsharded replica.

    Every process must call it (with the same model); the process group must be initialised."""
    from torch.distributed.fsdp import fully_shard

    replica = _replica(model)
    full_optimizer_state = optimizer.state_dict()
    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)
    sharded_optimizer, sharded_scheduler = build(model)
    sharded_optimizer.load_state_dict(_distribute(full_optimizer_state, sharded_optimizer))
    sharded_scheduler.load_state_dict(scheduler.state_dict())
    return model, sharded_optimizer, sharded_scheduler, replica


def _replica(model: nn.Module) -> nn.Module:
    """An unsharded copy of the model. Objects that hold a process group (ring attention's)
    are shared with it, not copied: a group cannot be."""
    from torch.distributed import ProcessGroup

    def holds_group(value: object) -> bool:
        inside = vars(value).values() if hasattr(value, "__dict__") else ()
        return isinstance(value, ProcessGroup) or any(isinstance(v, ProcessGroup) for v in inside)

    shared = {
        id(value): value
        for module in model.modules()
        for value in vars(module).values()
        if not isinstance(value, nn.Module | torch.Tensor | dict) and holds_group(value)
    }
    return copy.deepcopy(model, memo=shared)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The items of every `blocks` or `layers` ModuleList in the model (an encoder-decoder has
    two); none for a model without them, which is then sharded as one unit."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _BLOCK_LISTS and isinstance(module, nn.ModuleList):
            found.extend(module)
    return found


def _distribute(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state dict of full tensors (every process holds the same), each tensor of
    a parameter's shape cut like that parameter's shard, locally (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [index for group in state["param_groups"] for index in group["params"]]
    by_index = dict(zip(indices, parameters, strict=True))
    shards: dict = {}
    for index, values in state["state"].items():
        parameter = by_index[index]
        shards[index] = {
            key: distribute_tensor(
                value.to(parameter.device),
                parameter.device_mesh,
                parameter.placements,
                src_data_rank=None,
            )  # fmt: skip
            if isinstance(parameter, DTensor)
            and isinstance(value, torch.Tensor)
            and value.shape == parameter.shape
            else value
            for key, value in values.items()
        }
    return {"state": shards, "param_groups": state["param_groups"]}


def gather_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, dict]:
    """{"model_state": ..., "optimizer_state": ...}: the state dicts an unsharded model and
    optimizer would give (full tensors on the CPU; tied parameters the same tensor), what
    `qkv.training.checkpoint.save_checkpoint` takes. A collective: every process calls it."""
    gathered: dict[int, torch.Tensor] = {}

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in gathered:
            gathered[id(tensor)] = full(tensor).detach().cpu()
        return gathered[id(tensor)]

    state = {"model_state": {k: whole(v) for k, v in model.state_dict(keep_vars=True).items()}}
    if optimizer is not None:
        saved = optimizer.state_dict()
        state["optimizer_state"] = {
            "state": {
                index: {
                    key: whole(value) if isinstance(value, torch.Tensor) else value
                    for key, value in values.items()
                }  # fmt: skip
                for index, values in saved["state"].items()
            },
            "param_groups": saved["param_groups"],
        }
    return state


def refresh_replica(replica: nn.Module, model: nn.Module) -> nn.Module:
    """The replica with the sharded model's current weights (a collective)."""
    replica.load_state_dict(gather_state(model)["model_state"])
    return replica


@contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally for a micro-batch (DDP's `no_sync`; FSDP's reduce-scatter
    waits for the last micro-batch)."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (a collective: every process calls it); a plain tensor
    itself."""
    return tensor.full_tensor() if _is_sharded(tensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor; a plain tensor itself."""
    return tensor.to_local() if _is_sharded(tensor) else tensor


def _is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
