"""The ring: P processes, each sends to the next and receives from the previous one.

Ring attention (Liu et al. 2023) passes key/value blocks around the ring, P - 1
hops in the forward; the transfer of the next block is started before the current block is
computed (asynchronous point-to-point operations, `torch.distributed.batch_isend_irecv`), so
communication hides behind computation when a block takes longer to compute than to send.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Keys/values and their gradient accumulators travel between the same pair of ranks: distinct
# tags keep them apart on backends that match messages by tag (gloo); others match in order,
# which every rank keeps, since all of them run the same loop.
BLOCK_TAG = 0
GRADIENT_TAG = 1


@dataclass(frozen=True)
class Ring:
    """This process's place in the ring of `group` (None: the default group)."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Ring:
        """The ring of `group`; one process when torch.distributed is not initialised."""
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a ProcessGroup or None, got {type(group).__name__}")
        if not dist.is_initialized():
            if group is not None:
                raise ValueError("group: given, but torch.distributed is not initialised")
            return cls(None, 0, 1)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not one of its members")
        return cls(group, rank, dist.get_world_size(group))

    def source(self, step: int) -> int:
        """The rank whose block this rank holds after `step` hops."""
        return (self.rank - step) % self.world_size

    def shift(self, tensors: tuple[torch.Tensor, ...], tag: int) -> Transfer:
        """Start sending `tensors` to the next rank and receiving the previous rank's."""
        if self.world_size == 1:
            return Transfer(tensors, (), [])
        group = self.group if self.group is not None else dist.group.WORLD
        following = (self.rank + 1) % self.world_size
        preceding = (self.rank - 1) % self.world_size
        sent = tuple(t.contiguous() for t in tensors)  # kept alive until the sends complete
        received = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=following) for t in sent]
        ops += [
            dist.P2POp(dist.irecv, r, group=group, tag=tag, group_peer=preceding) for r in received
        ]
        return Transfer(received, sent, dist.batch_isend_irecv(ops))


@dataclass
class Transfer:
    """Tensors on their way in: `wait` returns them once they have arrived."""

    tensors: tuple[torch.Tensor, ...]
    sent: tuple[torch.Tensor, ...]
    work: list

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.work:
            work.wait()
        return self.tensors
