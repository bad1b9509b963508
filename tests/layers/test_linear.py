"""qkv.layers.Linear against nn.Linear / F.linear: the same function and gradients, on oneDNN
where this CPU is one it is chosen for, and F.linear wherever it does not apply."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from qkv import capabilities
from qkv.capabilities import Support
from qkv.layers import Linear
from qkv.layers import linear as linear_module

ONEDNN = bool(capabilities.onednn_linear(torch.float32))


@pytest.fixture
def onednn(monkeypatch):
    """The oneDNN path whatever it costs here (where oneDNN runs fp32 products at all)."""
    if not ONEDNN:
        pytest.skip(f"no oneDNN fp32 products here: {capabilities.onednn_linear(torch.float32)}")
    monkeypatch.setattr(capabilities, "onednn_fp32_products", lambda: Support(True, "forced"))


def _pair(in_features: int, out_features: int, bias: bool) -> tuple[Linear, nn.Linear]:
    torch.manual_seed(0)
    reference = nn.Linear(in_features, out_features, bias=bias)
    ours = Linear(in_features, out_features, bias=bias)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 64), (2, 3, 4, 64), (1, 1, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_outputs_and_gradients_equal_float64_math(onednn, shape, bias):
    ours, reference = _pair(64, 48, bias)
    x = torch.randn(shape, requires_grad=True)
    y = ours(x)
    assert type(y.grad_fn).__name__ == "_OneDNNLinearBackward"
    assert y._base is None  # as F.linear's: FSDP2 warns about a module returning a view
    exact = F.linear(x.double(), reference.weight.double(), _double(reference.bias))
    torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(y)
    ours_grads = torch.autograd.grad(y, [x, *ours.parameters()], grad)
    y_ref = reference(x)
    ref_grads = torch.autograd.grad(y_ref, [x, *reference.parameters()], grad)
    for got, expected in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_non_contiguous_input_and_input_without_gradient(onednn):
    ours, reference = _pair(32, 16, True)
    x = torch.randn(32, 6, 3).transpose(0, 2)  # (3, 6, 32), not contiguous
    y = ours(x)  # only the weights need gradients
    torch.testing.assert_close(y, reference(x), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, reference.bias.grad)


def test_inference_runs_the_plain_product_without_autograd(onednn):
    ours, reference = _pair(32, 16, True)
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        y = ours(x)
    assert y.grad_fn is None and not y.requires_grad and y._base is None
    torch.testing.assert_close(y, reference(x).detach(), atol=1e-5, rtol=1e-5)


def test_double_backward_equals_nn_linear(onednn):
    """A penalty on the input gradient's norm: the backward runs differentiable ops then."""
    ours, reference = _pair(16, 8, True)
    x = torch.randn(4, 16, requires_grad=True)
    for module in (ours, reference):
        (grad_x,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
        grad_x.square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, reference.bias.grad, atol=1e-4, rtol=1e-5)


def test_where_onednn_does_not_apply_the_product_is_f_linear_exactly(onednn):
    ours, _ = _pair(32, 16, True)
    x = torch.randn(3, 32)
    cases = {
        "bf16": (_pair(32, 16, True)[0].bfloat16(), x.bfloat16()),
        "float64": (_pair(32, 16, True)[0].double(), x.double()),
        "1-D input": (ours, torch.randn(32)),
        "empty": (ours, torch.randn(0, 32)),
    }
    for name, (module, inputs) in cases.items():
        expected = F.linear(inputs, module.weight, module.bias)
        assert torch.equal(module(inputs), expected), name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = ours(x), F.linear(x, ours.weight, ours.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_flop_counter_and_compile_see_f_linear(onednn):
    ours, _ = _pair(32, 16, False)
    x = torch.randn(4, 32)
    with FlopCounterMode(display=False) as counter:
        ours(x)
    assert counter.get_total_flops() == 2 * 4 * 32 * 16
    seen = []
    monkey = linear_module._product

    def spy(*args):
        seen.append(args)
        return monkey(*args)

    linear_module._product = spy
    try:
        compiled = torch.compile(ours, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), F.linear(x, ours.weight), atol=1e-5, rtol=1e-5)
    finally:
        linear_module._product = monkey
    assert seen == []  # traced as F.linear, never the oneDNN op


def test_machine_where_onednn_is_not_faster_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(capabilities, "onednn_fp32_products", lambda: Support(False, "slower"))
    ours, _ = _pair(32, 16, True)
    x = torch.randn(3, 32, requires_grad=True)
    y = ours(x)
    assert type(y.grad_fn).__name__ == "AddmmBackward0"
    assert torch.equal(y, F.linear(x, ours.weight, ours.bias))


def test_the_answer_says_why_and_describe_measures_it():
    answer = capabilities.onednn_fp32_products()
    if not ONEDNN:
        assert not answer and answer.reason == capabilities.onednn_linear(torch.float32).reason
        return
    assert "AVX-512" in answer.reason or "F.linear" in answer.reason
    assert "oneDNN float32 linears:" in capabilities.describe()


def test_a_drop_in_nn_linear():
    ours, reference = _pair(8, 4, True)
    assert isinstance(ours, nn.Linear) and repr(ours) == repr(reference)
    assert ours.state_dict().keys() == reference.state_dict().keys()


def _double(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.double()
