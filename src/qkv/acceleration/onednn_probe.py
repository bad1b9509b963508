"""Whether oneDNN's products work here, proved on a tiny input before a model relies on them.

`qkv.capabilities` says what the CPU and the build are (oneDNN in the build, the CPU's flags,
oneDNN's ISA cap), from facts alone. A masked or missing feature can still make oneDNN refuse a
product, or compute a wrong one, so the fast paths that call its private ops prove them first,
once per process, on a tiny input against F.linear: the error or the wrong result shows up here,
not in the middle of a model. A probe never times anything: its answer is the same in every
process on a machine.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qkv import capabilities
from qkv.capabilities import Support

__all__ = ["fp32_linear_speedup", "packed_products", "plain_fp32_products", "plain_product_works"]


def packed_products(dtype: torch.dtype) -> Support:
    """Can oneDNN pack a linear weight of `dtype` and multiply with it here? The facts
    (`capabilities.onednn_linear`), then one packed product of an (8, 16) weight."""
    support = capabilities.onednn_linear(dtype)
    return _packed_product_proved(dtype) if support else support


@functools.cache
def _packed_product_proved(dtype: torch.dtype) -> Support:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=generator).to(dtype)  # (out, in)
    x = torch.randn(2, 16, generator=generator).to(dtype)  # (rows, in)
    # outside any autocast region of the caller (where F.linear of float32 inputs gives bf16)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
            return Support(False, f"oneDNN refused a {dtype} packed product here: {first_line}")
        expected = F.linear(x.float(), weight.float())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    if y.shape != expected.shape or not torch.allclose(y.float(), expected, atol=tolerance):
        return Support(False, f"oneDNN's {dtype} packed product gave wrong results here")
    return Support(True, f"oneDNN packs {dtype} weights on this CPU")


def plain_fp32_products() -> Support:
    """Do float32 linears run on oneDNN's kernels here, on their plain (unpacked) weights? The
    choice (`capabilities.onednn_fp32_products`, which a resumed run may pin), where oneDNN's
    product on a plain weight is also right here."""
    support = capabilities.onednn_fp32_products()
    if not support:
        return support
    proved = plain_product_works()
    return support if proved else proved


def plain_product_works() -> Support:
    """Does oneDNN compute a float32 product on a plain (unpacked) weight right here, whether
    or not it is the kernel chosen for this CPU (`plain_fp32_products`)?"""
    support = capabilities.onednn_linear(torch.float32)
    return _plain_fp32_product_proved() if support else support


@functools.cache
def _plain_fp32_product_proved() -> Support:
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(8, 64, generator=generator), torch.randn(24, 64, generator=generator)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        ours = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        if not torch.allclose(ours, F.linear(x, weight), rtol=1e-4, atol=1e-4):
            return Support(False, "oneDNN's float32 product on a plain weight gave wrong results")
    return Support(True, "oneDNN's float32 product on a plain weight is right here")


def fp32_linear_speedup() -> float:
    """oneDNN's time over F.linear's for a (256, 512) x (512, 1024) float32 product, each the
    best of five: what `plain_fp32_products` means here, for `qkv check` and benchmarks only (a
    timing never chooses a kernel)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=generator)
    weight = torch.randn(1024, 512, generator=generator)  # (out, in)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        onednn = capabilities.best_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""), 5
        )
        plain = capabilities.best_seconds(lambda: F.linear(x, weight), 5)
    return onednn / plain
