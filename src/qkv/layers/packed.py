"""Faster CPU matrix-vector products for decoding: linear weights packed once for oneDNN.

At batch 1 every decoding step reads every weight once (seed 002 section 6: decoding is
memory-bound), so the speed of a step is the bandwidth `F.linear` reaches on a (1, E) input.
On the CPUs we measured, PyTorch's default path (MKL's GEMV for fp32) reaches a fraction of
what oneDNN's blocked-layout kernels reach on the same weights; `packed_linears(model)` swaps
every `nn.Linear` of a model for a `PackedLinear` holding the weight reordered once into
oneDNN's layout, for as long as the `with` block lasts:

    with qkv.layers.packed_linears(model):
        tokens = qkv.generate(model, prompt, max_new_tokens=128)

Inference only: a packed weight has no gradient, and it is a copy (the model's own weights are
kept to be put back, so the weights take twice their memory inside the block). It serves CPU
fp32 and bf16 weights; other devices and dtypes keep their nn.Linear. The outputs equal
`F.linear`'s up to the order of the floating-point sums (tested: within fp32 rounding).
`benchmarks/decode.py` measures both paths side by side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["PackedLinear", "can_pack", "packed_linears"]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(linear: nn.Linear) -> bool:
    """True if this PyTorch has the oneDNN ops and the weight is a CPU fp32/bf16 tensor."""
    weight = linear.weight
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
    )


class PackedLinear(nn.Module):
    """y = x W^T + b, like the `nn.Linear` it is built from, with W reordered once into
    oneDNN's blocked layout (`batch_hint`: the rows per call it is tuned for; 1 = decoding).

    (..., in_features) -> (..., out_features), in the weight's dtype. No gradients.
    """

    def __init__(self, linear: nn.Linear, *, batch_hint: int = 1) -> None:
        super().__init__()
        if not can_pack(linear):
            raise ValueError(
                f"linear: expected a CPU float32/bfloat16 nn.Linear and a PyTorch with oneDNN, "
                f"got {linear.weight.dtype} on {linear.weight.device}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x: expected a last dimension of {self.in_features}, got shape {tuple(x.shape)}"
            )
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


@contextlib.contextmanager
def packed_linears(model: nn.Module, *, batch_hint: int = 1) -> Iterator[nn.Module]:
    """Inside the block, every packable `nn.Linear` of `model` is a `PackedLinear` (same
    outputs); on exit the original modules are back, even after an exception. A weight shared
    by two linears (or tied to an embedding) is packed once per linear; the model's own tensors
    are never modified. Gradients are off inside the block (torch.no_grad). Yields the model."""
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    packed: dict[int, PackedLinear] = {}  # one PackedLinear per distinct nn.Linear module
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and can_pack(child):
                    if id(child) not in packed:
                        packed[id(child)] = PackedLinear(child, batch_hint=batch_hint)
                    setattr(parent, name, packed[id(child)])
                    swapped.append((parent, name, child))
        with torch.no_grad():
            yield model
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)
