"""FastRotaryEmbedding against the plain RotaryEmbedding (itself tested against Hugging Face's
Llama): the same bits, its tables computed once per call of the model, nothing kept between
calls, and the model given back."""

import pytest
import torch

from qkv.acceleration import FastRotaryEmbedding, fast_rope, fast_rotary
from qkv.generation import generate
from qkv.models import GPT, GPTConfig
from qkv.positional import RotaryEmbedding
from qkv.positional import rotary as rotary_module


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("positions", [None, "row", "batch"])
def test_the_same_bits_as_the_plain_module(layout, dtype, positions):
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 5, 16).to(dtype), torch.randn(2, 2, 5, 16).to(dtype)
    given = {None: None, "row": torch.arange(3, 8), "batch": torch.randint(0, 50, (2, 5))}
    plain = RotaryEmbedding(16, layout=layout, base=500.0)
    expected = plain(q, k, given[positions])
    fast = RotaryEmbedding(16, layout=layout, base=500.0)
    fast.__class__ = FastRotaryEmbedding  # what fast_rope does to a model's own module
    for got, want in zip(fast(q, k, given[positions]), expected, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny-llama")).eval()


def _counting(monkeypatch) -> list:
    calls = []
    original = rotary_module.rope_cos_sin
    monkeypatch.setattr(
        rotary_module, "rope_cos_sin", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    return calls


def test_a_model_call_computes_its_tables_once_and_sees_positions_changed_in_place(monkeypatch):
    model = _gpt()
    assert model.config.num_layers > 1
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    positions = torch.arange(7)
    with torch.no_grad():
        expected = model(ids, position_ids=positions).logits
        shifted = model(ids, position_ids=positions + 5).logits
    calls = _counting(monkeypatch)
    with fast_rope(model), torch.no_grad():
        assert torch.equal(model(ids, position_ids=positions).logits, expected)
        assert len(calls) == 1
        positions += 5  # the same tensor, changed in place between two calls
        assert torch.equal(model(ids, position_ids=positions).logits, shifted)
        assert len(calls) == 2
        # a call past the model's hooks (as torch.compile's) computes them at every layer
        direct = type(model).forward(model, ids, position_ids=positions).logits
        assert torch.equal(direct, shifted) and len(calls) == 2 + model.config.num_layers


def test_decoding_gives_the_same_tokens_and_a_failed_call_keeps_nothing():
    model = _gpt()
    prompt = torch.randint(0, model.config.vocab_size, (2, 5))
    expected = generate(model, prompt, max_new_tokens=6)
    with fast_rope(model):
        assert torch.equal(generate(model, prompt, max_new_tokens=6), expected)
        call = fast_rotary._CALLS[model.blocks[0].self_attn.rope]
        with pytest.raises(ValueError, match="input_ids"):
            model(torch.full((1, 3), model.config.vocab_size))
        assert call.depth == 0 and call.tables == []


def test_tables_of_inference_mode_are_not_reused_by_a_call_with_gradients():
    model = _gpt()
    ids = torch.randint(0, model.config.vocab_size, (1, 4))
    with fast_rope(model):
        with torch.inference_mode():
            model(ids)
        model(ids).logits.sum().backward()  # inference tensors cannot be saved for backward
    assert model.lm_head.weight.grad is not None


def test_the_model_is_given_back():
    model = _gpt()
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    rope = model.blocks[0].self_attn.rope
    with fast_rope(model) as same:
        assert same is model and type(rope) is FastRotaryEmbedding
    assert type(rope) is RotaryEmbedding and rope not in fast_rotary._CALLS
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    with pytest.raises(TypeError, match="model: expected an nn.Module, got int"), fast_rope(3):
        pass
