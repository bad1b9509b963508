"""Attention over sequences split across processes, on torch.distributed.

    from qkv.distributed import ring_attention, shard_sequence, gather_sequence
    q_local = shard_sequence(q, rank, world_size, dim=2)             # zigzag: causal balanced
    out_local = ring_attention(q_local, k_local, v_local, causal=True, length=q.shape[2])
    out = gather_sequence(out_local, dim=2, length=q.shape[2])

`use_ring_attention(model, RingAttention(...))` makes a decoder sequence-parallel: fed the
shards `shard_lm_batch` cuts, it computes what it computes on the whole sequence.

Ring attention (Liu et al. 2023) with the zigzag load balancing of causal work (in the spirit
of Striped Attention, Brandon et al. 2023); `ring_attention_traffic` counts the bytes it sends.
Process groups are set up as for training (`qkv.training.distributed.setup_distributed`).
"""

from qkv.distributed.attention import ring_attention
from qkv.distributed.layout import LAYOUTS, gather_sequence, padded_length, shard_sequence
from qkv.distributed.sequence_parallel import (
    RingAttention,
    local_attention,
    shard_lm_batch,
    use_ring_attention,
)
from qkv.distributed.traffic import RingTraffic, ring_attention_traffic

__all__ = [
    "LAYOUTS",
    "RingAttention",
    "RingTraffic",
    "gather_sequence",
    "local_attention",
    "padded_length",
    "ring_attention",
    "ring_attention_traffic",
    "shard_lm_batch",
    "shard_sequence",
    "use_ring_attention",
]
