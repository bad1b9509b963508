"""What ring attention sends: bytes per rank, forward and backward, from the shapes alone.

Forward (Liu et al. 2023): each rank sends its held K and V blocks on P - 1 times. Backward:
the blocks go around again (P - 1 sends of K and V), and so do their gradient accumulators
dK, dV, kept in the compute dtype (fp32, or fp64 for fp64 input), also P - 1 sends each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.validation import check_positive_int


@dataclass(frozen=True)
class RingTraffic:
    """Bytes one rank sends in one call of `ring_attention`."""

    forward_bytes: int
    backward_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def ring_attention_traffic(
    *,
    batch_size: int,
    num_kv_heads: int,
    local_length: int,
    head_dim: int,
    world_size: int,
    value_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> RingTraffic:
    """Bytes sent per rank by `ring_attention` on K, V shards (B, H_kv, L_local, D | D_v).

    forward = (P - 1) * (|K| + |V|) in `dtype`; backward = the same again plus (P - 1) *
    (|dK| + |dV|) in the compute dtype. Query heads do not matter: queries never travel.
    """
    sizes = [
        check_positive_int(name, value)
        for name, value in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("local_length", local_length),
            ("head_dim", head_dim),
            ("world_size", world_size),
        )
    ]
    B, H_kv, L, D, P = sizes
    D_v = D if value_dim is None else check_positive_int("value_dim", value_dim)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    elements = B * H_kv * L * (D + D_v)  # one K block and one V block
    compute = torch.promote_types(dtype, torch.float32)
    blocks = (P - 1) * elements * dtype.itemsize
    gradients = (P - 1) * elements * compute.itemsize
    return RingTraffic(forward_bytes=blocks, backward_bytes=blocks + gradients)
