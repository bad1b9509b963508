"""GPT's position kinds beyond learned and RoPE: sinusoidal, ALiBi, T5's bias, none.

Each is checked where it enters the model against a formula written here from its paper (or
transformers' T5 code), and the RoPE-scaled context reaches `qkv.generate` and `qkv cost`.
Cached decoding for every kind is in tests/generation.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

from qkv.analysis.cost.estimate import cost_report
from qkv.generation import generate
from qkv.models import GPT, GPTConfig
from qkv.models.sizes import parameter_count
from qkv.positional import RopeScaling
from tests.generation.reference_models import redraw

H, E, L = 4, 32, 12


def _model(position: str, **overrides) -> GPT:
    sizes = {"vocab_size": 50, "embed_dim": E, "num_layers": 2, "num_heads": H, "ffn_dim": 64}
    config = GPTConfig(**{**sizes, "max_positions": 32, "position": position, **overrides})
    torch.manual_seed(0)
    return redraw(GPT(config))


def _biases_seen(model: GPT, ids: torch.Tensor) -> list[torch.Tensor]:
    seen = []
    for block in model.blocks:
        block.self_attn.register_attention_hook(lambda m, q, k, **kw: seen.append(kw["bias"]))
    with torch.no_grad():
        model(ids)
    return seen


def test_alibi_bias_is_the_papers_in_every_layer():
    """Press et al. 2022, s3: -m_h * (i - j) with m_h = 2^(-8 h / H), h = 1 .. H."""
    model = _model("alibi")
    i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
    slopes = torch.tensor([2.0 ** (-8 * h / H) for h in range(1, H + 1)]).view(H, 1, 1)
    expected = (-slopes * (i - j).abs()).unsqueeze(0)  # (1, H, L, L)
    seen = _biases_seen(model, torch.randint(0, 50, (2, L)))
    assert len(seen) == 2
    for bias in seen:
        torch.testing.assert_close(bias, expected)


def test_t5_bias_is_transformers_decoder_bias_shared_by_the_layers():
    model = _model("t5")
    config = transformers.T5Config(d_model=E, d_kv=E // H, num_heads=H, is_decoder=True)
    theirs = T5Attention(config, has_relative_attention_bias=True)
    with torch.no_grad():
        theirs.relative_attention_bias.weight.copy_(
            model.relative_bias.relative_attention_bias.weight
        )
        expected = theirs.compute_bias(L, L)  # (1, H, L, L)
    seen = _biases_seen(model, torch.randint(0, 50, (2, L)))
    for bias in seen:
        torch.testing.assert_close(bias, expected)
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())


def test_t5_bias_table_trains():
    model = _model("t5").train()
    ids = torch.randint(0, 50, (2, L))
    model(ids, labels=ids).loss.backward()
    grad = model.relative_bias.relative_attention_bias.weight.grad
    assert grad is not None and grad[: L // 2].abs().min() > 0  # each short distance is used


def test_sinusoidal_positions_are_added_to_the_embeddings():
    """PE(pos, 2i) = sin(pos / 10000^(2i/E)), PE(pos, 2i + 1) = cos(...) (Vaswani et al. s3.5),
    at the given position_ids."""
    model = _model("sinusoidal")
    ids, positions = torch.randint(0, 50, (2, L)), torch.arange(L).repeat(2, 1) + 5
    captured = []
    model.dropout.register_forward_hook(lambda m, args, out: captured.append(out))
    with torch.no_grad():
        model(ids, position_ids=positions)
    pos = positions.double().unsqueeze(-1)  # (2, L, 1)
    frequencies = torch.tensor([10000.0 ** (-2 * i / E) for i in range(E // 2)], dtype=torch.double)
    table = torch.stack([torch.sin(pos * frequencies), torch.cos(pos * frequencies)], dim=-1)
    tokens = model.token_embedding(ids) * E**0.5  # scaled as in Vaswani et al. s3.4
    expected = tokens + table.flatten(-2).float()  # interleaved sin, cos
    torch.testing.assert_close(captured[0], expected)


def test_without_positions_one_layer_cannot_order_the_prefix():
    """No positions (Haviv et al. 2022): in one causal layer the last token's output is a
    function of the set of earlier tokens, so any permutation of them leaves it unchanged;
    with RoPE it does not."""
    ids = torch.randint(0, 50, (1, L))
    permuted = torch.cat([ids[:, : L - 1].flip(1), ids[:, -1:]], dim=1)
    for position, unchanged in (("none", True), ("rope", False)):
        model = _model(position, num_layers=1)
        with torch.no_grad():
            last, last_permuted = model(ids).logits[0, -1], model(permuted).logits[0, -1]
        assert torch.allclose(last, last_permuted, atol=1e-5) is unchanged, position


def test_rope_scaling_extends_the_context_generate_and_cost_accept():
    """A linear factor of 4 on a 32-position model: 128 tokens (Chen et al. 2023); YaRN's
    factor times its original context; without scaling, max_positions."""
    linear = _model("rope", rope_scaling=RopeScaling(kind="linear", factor=4.0))
    assert linear.config.context_length == 128
    yarn = RopeScaling(kind="yarn", factor=8.0, original_max_positions=16)
    assert _model("rope", rope_scaling=yarn).config.context_length == 128
    assert _model("rope").config.context_length == 32
    prompt = torch.randint(0, 50, (1, 40))
    assert generate(linear, prompt, max_new_tokens=50).shape == (1, 90)
    with pytest.raises(ValueError, match=r"input_ids: 40 prompt tokens .* context of 32"):
        generate(_model("rope"), prompt, max_new_tokens=50)
    report = cost_report(linear.config)
    assert report.context == 128
    at_128 = cost_report(linear.config, context=128)
    assert report.kv_cache_bytes_per_sample == at_128.kv_cache_bytes_per_sample


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position": "absolute"}, r"position: expected one of"),
        ({"position": "t5", "relative_buckets": 32, "relative_max_distance": 16},
         r"relative_max_distance: expected more than relative_buckets // 2 = 16"),
        ({"relative_buckets": 0}, r"relative_buckets"),
    ],
)  # fmt: skip
def test_bad_position_settings_name_the_field(change, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _model(**{"position": "rope", **change})


def test_sinks_refuse_positions_added_to_embeddings():
    model = _model("sinusoidal")
    with pytest.raises(ValueError, match=r"sinks: .*'sinusoidal'"):
        generate(model, torch.randint(0, 50, (1, 4)), max_new_tokens=3, sinks=(2, 6))


def test_initialisation_zeroes_biases_and_t5_tables():
    """GPT-2's rule (Radford et al. 2019): N(0, 0.02^2) weights and zero biases."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny-gpt2", position="t5"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    biases = [m.bias for m in linears if m.bias is not None]
    assert len(biases) == len(linears) - 1  # every projection but the (tied) head
    assert all(torch.all(b == 0) for b in biases)
    assert torch.all(model.relative_bias.relative_attention_bias.weight == 0)
    assert 0.015 < model.blocks[0].self_attn.q_proj.weight.std() < 0.025


def test_sinusoidal_token_embeddings_are_as_large_as_the_sinusoids():
    """Vaswani et al. s3.4: embeddings multiplied by sqrt(E), initialised N(0, 1/E)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny-llama", position="sinusoidal", vocab_size=2000))
    scaled = model.token_embedding.weight * E**0.5
    assert 0.9 < scaled.std() < 1.1
