"""More than one process: PyTorch DistributedDataParallel, launched by `torchrun`.

`torchrun --nproc-per-node N -m qkv.cli train ...` starts N copies of the same command with
RANK, WORLD_SIZE and MASTER_ADDR/PORT in their environment. Each process builds the same model
from the same seed, takes its share of every global batch (`shard`), and DDP averages the
gradients during backward (all-reduce), so every process applies the same update. gloo carries
the all-reduce on CPU, nccl on GPU. With WORLD_SIZE unset the same code runs as one process.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "Distributed",
    "OtherProcessFailedError",
    "all_reduce_sum",
    "fail_together",
    "setup_distributed",
    "shard",
]


@dataclass(frozen=True)
class Distributed:
    """Where this process stands: rank in [0, world_size); rank 0 writes files and logs."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def device(self, device: torch.device | str) -> torch.device:
        """`device`, or on CUDA with several processes this process's GPU (LOCAL_RANK)."""
        device = torch.device(device)
        if self.enabled and device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        return device

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model DDP-wrapped when there is more than one process, else itself."""
        if not self.enabled:
            return model
        parameter = next(model.parameters())
        on_gpu = parameter.device.type == "cuda"
        device_ids = [parameter.device.index] if on_gpu else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def setup_distributed(device: torch.device | str = "cpu") -> Distributed:
    """Join the process group `torchrun` describes in the environment (gloo on CPU, nccl on
    CUDA); one process when WORLD_SIZE is unset or 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    if not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        atexit.register(_leave_process_group)
    return Distributed(rank=dist.get_rank(), world_size=dist.get_world_size())


def _leave_process_group() -> None:
    """Destroy the process group this module joined, at exit while the interpreter is still
    whole: left to the interpreter's finalisation, gloo's worker threads may still hold work
    with Python references, and their destruction aborts the process (SIGABRT, "terminate
    called without an active exception") after a run that ended well."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(indices: list[int], context: Distributed) -> list[int]:
    """This process's share of a global batch: every world_size-th example from its rank."""
    return indices[context.rank :: context.world_size]


def all_reduce_sum(values: torch.Tensor, context: Distributed) -> torch.Tensor:
    """The element-wise sum of `values` over all processes (itself with one process)."""
    if context.enabled:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class OtherProcessFailedError(RuntimeError):
    """Raised on the processes that did not fail, when another one did (it shows its error)."""


def fail_together(error: BaseException | None, context: Distributed, device: torch.device) -> None:
    """Raise `error` here, and OtherProcessFailedError on every other process, so that none of them
    waits forever at a collective for a process that has stopped. Every process must call it
    (it is a collective, and so a barrier); with one process it just raises `error`, if any."""
    if context.enabled:
        failed = torch.zeros(context.world_size, device=device)
        failed[context.rank] = float(error is not None)
        ranks = all_reduce_sum(failed, context).nonzero().flatten().tolist()
        if error is None and ranks:
            raise OtherProcessFailedError(f"rank {ranks} stopped with an error (shown there)")
    if error is not None:
        raise error
