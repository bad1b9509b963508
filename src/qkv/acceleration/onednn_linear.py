"""`OneDNNLinear`: nn.Linear whose CPU float32 products run on oneDNN's kernels, swapped into a
built model by `onednn_linears(model)` (qkv.acceleration.swaps).

    y = x W^T + b        x (..., in_features), W (out_features, in_features) -> (..., out)

Every projection of a Transformer is this one product, and on the CPU it is most of the time of
a forward pass. PyTorch computes float32 products with MKL's GEMM; on some CPUs oneDNN's
kernels, which PyTorch also ships, are much faster on the very same plain weight: on an AMD
EPYC with AVX-512 MKL keeps to its AVX2 code while oneDNN uses AVX-512. Whether a machine is one
of those is `qkv.capabilities.onednn_fp32_products`, decided from what the CPU is, never from a
timing: the two kernels round differently, and every process on a machine must compute the same
bits.

The product is `torch.ops.mkldnn._linear_pointwise` on the weight as it is stored (no packed
copy: a copy would double the model's memory; `qkv.acceleration.packed_linears` packs for
inference), with a backward of three oneDNN products (`_OneDNNProduct`) when gradients are
needed. Outputs equal F.linear's up to the order of the floating-point sums. Everything else is
F.linear: other devices and dtypes (bf16 products already run on oneDNN), CPU autocast (which
gives F.linear its bf16 copies), torch.compile (inductor has its own linear kernels), functorch
transforms and dispatch modes (FlopCounterMode counts F.linear), double backward (the backward
then runs differentiable ops), and a build whose oneDNN cannot compute float32 products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from qkv import capabilities

__all__ = ["OneDNNLinear", "onednn_linear"]


class OneDNNLinear(nn.Linear):
    """nn.Linear computed by `onednn_linear`. It adds nothing to nn.Linear but its forward
    (same parameters and state-dict keys; its repr names it): `onednn_linears(model)` turns a
    model's own nn.Linear modules into OneDNNLinear ones for the length of a `with` block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias): x (..., in), weight (out, in), bias (out,) -> (..., out),
    computed by oneDNN where `_uses_onednn` says it can be (see the module doc)."""
    if not _uses_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _OneDNNProduct.apply(x, weight, bias)
    return _product(x, weight, bias)


def _uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A float32 product on the CPU, outside autocast and torch.compile, of a non-empty x and a
    contiguous weight, in a build whose oneDNN computes float32 products."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return False  # first: the cheapest test, and the one a bf16 or GPU model stops at
    if torch.compiler.is_compiling():
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return False
    if weight.device.type != "cpu" or not weight.is_contiguous() or x.numel() == 0:
        return False
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        return False  # F.linear says what is wrong
    if torch.is_autocast_enabled("cpu") or torch._C._are_functorch_transforms_active():
        return False
    if is_in_torch_dispatch_mode():  # FlopCounterMode, FakeTensorMode: modes know F.linear
        return False
    return bool(capabilities.onednn_linear(torch.float32))


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x (..., in) @ weight (out, in)^T + bias (out,) -> (..., out), by oneDNN."""
    y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return _own_tensor(y)


def _own_tensor(y: torch.Tensor) -> torch.Tensor:
    """y as a tensor of its own over the same memory, where oneDNN returned (..., out) as a
    view of its (N, out) result, which nothing else holds: F.linear returns no view, and
    FSDP2 warns about every module output that is one (an in-place op on it would skip its
    hook), so a model whose last layer is a linear would warn at every step."""
    if y._base is None:
        return y
    own = y.new_empty(0)
    return own.set_(y.untyped_storage(), y.storage_offset(), y.shape, y.stride())


class _OneDNNProduct(torch.autograd.Function):
    """The product with gradients: dx = dy W, dW = dy^T x, db = the sum of dy over rows, each
    a oneDNN product too."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: ops autograd can differentiate again
            return _differentiable_backward(ctx, grad, x, weight)
        grad_x = grad_weight = grad_bias = None
        rows = grad.reshape(-1, grad.shape[-1])  # (N, out)
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t().contiguous())  # (..., in)
        if ctx.needs_input_grad[1]:
            inputs = x.reshape(-1, x.shape[-1])  # (N, in)
            # (out, N) @ (N, in): the "weight" of this product is x^T (in, N)
            grad_weight = _product(rows.t(), inputs.t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _differentiable_backward(ctx, grad, x, weight):
    """The same gradients from ops autograd records (a double backward, e.g. a penalty on a
    gradient's norm)."""
    rows = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_weight, grad_bias
