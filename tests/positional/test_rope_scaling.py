"""RoPE scaling (linear, dynamic NTK, YaRN, Llama 3) against Hugging Face transformers: the
inverse frequencies of `ROPE_INIT_FUNCTIONS`, the cos/sin of `LlamaRotaryEmbedding`, and the
logits of tiny `LlamaForCausalLM`s loaded by `GPT.from_pretrained` past their training context."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from qkv.models.checkpoints import CheckpointError
from qkv.models.gpt import GPT, GPTConfig
from qkv.positional import RopeScaling, RotaryEmbedding, rope_cos_sin
from qkv.positional.rope_scaling import scaled_inverse_frequencies
from qkv.positional.rope_scaling_hf import scaling_from_hf

# (name, rope_scaling, rope_theta, head_dim, max_position_embeddings)
CASES = [
    ("linear", {"rope_type": "linear", "factor": 4.0}, 10000.0, 64, 256),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, 10000.0, 64, 256),
    ("dynamic-legacy-type", {"type": "dynamic", "factor": 3.0}, 500.0, 32, 128),
    (
        "yarn",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        10000.0, 64, 256,
    ),
    (
        "yarn-mscale",
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
        10000.0, 64, 2560,
    ),
    (
        "yarn-attention-factor-untruncated",
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
         "attention_factor": 1.5, "truncate": False},
        10000.0, 32, 1024,
    ),
    (
        "llama3.1",  # the published Llama 3.1 values
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        500000.0, 128, 131072,
    ),
    (
        "llama3-small",
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.5, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        10000.0, 32, 256,
    ),
]  # fmt: skip
IDS = [case[0] for case in CASES]


def _hf_config(rope_scaling: dict, theta: float, head_dim: int, max_positions: int):
    return transformers.LlamaConfig(
        vocab_size=16, hidden_size=head_dim * 2, num_attention_heads=2, intermediate_size=8,
        num_hidden_layers=1, max_position_embeddings=max_positions, rope_theta=theta,
        rope_scaling=dict(rope_scaling),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "rope_scaling", "theta", "head_dim", "max_positions"), CASES, ids=IDS
)
def test_inverse_frequencies_and_attention_factor_match_transformers(
    name, rope_scaling, theta, head_dim, max_positions
):
    config = _hf_config(rope_scaling, theta, head_dim, max_positions)
    kind = config.rope_parameters["rope_type"]
    scaling = scaling_from_hf(config.rope_parameters, max_positions=max_positions)
    for length in (max_positions // 2, max_positions, 3 * max_positions + 5):
        expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
        positions = torch.arange(length)  # dynamic NTK's length: the largest position + 1
        got = scaled_inverse_frequencies(
            head_dim, theta, scaling, positions=positions, dtype=torch.float32
        )
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        assert scaling.attention_scale() == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "rope_scaling", "theta", "head_dim", "max_positions"), CASES, ids=IDS
)
def test_cos_sin_match_llama_rotary_embedding(name, rope_scaling, theta, head_dim, max_positions):
    """(B, L) positions past the training context: dynamic NTK grows its base for them."""
    config = _hf_config(rope_scaling, theta, head_dim, max_positions)
    length = min(max_positions + 40, 4096)
    positions = torch.arange(length).repeat(2, 1)  # (B, L)
    positions[1] += 3  # the second row's largest position sets dynamic NTK's length
    expected_cos, expected_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    scaling = scaling_from_hf(config.rope_parameters, max_positions=max_positions)
    cos, sin = rope_cos_sin(positions, head_dim, base=theta, scaling=scaling)
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=2e-5)


def test_rotary_embedding_with_scaling_applies_its_cos_sin():
    scaling = RopeScaling(kind="yarn", factor=4.0, original_max_positions=16)
    rope = RotaryEmbedding(16, base=500.0, scaling=scaling)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16)
    cos, sin = rope_cos_sin(torch.arange(40), 16, base=500.0, scaling=scaling)
    half = torch.cat((-k[..., 8:], k[..., :8]), dim=-1)
    torch.testing.assert_close(rope(q, k)[1], k * cos + half * sin)
    assert "yarn" in repr(rope)


def test_no_scaling_and_dynamic_within_the_original_length_are_plain_rope_bit_for_bit():
    positions = torch.arange(100)
    plain = rope_cos_sin(positions, 32, base=500.0)
    short = RopeScaling(kind="dynamic", factor=2.0, original_max_positions=100)
    for scaling in (None, short):
        cos, sin = rope_cos_sin(positions, 32, base=500.0, scaling=scaling)
        assert torch.equal(cos, plain[0]) and torch.equal(sin, plain[1])


TINY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
TINY_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.25,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 16},
    # L_orig 37: the decoding test below prefills 36 tokens on short factors, then crosses it
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 37,
                 "short_factor": [1.0, 1.1, 1.3, 2.0] * 2,
                 "long_factor": [1.0, 3.0, 8.0, 20.0] * 2},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0},
}  # fmt: skip


def _tiny_llama(rope_scaling: dict) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, rope_theta=500.0, rope_scaling=dict(rope_scaling))
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # weights large enough that a wrong rotation shows
        for parameter_name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.3)
            if "norm" in parameter_name:
                parameter.add_(1.0)
    return model.eval()


@pytest.mark.parametrize("kind", list(TINY_SCALINGS))
def test_llama_with_rope_scaling_loads_saves_and_matches_transformers(kind, tmp_path):
    """Logits at 48 positions, past max_position_embeddings (32) and the original length (16),
    then qkv's save_pretrained writes the rule back for transformers and for qkv."""
    reference = _tiny_llama(TINY_SCALINGS[kind])
    reference.save_pretrained(tmp_path / "hf")
    model = GPT.from_pretrained(tmp_path / "hf")
    assert model.config.rope_scaling.kind == kind
    input_ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=input_ids).logits
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=0, atol=1e-5)

    model.save_pretrained(tmp_path / "qkv")
    written = json.loads((tmp_path / "qkv" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == kind
    assert written["rope_scaling"]["factor"] == TINY_SCALINGS[kind]["factor"]
    assert written["rope_scaling"] == {**TINY_SCALINGS[kind], **written["rope_scaling"]}
    assert GPT.from_pretrained(tmp_path / "qkv").config.rope_scaling == model.config.rope_scaling
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "qkv").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=input_ids).logits, expected, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, r"missing \['short_factor', 'long_factor'\]"),
        ({"rope_type": "axial"}, "rope_type 'axial' is not supported"),
        ({"factor": 2.0}, "rope_type 'default' is plain RoPE"),
        ({"rope_type": "linear"}, r"requires \['factor'\]"),
        ({"rope_type": "linear", "factor": None}, "factor: expected a number, got None"),
        ({"rope_type": "linear", "factor": -2.0}, "factor: expected a finite number > 0, got -2.0"),
        ({"rope_type": "yarn", "factor": 2.0}, "original_max_positions: expected an int, got None"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": None},
         "original_max_positions: expected an int, got None"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
         "partial_rotary_factor"),
    ],
)  # fmt: skip
def test_bad_rope_scaling_is_refused_naming_it(rope_scaling, message):
    with pytest.raises((ValueError, TypeError), match=f"rope_scaling: .*{message}"):
        scaling_from_hf(rope_scaling)


def test_bad_rope_scaling_in_a_checkpoint_is_refused(tmp_path):
    _tiny_llama(TINY_SCALINGS["linear"]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["factor"] = "2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope_scaling: factor: expected a number, got '2'"):
        GPT.from_pretrained(tmp_path)


def test_gpt_config_carries_rope_scaling():
    config = GPTConfig.from_name("tiny-llama", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert config.rope_scaling == RopeScaling(kind="yarn", factor=2.0, original_max_positions=64)
    fields = dataclasses.asdict(config.rope_scaling)
    assert GPTConfig.from_name("tiny-llama", rope_scaling=fields) == config
    assert GPTConfig.from_name("tiny-llama").rope_scaling is None
    with pytest.raises(ValueError, match="rope_scaling: given .* position='learned'"):
        GPTConfig.from_name("tiny-gpt2", rope_scaling=RopeScaling(kind="linear", factor=2.0))
    with pytest.raises(TypeError, match="rope_scaling: expected None"):
        GPTConfig.from_name("tiny-llama", rope_scaling=2.0)


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_cached_decoding_past_the_training_context_matches_transformers(kind, tmp_path):
    """Prefill 36 tokens, then decode 4 one by one: dynamic NTK grows its base with every new
    position, and LongRoPE switches to its long factors at position 37 (L_orig 37), for the new
    token only (cached keys keep their rotation), as transformers does."""
    from qkv.layers.kv_cache import StaticKVCache

    reference = _tiny_llama(TINY_SCALINGS[kind])
    reference.save_pretrained(tmp_path)
    model = GPT.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    config = model.config
    cache = StaticKVCache(
        num_layers=config.num_layers, batch=1, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_length=40,
    )  # fmt: skip
    hf_cache = transformers.DynamicCache(config=reference.config)
    with torch.no_grad():
        for start, end in ((0, 36), (36, 37), (37, 38), (38, 39), (39, 40)):
            got = model(input_ids[:, start:end], cache=cache).logits
            expected = reference(
                input_ids=input_ids[:, start:end], cache=hf_cache, use_cache=True
            ).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_qkv_checkpoints_keep_the_scaling_and_sink_caches_apply_it(tmp_path):
    """qkv's own save/load round-trips the rule; a StreamingLLM cache that evicts nothing yet
    (the window holds every token) re-rotates its keys with the same scaled angles as the
    plain cache, so both decode the same tokens."""
    from qkv.generation import decode_steps, generate
    from qkv.models import load, save

    config = GPTConfig.from_name(
        "tiny-llama", rope_scaling={"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()
    reloaded = load(save(model, tmp_path / "model"))
    assert reloaded.config.rope_scaling == config.rope_scaling
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, 20), generator=generator)
    plain = [s.logits for s in decode_steps(model, prompt, max_new_tokens=12)]
    sinks = [s.logits for s in decode_steps(model, prompt, max_new_tokens=12,
                                            sinks=(4, 60))]  # fmt: skip
    for ours, theirs in zip(sinks, plain, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    tokens = generate(model, prompt, max_new_tokens=12)
    assert torch.equal(generate(reloaded, prompt, max_new_tokens=12), tokens)
