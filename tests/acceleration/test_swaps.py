"""The stand-ins of qkv.acceleration.swaps against the PyTorch blocks they replace: OneDNNLinear
against nn.Linear (float64 math), the fused loss against F.cross_entropy; `speed_up` and the
swaps given back."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from qkv import capabilities
from qkv.acceleration import (
    FastRotaryEmbedding,
    LossInput,
    OneDNNLinear,
    PackedLinear,
    fused_cross_entropy,
    fused_losses,
    onednn_linears,
    packed_linears,
    speed_up,
    speed_up_choices,
    swapped_classes,
)
from qkv.acceleration import onednn_linear as onednn_module
from qkv.models import GPT, GPTConfig

ONEDNN = capabilities.onednn_linear(torch.float32)
needs_onednn = pytest.mark.skipif(not ONEDNN, reason=f"no oneDNN fp32 products: {ONEDNN.reason}")


def _pair(in_features: int, out_features: int, bias: bool) -> tuple[nn.Linear, nn.Linear]:
    """(a OneDNNLinear, the nn.Linear with the same weights)."""
    torch.manual_seed(0)
    reference = nn.Linear(in_features, out_features, bias=bias)
    ours = nn.Linear(in_features, out_features, bias=bias)
    ours.load_state_dict(reference.state_dict())
    ours.__class__ = OneDNNLinear  # what onednn_linears does to a model's own modules
    return ours, reference


@needs_onednn
@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 64), (2, 3, 4, 64), (1, 1, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_outputs_and_gradients_equal_float64_math(shape, bias):
    ours, reference = _pair(64, 48, bias)
    x = torch.randn(shape, requires_grad=True)
    y = ours(x)
    assert type(y.grad_fn).__name__ == "_OneDNNProductBackward"
    assert y._base is None  # as F.linear's: FSDP2 warns about a module returning a view
    bias64 = None if reference.bias is None else reference.bias.double()
    exact = F.linear(x.double(), reference.weight.double(), bias64)
    torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(y)
    ours_grads = torch.autograd.grad(y, [x, *ours.parameters()], grad)
    ref_grads = torch.autograd.grad(reference(x), [x, *reference.parameters()], grad)
    for got, expected in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_onednn_non_contiguous_input_no_input_gradient_and_no_grad():
    ours, reference = _pair(32, 16, True)
    x = torch.randn(32, 6, 3).transpose(0, 2)  # (3, 6, 32), not contiguous
    y = ours(x)  # only the weights need gradients
    torch.testing.assert_close(y, reference(x), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, reference.bias.grad)
    with torch.no_grad():
        y = ours(x)
    assert y.grad_fn is None and y._base is None


@needs_onednn
def test_onednn_double_backward_equals_nn_linear():
    """A penalty on the input gradient's norm: the backward runs differentiable ops then."""
    ours, reference = _pair(16, 8, True)
    x = torch.randn(4, 16, requires_grad=True)
    for module in (ours, reference):
        (grad_x,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
        grad_x.square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, reference.bias.grad, atol=1e-4, rtol=1e-5)


def test_where_onednn_does_not_apply_the_product_is_f_linear_exactly():
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


@needs_onednn
def test_flop_counter_and_compile_see_f_linear(monkeypatch):
    ours, _ = _pair(32, 16, False)
    x = torch.randn(4, 32)
    with FlopCounterMode(display=False) as counter:
        ours(x)
    assert counter.get_total_flops() == 2 * 4 * 32 * 16
    seen = []
    product = onednn_module._product
    monkeypatch.setattr(onednn_module, "_product", lambda *a: seen.append(a) or product(*a))
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, ours.weight), atol=1e-5, rtol=1e-5)
    assert seen == []  # traced as F.linear, never the oneDNN op


def _gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny-llama", dropout=dropout, attention_dropout=0.0)
    return GPT(config)


def test_onednn_linears_swaps_every_linear_and_gives_the_model_back():
    model = _gpt().eval()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    keys, text = list(model.state_dict()), repr(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
    with onednn_linears(model) as same:
        assert same is model
        swapped = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert swapped == linears  # the same objects, their class changed
        assert all(type(m) is (OneDNNLinear if ONEDNN else nn.Linear) for m in swapped)
        assert list(model.state_dict()) == keys
        assert repr(model).replace("OneDNNLinear(", "Linear(") == text
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert all(type(m) is nn.Linear for m in linears)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.7])
def test_fused_cross_entropy_equals_pytorch(reduction, smoothing):
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(37, 11, generator=generator, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (37,), generator=generator)
    targets[::4] = 7  # an ignore_index other than -100
    options = {"ignore_index": 7, "reduction": reduction, "label_smoothing": smoothing}
    expected = F.cross_entropy(logits, targets, **options)
    (expected_grad,) = torch.autograd.grad(2.5 * expected, logits)
    ours = fused_cross_entropy(logits, targets, **options)
    (grad,) = torch.autograd.grad(2.5 * ours, logits)  # an upstream gradient other than 1
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_inside_fused_losses_the_loss_on_the_models_logits_runs_fused_where_served():
    model = _gpt().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    targets = ids.flatten().clone()
    targets[:5] = -100
    params = list(model.parameters())

    def loss_of(logits, **options):  # as the gpt task takes it: a view of the logits, in fp32
        flat = logits.flatten(0, 1).float()  # (B * L, V)
        return F.cross_entropy(flat, targets, reduction="sum", label_smoothing=0.1, **options)

    expected = loss_of(model(ids).logits)
    expected_grads = torch.autograd.grad(expected, params)
    with fused_losses(model) as same:
        assert same is model
        logits = model(ids).logits
        assert type(logits) is LossInput
        loss = loss_of(logits)
        assert type(loss.grad_fn).__name__ == "_FusedCrossEntropyBackward"
        grads = torch.autograd.grad(loss, params)
        plain = {  # calls it does not serve
            "weights": loss_of(logits, weight=torch.ones(model.config.vocab_size)),
            "no reduction": F.cross_entropy(logits[0], ids[0], reduction="none"),
            "bf16": F.cross_entropy(logits[0].bfloat16(), ids[0]),
        }
        with torch.no_grad():
            unmarked = model(ids).logits  # no gradient: nothing to fuse
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    for name, value in plain.items():
        assert "Fused" not in type(value.grad_fn).__name__, name
    assert type(unmarked) is torch.Tensor and type(model(ids).logits) is torch.Tensor


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_gradient_matches_finite_differences_in_float64(reduction):
    """gradcheck runs two backwards through one graph, which the fused backward refuses (see
    below); central differences along random directions check the same thing."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 4, -100, 2, 2, -100, 1])
    options = {"reduction": reduction, "label_smoothing": 0.2}
    (grad,) = torch.autograd.grad(fused_cross_entropy(logits, targets, **options), logits)
    h = 1e-6
    with torch.no_grad():
        for _ in range(5):
            direction = torch.randn(7, 5, generator=generator, dtype=torch.float64)
            ahead = fused_cross_entropy(logits + h * direction, targets, **options)
            behind = fused_cross_entropy(logits - h * direction, targets, **options)
            numeric = (ahead - behind) / (2 * h)
            torch.testing.assert_close(numeric, (grad * direction).sum(), rtol=1e-6, atol=1e-8)


def test_fused_mean_over_no_labelled_target_is_nan_as_pytorchs_and_runs_backward_once():
    logits = torch.randn(6, 5, requires_grad=True)
    targets = torch.full((6,), -100)
    assert torch.isnan(F.cross_entropy(logits, targets))
    loss = fused_cross_entropy(logits, targets)
    loss.backward(retain_graph=True)
    assert torch.isnan(loss) and logits.grad.abs().max() == 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the saved log-probabilities hold the gradient now


def test_a_loss_the_model_takes_itself_is_pytorchs_inside_the_block():
    model = _gpt().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    expected = model(ids, labels=ids).loss
    with fused_losses(model):
        output = model(ids, labels=ids)
    assert torch.equal(output.loss, expected) and type(output.loss) is LossInput
    assert "Fused" not in type(output.loss.grad_fn.next_functions[0][0]).__name__


def test_speed_up_applies_what_it_chooses_here_and_follows_pinned_kernels():
    model = _gpt(dropout=0.1)
    kinds = {}
    with speed_up(model):
        kinds = {type(m) for m in model.modules()}
        model(torch.randint(0, 50, (2, 5)), labels=torch.randint(0, 50, (2, 5))).loss.backward()
    choices = speed_up_choices()
    assert (OneDNNLinear in kinds) == bool(choices["onednn_linears"])
    assert (FastRotaryEmbedding in kinds) == bool(choices["fast_rope"])
    stand_ins = {OneDNNLinear, FastRotaryEmbedding}
    assert not stand_ins & {type(m) for m in model.modules()}
    if ONEDNN:
        other = not choices["onednn_linears"]
        with capabilities.kernels_as({"onednn_fp32_linears": other}), speed_up(model):
            assert (type(model.lm_head) is OneDNNLinear) is other


def test_swapped_classes_refuses_a_stand_in_that_is_not_a_subclass_and_restores_on_error():
    model = nn.Sequential(nn.Linear(2, 2))
    refused = pytest.raises(TypeError, match="stand_ins: expected a subclass of Linear")
    with refused, swapped_classes(model, {nn.Linear: nn.Dropout}):
        pass
    with (
        pytest.raises(RuntimeError, match="inside"),
        swapped_classes(model, {nn.Linear: OneDNNLinear}),
    ):
        assert type(model[0]) is OneDNNLinear
        raise RuntimeError("inside")
    assert type(model[0]) is nn.Linear
    not_a_model = pytest.raises(TypeError, match="model: expected an nn.Module, got str")
    with not_a_model, speed_up("model"):
        pass


@needs_onednn
def test_packed_linears_inside_onednn_linears_packs_them_and_gives_them_back():
    model = _gpt().eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
    with onednn_linears(model), packed_linears(model):
        assert not any(isinstance(m, nn.Linear) for m in model.modules())  # all packed
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=0)
        assert type(model.lm_head) is PackedLinear
    assert type(model.lm_head) is nn.Linear


def test_a_run_cut_in_two_ends_on_the_straight_runs_weights_bit_for_bit():
    """What a resumed training run does: leave the block, come back with the RNG state of the
    cut and the same choices; dropout masks, fused losses and rotations then repeat exactly."""
    ids = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(2))

    def steps(model, optimizer, count):
        with speed_up(model):
            for _ in range(count):
                model(ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()

    straight = _gpt(dropout=0.2).train()
    optimizer = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    torch.manual_seed(5)
    steps(straight, optimizer, 4)
    cut = _gpt(dropout=0.2).train()
    optimizer = torch.optim.AdamW(cut.parameters(), lr=1e-2)
    torch.manual_seed(5)
    steps(cut, optimizer, 2)
    rng = torch.get_rng_state()
    torch.manual_seed(123)  # whatever ran in between
    torch.set_rng_state(rng)
    steps(cut, optimizer, 2)
    for (name, a), b in zip(straight.state_dict().items(), cut.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
