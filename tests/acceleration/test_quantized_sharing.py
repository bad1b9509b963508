"""`share_quantized_inputs`: the quantized linears of one module that read one input (q, k and
v; gate and up) are one int4pack product from the second call on, with the very outputs of
their own products (each output row's sum is the same), and their codes are views of one
layout (no memory added for them). Checked against each layer's own product, which
tests/acceleration/test_quantized.py checks against the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.acceleration import quantize, quantized_kernels, quantized_models, quantized_sharing
from qkv.acceleration import quantized as quantized_module
from qkv.acceleration.quantized import QuantizedLinear
from qkv.generation import decode_steps
from qkv.models import GPT, GPTConfig

NEW_TOKENS = 6
# every projection a multiple of 64 rows: q and out 128, k and v 64, gate and up 192
CONFIG = GPTConfig(vocab_size=96, embed_dim=128, num_layers=2, num_heads=2, num_kv_heads=1,
                   ffn_dim=192, max_positions=64, position="rope", norm="rmsnorm",
                   ffn="swiglu", bias=False)  # fmt: skip


def _model(kind: str, share: bool, monkeypatch) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    with monkeypatch.context() as patch:
        if not share:
            patch.setattr(quantized_models, "share_quantized_inputs", lambda m: m)
        return quantize(model, kind)


def _decode(model: GPT, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, new), logits (B, new, V)) of greedy decoding."""
    steps = list(decode_steps(model, prompt, max_new_tokens=NEW_TOKENS))
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


@pytest.fixture
def counted(monkeypatch):
    """The number of int4pack products computed, by any layer or shared product."""
    calls = []
    product = quantized_kernels.int4pack_product

    def counting(*args):
        calls.append(args[-1])  # the output width
        return product(*args)

    monkeypatch.setattr(quantized_module, "int4pack_product", counting)
    monkeypatch.setattr(quantized_sharing, "int4pack_product", counting)
    return calls


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_one_product_for_the_layers_that_read_one_input_with_their_own_outputs(
    kind, monkeypatch, counted
):
    shared, alone = _model(kind, True, monkeypatch), _model(kind, False, monkeypatch)
    prompt = torch.arange(3, 10).unsqueeze(0)  # (1, 7)
    expected = _decode(alone, prompt)
    counted.clear()
    tokens, logits = _decode(shared, prompt)
    assert torch.equal(tokens, expected[0]) and torch.equal(logits, expected[1])  # bit for bit
    attn, ffn = shared.blocks[0].self_attn, shared.blocks[0].ffn
    if not quantized_module.int4pack_products():  # e.g. ATEN_CPU_CAPABILITY=default
        assert attn.q_proj._sharing is None and not counted
        return
    sharing = attn.q_proj._sharing[0]
    assert sharing.shares_with(0) == ["k_proj", "v_proj"] and sharing.shares_with(3) == []
    assert ffn.gate_proj._sharing[0].shares_with(0) == ["up_proj"]
    assert ffn.down_proj._sharing is None  # alone of its input width
    joined = attn.q_proj.joined_scales_and_zeros  # (groups, 256, 2): q, k and v's scales
    assert joined.is_contiguous() and joined.data_ptr() == sharing.scales.data_ptr()
    assert torch.equal(joined, torch.cat([m.scales_and_zeros for m in sharing.layers[:3]], 1))
    for index, layer in enumerate(sharing.layers):  # codes and scales: views of the joint ones
        assert layer.packed.untyped_storage().data_ptr() == sharing.packed.data_ptr()
        scales = layer.scales_and_zeros.untyped_storage()
        assert scales.data_ptr() == sharing.scales.untyped_storage().data_ptr()
        assert layer.packed.data_ptr() == sharing.packed[sharing.starts[index]].data_ptr()
    # a step, once learned: q+k+v, out, gate+up, down per layer (a Q8_0 prompt is fp32 chunks)
    per_step = [128 + 64 + 64, 128, 192 + 192, 128] * CONFIG.num_layers
    assert counted[-len(per_step) :] == per_step


def test_a_layer_called_with_another_input_or_laid_out_again_computes_alone(monkeypatch):
    model = _model("Q4_1", True, monkeypatch)
    attn = model.blocks[0].self_attn
    if attn.q_proj._sharing is None:
        assert not quantized_module.int4pack_products()
        return
    x, other = torch.randn(1, 3, 128), torch.randn(1, 3, 128)
    with torch.no_grad():
        for _ in range(2):  # the first round learns, the second shares
            q, k = attn.q_proj(x), attn.k_proj(x)
        assert torch.equal(q, attn.q_proj.product(x)) and torch.equal(k, attn.k_proj.product(x))
        assert torch.equal(attn.v_proj(other), attn.v_proj.product(other))  # not q's input
        unshared = _model("Q4_1", False, monkeypatch).blocks[0].self_attn.v_proj
        assert torch.equal(attn.v_proj(other), unshared(other))  # its scales, a view, read right
        attn.q_proj(x)  # keeps k's and v's slices of x
        x.mul_(2)  # changed in place: the kept slices are not x's any more
        assert torch.equal(attn.k_proj(x), attn.k_proj.product(x))
    attn.k_proj.load_state_dict(attn.k_proj.state_dict())  # laid out again
    assert all(layer._sharing is None for layer in (attn.q_proj, attn.k_proj, attn.v_proj))
    with torch.no_grad():
        assert torch.equal(attn.q_proj(x), attn.q_proj.product(x))
        assert torch.equal(attn.v_proj(x), attn.v_proj.product(x))


def test_row_slices_of_the_packed_layout_hold_wherever_the_int4pack_ops_run():
    """Checked on the build and ISA of this run: AVX-512, AVX2 (`make test-masked`) and the
    portable baseline, whose scalar int4pack code qkv does not use but lays out alike."""
    ops = all(hasattr(torch.ops.aten, op) for op in quantized_module.INT4PACK_OPS)
    assert quantized_sharing.row_slices_hold() == ops


def test_a_layer_under_autograd_computes_alone(monkeypatch):
    model = _model("Q4_1", True, monkeypatch)
    q_proj = model.blocks[0].self_attn.q_proj
    x = torch.randn(2, 128, requires_grad=True)
    q_proj(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert isinstance(q_proj, QuantizedLinear) and not isinstance(q_proj, nn.Linear)
