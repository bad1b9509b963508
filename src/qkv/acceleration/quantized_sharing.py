"""Quantized linears of one module that read one input, multiplied as one product.

A decoding step of SmolLM2 calls 7 quantized products a layer: q, k, v, the output projection,
gate, up and down. q, k and v read one tensor, and so do gate and up; multiplied together they
make 4 products a layer instead of 7 (and 4 casts to bf16 and back instead of 7): one product of
960 rows takes 40 us where q, k and v took 74, and eager greedy decoding is 3-4% faster (Intel
AVX-512, 2 threads; benchmarks/decode_smollm2.py).

`share_quantized_inputs(model)` gives, in every module, the `QuantizedLinear` children served by
int4pack (or its pair form, Q8_0) with one kind and input width, in order, one joint layout: a
packed tensor holding their output rows one after another. Each child's own packed weight
becomes a view of its rows, so no memory is added for the codes: int4pack's CPU layout keeps
output rows in blocks of 64 (32 with AVX2), each laid out alone, so the children's packed
weights one after another are the packed weight of all their rows, and a row range that starts
and ends at a multiple of 64 is a packed weight of its own (checked on this machine once:
`row_slices_hold`).

Which children read one tensor is learned from the first round of calls, as `shared_input` learns
it for `packed_linears` (`InputSharing`): out_proj reads the attention's output, not x. From then
on those children, contiguous in the joint layout, are one product over their rows, each taking
its slice when called with that very tensor. Their scales are joined too, in place: at load each
child's scales move into its segment of one tensor (`scales`), and the segments of children found
to share an input are rewritten there as their joint (groups, rows, 2) scales, whose column slices
the children then hold (a view is copied before int4pack reads it). So the scales are in memory
once, as the file's are. A child called with another tensor or under autograd computes its own
product, and so does every child inside torch.compile's graphs; torch.export's tracing shares them
as eager calls do, so that the exported decoding step (qkv.acceleration.exported) holds one
product per shared input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from qkv.acceleration.quantized import PAIR_ROWS, QuantizedLinear
from qkv.acceleration.quantized_kernels import (
    int4pack_layout,
    int4pack_pair_rows,
    int4pack_product,
)
from qkv.acceleration.shared_input import InputSharing
from qkv.models.gguf.quants import quantize_q4_1

__all__ = ["QuantizedSharing", "row_slices_hold", "share_quantized_inputs"]

ROW_BLOCK = 64  # a joint layout's children start and end at multiples of this many rows
_KERNELS = ("int4pack", "int4pack-pair")


def share_quantized_inputs(model: nn.Module, *, recurse: bool = True) -> nn.Module:
    """Give every module's int4pack-served QuantizedLinear children of one kind and input width
    (two or more, each a multiple of 64 output rows) a joint layout and one `QuantizedSharing`
    (see the module doc), in place; returns the model. recurse=False: `model`'s own children
    only. Nothing is done where int4pack's rows cannot be sliced here (`row_slices_hold`)."""
    for module in model.modules() if recurse else [model]:
        families: dict[tuple, list[tuple[str, QuantizedLinear]]] = {}
        for name, child in module.named_children():
            if _joinable(child):
                key = (child.kernel, child.kind, child.in_features)
                families.setdefault(key, []).append((name, child))
        for family in families.values():
            if len(family) > 1 and row_slices_hold():
                QuantizedSharing(*zip(*family, strict=True))
    return model


def _joinable(child: nn.Module) -> bool:
    return (
        type(child) is QuantizedLinear
        and child.kernel in _KERNELS
        and child.out_features % ROW_BLOCK == 0
        and child._sharing is None
    )


class QuantizedSharing(InputSharing):
    """QuantizedLinears `layers` of one module (one kernel, kind and input width), their packed
    codes views of one joint layout; those found to read one tensor share one product."""

    def __init__(self, names: tuple[str, ...], layers: tuple[QuantizedLinear, ...]) -> None:
        super().__init__(names, tuple(layer.out_features for layer in layers))
        self.layers = layers
        first = layers[0]
        self.kernel, self.in_features = first.kernel, first.in_features
        # the layers' packed rows one after another: the packed weight of all their rows
        # (`row_slices_hold`), built without reading their blocks again
        self.packed = torch.cat([layer.packed for layer in layers])
        self.starts = [0, *torch.tensor(self.widths).cumsum(0).tolist()]
        # every layer's scales in its segment of one tensor, taken now (made while a prompt
        # runs, long-lived tensors pinned glibc's heap above its temporaries: 30-100 MB more
        # after a 512-token context, SmolLM2); the subsets learned later are joined there
        groups = first.scales_and_zeros.shape[0]
        self.scales = first.scales_and_zeros.new_empty(groups * self.starts[-1] * 2)
        for index, layer in enumerate(layers):
            layer.packed = self.packed[self.starts[index] : self.starts[index + 1]]  # a view
            segment = self._segment(range(index, index + 1)).view(groups, layer.out_features, 2)
            layer.scales_and_zeros = segment.copy_(layer.scales_and_zeros)  # its own freed
            layer._sharing = (self, index)

    def _segment(self, subset) -> torch.Tensor:
        """The flat room of `scales` for the layers of `subset` (consecutive indices)."""
        groups = self.layers[0].scales_and_zeros.shape[0]
        rows = slice(self.starts[subset[0]], self.starts[subset[-1] + 1])
        return self.scales[2 * groups * rows.start : 2 * groups * rows.stop]

    def dissolve(self) -> None:
        """Each layer computes alone from now on (one was laid out again: a state dict loaded);
        the others keep their views, whose codes are theirs."""
        for layer in self.layers:
            layer._sharing = None
            for name in ("joined_packed", "joined_scales_and_zeros"):
                layer._buffers.pop(name, None)
        self.forget()

    def _own(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[index].product(x)

    def _fuse(self, subset: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if subset != tuple(range(subset[0], subset[-1] + 1)):
            return None  # not one row range of the joint layout
        rows = slice(self.starts[subset[0]], self.starts[subset[-1] + 1])
        # the subset's layout, as buffers of its first layer (not saved): torch.export finds
        # the exported step's tensors among the model's own
        owner = self.layers[subset[0]]
        owner.register_buffer("joined_packed", self.packed[rows], persistent=False)
        width, groups = rows.stop - rows.start, owner.scales_and_zeros.shape[0]
        joint = torch.cat([self.layers[j].scales_and_zeros for j in subset], dim=1)  # a copy
        scales = self._segment(subset).view(groups, width, 2).copy_(joint)  # over their own
        owner.register_buffer("joined_scales_and_zeros", scales, persistent=False)
        for j in subset:  # each layer's columns of the joint scales: their values, not copied
            start = self.starts[j] - rows.start
            self.layers[j].scales_and_zeros = scales[:, start : start + self.widths[j]]
        pair = self.kernel == "int4pack-pair"

        def fused(x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., width) in x's dtype
            flat = x.reshape(-1, self.in_features)  # (N, in)
            if x.dtype == torch.float64 or (pair and flat.shape[0] >= PAIR_ROWS):
                return torch.cat([self._own(j, x) for j in subset], dim=-1)  # fp32, fp64
            if pair:
                flat = int4pack_pair_rows(flat)  # (N, 2 in)
            y = int4pack_product(
                flat, owner.joined_packed, owner.joined_scales_and_zeros, width
            ).to(x.dtype)
            return y.reshape(*x.shape[:-1], width)

        return fused


@functools.cache
def row_slices_hold() -> bool:
    """Is int4pack's packed weight (this PyTorch, this ISA) made of blocks of 64 output rows,
    each laid out alone? Checked on a weight of 128 rows: its packed weight equals those of its
    two halves one after the other, byte for byte, and the product over the second half's rows
    of the whole's view equals that slice of the whole product, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * ROW_BLOCK, 64, generator=generator)  # (out, in)
    x = torch.randn(1, 64, generator=generator)
    blocks = quantize_q4_1(weight)
    try:
        packed, scales = int4pack_layout(blocks, "Q4_1", 2 * ROW_BLOCK, 64)
        halves = [int4pack_layout(half, "Q4_1", ROW_BLOCK, 64)[0] for half in blocks.chunk(2)]
        whole = int4pack_product(x, packed, scales, 2 * ROW_BLOCK)[:, ROW_BLOCK:]
        part = int4pack_product(
            x, packed[ROW_BLOCK:], scales[:, ROW_BLOCK:].contiguous(), ROW_BLOCK
        )
    except RuntimeError:
        return False
    return torch.equal(torch.cat(halves), packed) and torch.equal(whole, part)
