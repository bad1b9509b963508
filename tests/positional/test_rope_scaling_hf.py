"""RoPE scaling objects read as transformers 5 reads them: the leftovers it accepts with a warning
(and what it computes then), rope_type "default" as plain RoPE, LongRoPE and proportional RoPE;
each against transformers' own `ROPE_INIT_FUNCTIONS` / `LlamaRotaryEmbedding` on the same dict."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from qkv.models.gpt import GPTConfig
from qkv.positional import RopeScaling, rope_cos_sin
from qkv.positional.rope_scaling import scaled_inverse_frequencies
from qkv.positional.rope_scaling_hf import rope_scaling_from_hf, scaling_from_hf, scaling_to_hf

HEAD_DIM, MAX_POSITIONS, THETA = 32, 256, 10000.0
LOGGER = "qkv.positional.rope_scaling"


def _hf_config(rope_scaling: dict, *, max_positions: int = MAX_POSITIONS):
    return transformers.LlamaConfig(
        vocab_size=16, hidden_size=2 * HEAD_DIM, num_attention_heads=2, intermediate_size=8,
        num_hidden_layers=1, max_position_embeddings=max_positions, rope_theta=THETA,
        rope_scaling=copy.deepcopy(rope_scaling),
    )  # fmt: skip


def _assert_matches_transformers(rope_scaling: dict, lengths=(64, 65, 300)) -> RopeScaling:
    """qkv's inverse frequencies and attention scale equal those of transformers'
    ROPE_INIT_FUNCTIONS on the same dict, for sequences of each length (longrope and dynamic
    read it); returns qkv's rule."""
    config = _hf_config(rope_scaling)
    kind = config.rope_parameters["rope_type"]
    scaling = scaling_from_hf(config.rope_parameters, max_positions=MAX_POSITIONS)
    for length in lengths:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
        got = scaled_inverse_frequencies(
            HEAD_DIM, THETA, scaling, positions=torch.arange(length), dtype=torch.float32
        )
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        assert scaling.attention_scale() == pytest.approx(attention_factor, rel=1e-12)
    return scaling


# (rope_scaling as checkpoints carry it, what qkv's warning says)
LEFTOVERS = {
    "linear-with-original-length": (
        {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64},
        "does not read ['original_max_position_embeddings']",
    ),
    "yarn-factor-null": (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
        "factor is null",
    ),
    "llama3-equal-freq-factors": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
         "original_max_position_embeddings": 64},
        "high_freq_factor 2.0 is not above low_freq_factor 2.0",
    ),
    "llama3-high-below-low": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
         "original_max_position_embeddings": 64},
        "high_freq_factor 1.0 is not above low_freq_factor 4.0",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LEFTOVERS))
def test_leftovers_transformers_warns_about_are_accepted_and_computed_as_it_does(name, caplog):
    rope_scaling, warning = LEFTOVERS[name]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _assert_matches_transformers(rope_scaling)
    assert warning in caplog.text


def test_yarn_factor_null_is_the_ratio_of_the_lengths_and_needs_them():
    scaling = _assert_matches_transformers(LEFTOVERS["yarn-factor-null"][0])
    assert scaling.factor == MAX_POSITIONS / 64
    with pytest.raises(ValueError, match="rope_scaling: factor: null"):
        scaling_from_hf(LEFTOVERS["yarn-factor-null"][0])  # no max_position_embeddings


def test_llama3_equal_freq_factors_refuses_the_wavelength_transformers_makes_nan():
    """Pair 0 has wavelength 2 pi; with low = high = L_orig / (2 pi) its blend weight is 0 / 0."""
    factor = 64 / (2 * math.pi)
    rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": factor,
                    "high_freq_factor": factor, "original_max_position_embeddings": 64}  # fmt: skip
    config = _hf_config(rope_scaling)
    assert ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].isnan().any()
    scaling = scaling_from_hf(config.rope_parameters, max_positions=MAX_POSITIONS)
    with pytest.raises(ValueError, match="rope_scaling: high_freq_factor: equal to low_freq"):
        rope_cos_sin(torch.arange(8), HEAD_DIM, base=THETA, scaling=scaling)


def test_rope_type_default_is_plain_rope_in_gpt_config():
    rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    config = GPTConfig.from_name("tiny-llama", rope_scaling=dict(rope_parameters))
    assert config.rope_scaling is None
    assert config == GPTConfig.from_name("tiny-llama")
    hf_config = transformers.LlamaConfig(
        hidden_size=config.embed_dim, num_attention_heads=config.num_heads,
        rope_parameters=dict(rope_parameters),
    )  # fmt: skip
    positions = torch.arange(100)
    expected = LlamaRotaryEmbedding(hf_config)(torch.zeros(1), positions[None])
    got = rope_cos_sin(positions, config.head_dim, base=config.rope_base, scaling=None)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="rope_scaling: rope_theta is 500.0, but rope_base="):
        GPTConfig.from_name(
            "tiny-llama", rope_scaling={"rope_type": "default", "rope_theta": 500.0}
        )
    assert (
        rope_scaling_from_hf({"factor": 2.0}) is None
    )  # no rope_type: "default", as in transformers


LONGROPE = {
    "rope_type": "longrope", "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [1.5 + 0.75 * i for i in range(HEAD_DIM // 2)],
}  # fmt: skip
NEW_KINDS = {
    "longrope-factor-from-lengths": LONGROPE,  # Phi-3: factor = max / original, warned
    "longrope-factor": {**LONGROPE, "factor": 3.0},
    "longrope-attention-factor": {**LONGROPE, "factor": 3.0, "attention_factor": 1.3},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    "proportional-factor": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.4,
        "factor": 2.0,
    },  # fmt: skip
    "proportional-whole-head": {"rope_type": "proportional"},
}


@pytest.mark.parametrize("name", list(NEW_KINDS))
def test_longrope_and_proportional_match_transformers(name):
    """Short factors up to L_orig = 64 positions, long ones past it (lengths 64, 65, 300)."""
    scaling = _assert_matches_transformers(NEW_KINDS[name])
    assert scaling_from_hf(scaling_to_hf(scaling)) == scaling
    config = GPTConfig.from_name(
        "tiny-llama", embed_dim=4 * HEAD_DIM, max_positions=256, rope_scaling=scaling_to_hf(scaling)
    )
    assert config.head_dim == HEAD_DIM and config.rope_scaling == scaling


@pytest.mark.parametrize("name", ["longrope-factor-from-lengths", "proportional-factor"])
def test_longrope_and_proportional_cos_sin_match_llama_rotary_embedding(name):
    """LlamaRotaryEmbedding switches to the long factors when a call's largest position + 1
    passes L_orig (dynamic_rope_update); qkv does the same per call."""
    config = _hf_config(NEW_KINDS[name])
    reference = LlamaRotaryEmbedding(config)
    scaling = scaling_from_hf(config.rope_parameters, max_positions=MAX_POSITIONS)
    for length in (40, 64, 65, 200, 30):  # short, at L_orig, past it, then short again
        positions = torch.arange(length).repeat(2, 1)  # (B, L)
        expected_cos, expected_sin = reference(torch.zeros(1), positions)
        cos, sin = rope_cos_sin(positions, HEAD_DIM, base=THETA, scaling=scaling)
        torch.testing.assert_close(cos, expected_cos, rtol=0, atol=2e-5)
        torch.testing.assert_close(sin, expected_sin, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        ({"rope_type": "longrope", "short_factor": [1.0] * 16}, r"missing \['long_factor'\]"),
        ({**LONGROPE, "short_factor": [1.0] * 15 + [0.0]}, "short_factor: expected a finite"),
        ({**LONGROPE, "original_max_position_embeddings": 1, "factor": 2.0},
         "original_max_positions: 1"),
        ({"rope_type": "proportional", "partial_rotary_factor": 1.5},
         r"rotary_fraction \(partial_rotary_factor\): expected a number in \[0, 1\]"),
        ({"rope_type": "proportional", "factor": None}, "factor: expected a number, got None"),
    ],
)  # fmt: skip
def test_longrope_and_proportional_values_transformers_cannot_compute_are_refused(
    rope_scaling, message
):
    with pytest.raises((ValueError, TypeError), match=f"rope_scaling: .*{message}"):
        scaling_from_hf(rope_scaling, max_positions=MAX_POSITIONS)


def test_longrope_factor_lists_must_fit_the_head():
    scaling = scaling_from_hf({**LONGROPE, "factor": 2.0})
    with pytest.raises(ValueError, match=r"short_factor: expected head_dim / 2 = 4 numbers"):
        GPTConfig.from_name("tiny-llama", rope_scaling=scaling)  # head_dim 8, 16 factors
    with pytest.raises(ValueError, match="short_factor: expected head_dim / 2 = 8"):
        rope_cos_sin(torch.arange(4), 16, scaling=scaling)
