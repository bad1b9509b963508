"""oneDNN-packed linears under torch.compile: each packed product finds its own weights, stacked
linears and bf16 rows give what they give eagerly."""

import torch
import torch.nn.functional as F
from torch import nn

from qkv.acceleration import PackedLinear
from qkv.acceleration.compiled import INDUCTOR_OPTIONS


def test_under_torch_compile_each_packed_linear_computes_with_its_own_weights():
    """Compiled, a packed product is an opaque operator that finds its module by a handle: two
    packed linears of the same shape through one compiled function (and a second pair through
    the same function) each give their own F.linear, around a fused activation."""
    torch.manual_seed(0)
    pairs = [(nn.Linear(16, 24), nn.Linear(16, 24)) for _ in range(2)]
    x = torch.randn(1, 1, 16)

    def two_products(a: nn.Module, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.silu(a(x)), b(x) * 2], dim=-1)

    compiled = torch.compile(two_products, fullgraph=True)
    for a, b in pairs:
        expected = two_products(a, b, x)
        with torch.no_grad():
            got = compiled(PackedLinear(a), PackedLinear(b), x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_compiled_stacked_linears_equal_their_outputs_concatenated():
    """Compiled at one row, several linears (biases mixed) give cat([l(x) for l]): one
    reduction per linear, concatenated (one reduction over a stacked copy was measured 5-12%
    slower a decoding step, interleaved, besides costing the copy)."""
    torch.manual_seed(0)
    linears = [nn.Linear(16, n, bias=b) for n, b in ((24, True), (8, False), (8, True))]
    x = torch.randn(1, 1, 16)
    expected = torch.cat([linear(x) for linear in linears], dim=-1)  # (1, 1, 40)
    compiled = torch.compile(lambda module, x: module(x), fullgraph=True)
    with torch.no_grad():
        got = compiled(PackedLinear(*linears), x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_compiled_bf16_row_is_the_rounded_row_as_eagerly():
    """Compiled at one row, a bf16 product converts the row to fp32 once, into a buffer
    (qkv.acceleration.packing); with qkv's compile options (as compiled decoding steps use
    them) the row is still the bf16-rounded one when it comes from fp32 math cast to bf16, as it is
    eagerly: the same outputs as from a row rounded beforehand, and the fp64 product of that
    row within one bf16 rounding."""
    torch.manual_seed(0)
    linear = nn.Linear(512, 256, bias=False).to(torch.bfloat16)
    row = torch.randn(1, 1, 512) * 3  # fp32, not representable in bf16

    def cast_then_product(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module((x * 1.5).to(torch.bfloat16))

    compiled = torch.compile(cast_then_product, fullgraph=True, options=INDUCTOR_OPTIONS)
    packed = PackedLinear(linear)
    rounded = (row * 1.5).to(torch.bfloat16)
    with torch.no_grad():
        got = compiled(packed, row)
        from_rounded = torch.compile(lambda m, x: m(x), options=INDUCTOR_OPTIONS)(packed, rounded)
    assert torch.equal(got, from_rounded)
    expected = (rounded.double() @ linear.weight.double().T).to(torch.bfloat16)
    torch.testing.assert_close(got, expected, atol=0, rtol=2**-8)
