"""Faster CPU matrix-vector products for decoding: linear weights packed once for oneDNN.

At batch 1 every decoding step reads every weight once (decoding is memory-bound: Pope et al.
2022, s2), so the speed of a step is the bandwidth `F.linear` reaches on a (1, E) input. On the
AMD CPU measured in benchmarks/decode.py, PyTorch's default path (MKL's GEMV for fp32) reaches a
fraction of what oneDNN's blocked-layout kernels reach on the same weights (on Intel's CPUs
MKL's fp32 products are the faster, and fp32 stays F.linear's there: `packs`);
`packed_linears(model)` swaps every `nn.Linear` of a model for a `PackedLinear` holding the
weight reordered into oneDNN's layout, for as long as the `with` block lasts:

    with qkv.acceleration.packed_linears(model):
        tokens = qkv.generate(model, prompt, max_new_tokens=128)
    print(qkv.acceleration.explain_packing(model))   # what the block packs and fuses, and why

`packed_linears` (qkv.acceleration.block) also computes the projections that read one input as
one product (qkv.acceleration.shared_input): fewer, larger products are faster.

Weights are packed at their first call, not on entry: a projection the model never calls (the
separate q, k, v of a self-attention layer once fused) costs neither time nor memory, while
cross-attention, which projects q and k, v from different inputs, still finds them packed.

Inference only: a packed weight has no gradient, and it is a copy (the model's own weights are
kept to be put back, so each packed weight takes twice its memory inside the block). It serves
CPU fp32 and bf16 weights; other devices and dtypes keep their nn.Linear. The outputs equal
`F.linear`'s up to the order of the floating-point sums (tested: within fp32 rounding).

Not every machine can pack: oneDNN's bf16 kernels need AVX512-BW/VL/DQ or AVX-NE-CONVERT, and a
build may lack the ops (`qkv.capabilities` asks, once per process). What cannot be packed here
keeps its nn.Linear, and a bf16 copy under CPU autocast that cannot be packed is computed by
F.linear, as autocast would: the same results, slower. `explain_packing` says which applies.

Under `torch.compile` (`qkv.acceleration.decoding_steps`), everything around the products
(norms, RoPE, the cache writes) fuses, and a product over
- one row (a decoding step at batch 1) is written as an elementwise product and a sum, which
  inductor turns into one streaming C++ reduction over the plain weight, which reads the
  weights faster than oneDNN's GEMV (nothing is packed then); fp32 where MKL's products are
  the faster (`packs`) stays F.linear, MKL's GEMV, as fast as the plain model's;
- more rows is one opaque operator, `torch.ops.qkv.packed_linear`, which finds its module by a
  handle: a oneDNN-packed tensor has no strides, so the compiler cannot trace it.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from qkv import capabilities
from qkv.acceleration import onednn_probe

__all__ = ["PackedLinear"]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """y = x W^T + b for one `nn.Linear`, or for several of the same input width with their
    weights stacked: PackedLinear(q, k, v)(x) == cat([q(x), k(x), v(x)], -1). The stacked
    weight is reordered into oneDNN's blocked layout at the first call (`batch_hint`: the rows
    per call it is tuned for; 1 = decoding).

    (..., in_features) -> (..., sum of out_features), in the weights' dtype, or in bf16 under
    CPU autocast (a bf16 copy of fp32 weights is packed then, as autocast's F.linear casts
    them at every call). No gradients. Where oneDNN cannot pack the dtype on this machine,
    or its packed fp32 products are slower than MKL's (`packs`), the product is F.linear's:
    the same outputs, unpacked.
    """

    def __init__(self, *linears: nn.Linear, batch_hint: int = 1) -> None:
        super().__init__()
        _check_linears(linears)
        self.in_features = linears[0].in_features
        self.out_features = sum(linear.out_features for linear in linears)
        self.batch_hint = batch_hint
        self._linears = linears  # a plain tuple: not submodules, nothing in a state_dict
        self._dtype = linears[0].weight.dtype
        # fp32 on a CPU where MKL's products beat oneDNN's (Intel's): in a graph too, its one
        # row is F.linear's (MKL's GEMV) rather than inductor's reduction (`_matvec`)
        self._fp32_by_mkl = self._dtype == torch.float32 and not packs(torch.float32)
        # dtype -> (packed weight, bias): the weights' own, and under CPU autocast its dtype
        self._packed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.packing_seconds = 0.0  # wall time spent packing so far (benchmarks report it)
        self._handle = next(_HANDLES)  # how torch.ops.qkv.packed_linear finds this module
        _BY_HANDLE[self._handle] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x: expected a last dimension of {self.in_features}, got shape {tuple(x.shape)}"
            )
        if torch.compiler.is_compiling():  # see the module doc
            if x.numel() == self.in_features and self._compute_dtype() == self._dtype:
                return self._plain_linear(x) if self._fp32_by_mkl else self._matvec(x)
            return torch.ops.qkv.packed_linear(x, self._handle)
        return self._linear(x)

    def _matvec(self, x: torch.Tensor) -> torch.Tensor:
        """One row, compiled: each weight times the row, summed over in_features, in fp32.

        Written as an elementwise product and a sum, which inductor fuses into one streaming
        reduction over the weight (no (out, in) temporary), where a matrix product would be an
        external GEMV call. (..., in_features) with one row -> (..., out_features).

        A bf16 row is converted to fp32 once, into a buffer (`as_strided` makes inductor store
        what it views): left to fusion, the conversion ran inside the reduction, once per
        weight row, and the loop was bound by its instructions rather than by memory."""
        h = x.unsqueeze(-2).float()  # (..., 1, in)
        if x.dtype != torch.float32:
            h = h.as_strided(h.shape, h.stride())  # no-op eagerly; a stored fp32 row compiled
        outputs = []
        for linear in self._linears:
            y = (h * linear.weight.float()).sum(-1)  # (..., out_i)
            outputs.append(y if linear.bias is None else y + linear.bias.float())
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y.to(self._dtype)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """forward's product, run eagerly: packs at the first call, then one oneDNN call."""
        dtype = self._compute_dtype()
        if x.dtype != dtype:
            x = x.to(dtype)
        if not packs(dtype) or self._emulated_bf16(x):
            return self._plain_linear(x)  # e.g. fp32 on Intel's CPUs, bf16 without AVX-512
        if dtype not in self._packed:
            start = time.perf_counter()
            self._packed[dtype] = self._pack(dtype)
            self.packing_seconds += time.perf_counter() - start
        weight, bias = self._packed[dtype]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    def _plain_linear(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear over each stacked linear, concatenated: what runs where oneDNN cannot
        pack the compute dtype. (..., in_features) -> (..., out_features).

        bf16 where this CPU's bf16 products are emulated (`capabilities.bf16_products`: slower
        than fp32, up to tens of times) and x has several rows: bf16 storage, fp32 compute. The
        operands are rounded to bf16 as a bf16 product (or autocast) rounds them, multiplied
        in fp32 (exact for bf16 values) with fp32 sums, as bf16 kernels accumulate, and the
        result rounded to bf16: the bf16 product's values, at fp32 speed."""
        if self._emulated_bf16(x):
            return self._fp32_product(x)
        outputs = [F.linear(x, linear.weight, linear.bias) for linear in self._linears]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    @staticmethod
    def _emulated_bf16(x: torch.Tensor) -> bool:
        """Whether x is several bf16 rows on a CPU whose bf16 products are emulated: oneDNN's
        packed bf16 kernels are then as slow as F.linear's (SmolLM2's 512-token prompt: ~250
        tokens/s either way, on an Intel CPU with AVX-512 and no AVX512-BF16), and fp32
        compute on the bf16 values is several times faster (`_fp32_product`)."""
        several_rows = x.numel() > x.shape[-1]
        return x.dtype == torch.bfloat16 and several_rows and not capabilities.bf16_products()

    def _fp32_product(self, x: torch.Tensor) -> torch.Tensor:
        """`_plain_linear` of bf16 x, computed in fp32 (outside autocast), rounded to bf16."""
        h = x.float()
        outputs = []
        with torch.autocast("cpu", enabled=False):
            for linear in self._linears:
                weight = linear.weight.to(torch.bfloat16).float()
                bias = None if linear.bias is None else linear.bias.to(torch.bfloat16).float()
                outputs.append(F.linear(h, weight, bias))
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y.to(torch.bfloat16)

    def _compute_dtype(self) -> torch.dtype:
        """The weights' dtype, or CPU autocast's (bf16) for fp32 weights, as F.linear would."""
        if self._dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
            autocast_dtype = torch.get_autocast_dtype("cpu")
            if autocast_dtype in _PACKABLE_DTYPES:
                return autocast_dtype
        return self._dtype

    def _pack(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(packed weight (out, in), bias (out,) or None) from the linears' current weights."""
        with torch.no_grad():
            weights = [linear.weight.detach() for linear in self._linears]
            weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # (out, in)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), self.batch_hint)
            if all(linear.bias is None for linear in self._linears):
                return packed, None
            biases = [
                torch.zeros(m.out_features, dtype=weight.dtype) if m.bias is None else m.bias
                for m in self._linears
            ]
            return packed, torch.cat([b.detach() for b in biases]).to(dtype)  # (out,)

    def extra_repr(self) -> str:
        support = packs(self._dtype)
        packed = "oneDNN-packed" if self._packed else "packed at its first call"
        emulated = "several rows computed in fp32 (bf16 products are emulated here)"
        if self._dtype == torch.bfloat16 and not capabilities.bf16_products():
            packed = f"{packed} for one row, {emulated}" if support else emulated
        elif not support:
            packed = f"computed by F.linear: {support.reason}"
        stacked = f", {len(self._linears)} linears stacked" if len(self._linears) > 1 else ""
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}{stacked}, {packed}"


def packs(dtype: torch.dtype) -> capabilities.Support:
    """Whether PackedLinear's products of `dtype` run on oneDNN-packed weights here: where
    oneDNN packs the dtype (`onednn_probe.packed_products`) and, for fp32, where qkv prefers
    oneDNN's products to MKL's (`capabilities.onednn_fp32_products`: on AMD's CPUs, where MKL
    keeps to AVX2). On Intel's, MKL's are the faster: one row of SmolLM2's shapes 1.2-3x, 512
    rows alike (Intel AVX-512, 2 threads), so fp32 stays F.linear's there."""
    if dtype == torch.float32:
        preferred = capabilities.onednn_fp32_products()
        if not preferred:
            return preferred
    return onednn_probe.packed_products(dtype)


# handle -> PackedLinear, for the operator below; weak, so a dropped module is freed.
_HANDLES = itertools.count()
_BY_HANDLE: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()

_LIBRARY = torch.library.Library("qkv", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, int handle) -> Tensor")


def _packed_linear_cpu(x: torch.Tensor, handle: int) -> torch.Tensor:
    """The operator's kernel: the module's own eager product. A plain `Library.impl` kernel,
    because a `torch.library.custom_op` adds several times its dispatch cost to each of the
    dozens of calls a decoding step makes."""
    return _BY_HANDLE[handle]._linear(x)


def _packed_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    """What the compiler traces: the shape and dtype of the output, (..., out_features)."""
    module = _BY_HANDLE[handle]
    return x.new_empty((*x.shape[:-1], module.out_features), dtype=module._compute_dtype())


_LIBRARY.impl("packed_linear", _packed_linear_cpu, "CPU")
torch.library.register_fake("qkv::packed_linear", _packed_linear_fake, lib=_LIBRARY)


def _check_linears(linears: tuple[nn.Linear, ...]) -> None:
    if not linears:
        raise ValueError("linears: expected at least one nn.Linear, got none")
    for linear in linears:
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES:
            raise ValueError(
                f"linear: expected a CPU float32/bfloat16 nn.Linear, got {weight.dtype} on "
                f"{weight.device}"
            )
    first = linears[0]
    for linear in linears[1:]:
        if (linear.in_features, linear.weight.dtype) != (first.in_features, first.weight.dtype):
            raise ValueError(
                f"linears: expected the same in_features and dtype to stack them, got "
                f"{first.in_features} {first.weight.dtype} and {linear.in_features} "
                f"{linear.weight.dtype}"
            )
