"""Sequence (context) parallel language models: every attention layer a ring, every process a
share of each sequence.

A model's self-attention layers take their attention function as an extension point
(`MultiHeadAttention(attention=...)`); `use_ring_attention` puts `RingAttention` there, which
calls `ring_attention` on the group, so a decoder whose inputs are shards of the sequence
(`shard_lm_batch`: token ids, next-token targets and global positions, cut by the same layout)
computes exactly what it computes on the whole sequence on one process (Liu et al. 2023). Every
other layer (embeddings, norms, FFN, the head) works token by token and needs nothing. The
parameters are replicated: their gradients are summed over the group afterwards (DDP does it).

`local_attention` puts plain attention back for a while: evaluation on one process, or saving.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qkv.distributed.attention import ring_attention
from qkv.distributed.layout import check_layout, padded_length, shard_sequence
from qkv.layers.attention import MultiHeadAttention
from qkv.validation import check_int

__all__ = ["RingAttention", "local_attention", "shard_lm_batch", "use_ring_attention"]

IGNORE_INDEX = -100  # the targets of padding positions (cross_entropy's ignore_index)


class RingAttention:
    """`qkv.attention`'s signature, computed by `ring_attention` over `group` on sequence shards.

    length: the true sequence length N when the shards are padded (`padded_length`); None: every
    position is real. Masks, biases, attention dropout and weights have no ring form here and
    are refused by name; causal and windows are on global positions.
    """

    def __init__(
        self, *, group: dist.ProcessGroup | None = None, layout: str = "zigzag",
        length: int | None = None,
    ) -> None:  # fmt: skip
        self.group, self.layout = group, check_layout(layout)
        self.length = None if length is None else check_int("length", length, minimum=1)

    def __call__(
        self, q, k, v, *, mask=None, causal=False, window=None, bias=None, dropout_p=0.0,
        return_weights=False, backend="auto", scale=None, **unsupported,
    ):  # fmt: skip
        refused = {"mask": mask, "bias": bias, "return_weights": return_weights or None,
                   "dropout_p": dropout_p or None, **unsupported}  # fmt: skip
        for name, value in refused.items():
            if value is not None:
                raise ValueError(
                    f"{name}: ring attention (context parallelism) takes no {name}, got "
                    f"{value!r}; positions shared by a ring are causal or windowed only"
                )
        kernel = backend if backend in ("reference", "tiled") else "auto"
        return ring_attention(
            q, k, v, group=self.group, causal=causal, window=window, scale=scale,
            layout=self.layout, length=self.length, backend=kernel,
        )  # fmt: skip


def use_ring_attention(model: nn.Module, ring: RingAttention) -> nn.Module:
    """Every self-attention layer of `model` attends through `ring`. Cross-attention layers
    (qkv names them `cross_attn`), whose keys are another sequence, are refused. Returns the
    model, changed in place."""
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not named:
        raise ValueError("model: expected MultiHeadAttention layers, found none")
    crossing = [n for n, m in named if n.rsplit(".", 1)[-1].startswith("cross") or m.context_dim]
    if crossing:
        raise ValueError(
            f"model: cross-attention layers cannot run as a ring over one sequence: "
            f"{', '.join(crossing[:3])}"
        )
    layers = [m for _, m in named]
    for layer in layers:
        layer.attention = ring
    return model


@contextmanager
def local_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Plain attention in every layer for the duration (then the ring again): one process
    evaluating whole sequences while the others wait."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    saved = [layer.attention for layer in layers]
    try:
        for layer in layers:
            layer.attention = None
        yield model
    finally:
        for layer, attention in zip(layers, saved, strict=True):
            layer.attention = attention


def shard_lm_batch(
    input_ids: torch.Tensor, rank: int, world_size: int, *, layout: str = "zigzag"
) -> dict[str, torch.Tensor]:
    """This rank's share of a language-model batch (B, N): {"input_ids": (B, n),
    "targets": (B, n), "position_ids": (n,)} with n = N_pad / P.

    targets[b, t] is the token after input_ids[b, t] in the whole sequence (IGNORE_INDEX for
    the last and for padding), so each rank's loss needs no neighbour. Padding positions get
    token 0 and position 0: ring attention (`length=N`) never lets them be seen."""
    B, N = input_ids.shape
    targets = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, N)
    positions = torch.arange(N, device=input_ids.device)  # (N,)
    shards = {
        "input_ids": shard_sequence(input_ids, rank, world_size, 1, layout=layout),
        "targets": shard_sequence(targets, rank, world_size, 1, layout=layout),
        "position_ids": shard_sequence(positions, rank, world_size, 0, layout=layout),
    }
    padded = padded_length(N, world_size, layout)
    if padded != N:  # shard_sequence pads with zeros; padding must predict nothing
        real = shard_sequence(torch.ones(N, dtype=torch.bool), rank, world_size, 0, layout=layout)
        shards["targets"] = shards["targets"].masked_fill(~real, IGNORE_INDEX)
    return shards
