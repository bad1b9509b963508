"""GPTConfig presets against the published models (parameter counts of transformers' own
classes, built on the meta device, and the numbers the papers give)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from qkv.models.gpt import GPT, GPTConfig


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied matrix is counted once


def _llama(
    hidden: int, layers: int, heads: int, kv_heads: int, ffn: int
) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=32000,
    )  # fmt: skip


# Each preset, with the transformers model it must equal (sizes from the hub's config.json) and
# the published parameter count (GPT-2: Radford et al. 2019 as counted by transformers; Llama 2:
# Touvron et al. 2023; Mistral 7B: Jiang et al. 2023).
PUBLISHED = {
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(), 124_439_808),
    "gpt2-medium": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16),
        354_823_168,
    ),
    "gpt2-large": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(n_embd=1280, n_layer=36, n_head=20),
        774_030_080,
    ),
    "gpt2-xl": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(n_embd=1600, n_layer=48, n_head=25),
        1_557_611_200,
    ),
    "llama-2-7b": (transformers.LlamaForCausalLM, _llama(4096, 32, 32, 32, 11008), 6_738_415_616),
    "llama-2-13b": (
        transformers.LlamaForCausalLM,
        _llama(5120, 40, 40, 40, 13824),
        13_015_864_320,
    ),
    "llama-2-70b": (transformers.LlamaForCausalLM, _llama(8192, 80, 64, 8, 28672), 68_976_648_192),
    "mistral-7b": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            sliding_window=4096,
        ),  # fmt: skip
        7_241_732_096,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_count_equals_transformers(name):
    model_class, hf_config, published = PUBLISHED[name]
    with torch.device("meta"):  # no memory, no initialisation cost
        ours = _count(GPT(GPTConfig.from_name(name)))
        theirs = _count(model_class(hf_config))
    assert ours == theirs == published


def test_gpt2_preset_on_cpu_has_the_tied_count():
    """The real, materialised model (not only the meta one): 124,439,808 with the tied head."""
    model = GPT(GPTConfig.from_name("gpt2"))
    assert model.lm_head.weight is model.token_embedding.weight
    assert _count(model) == 124_439_808


def test_llama_2_70b_kv_cache_is_1_25_gib_where_mha_would_need_10():
    """Llama-2-70B (GQA, H_kv = 8), 4096 tokens, 80 layers, fp16: about
    1.25 GB per sample, where plain MHA would need 10 GB."""
    config = GPTConfig.from_name("llama-2-70b")
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (80, 64, 8)
    assert (config.head_dim, config.ffn_dim, config.vocab_size) == (128, 28672, 32000)
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2  # K and V, fp16
    assert 4096 * per_token == 1.25 * 2**30
    assert 4096 * per_token * config.num_heads // config.num_kv_heads == 10 * 2**30


def test_mistral_window_and_gqa():
    config = GPTConfig.from_name("mistral-7b")
    assert (config.sliding_window, config.num_kv_heads, config.max_positions) == (4096, 8, 32768)


def test_mqa_example_has_one_kv_head():
    config = GPTConfig.from_name("tiny-llama-mqa")
    model = GPT(config)
    attention = model.blocks[0].self_attn
    assert config.num_kv_heads == 1
    assert attention.k_proj.weight.shape == (config.head_dim, config.embed_dim)


def test_num_kv_heads_defaults_to_num_heads_and_config_is_frozen():
    config = GPTConfig(vocab_size=10, embed_dim=8, num_layers=1, num_heads=2, ffn_dim=16)
    assert config.num_kv_heads == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_heads = 4


def test_from_name_errors():
    with pytest.raises(ValueError, match=r"name: unknown preset 'gpt-5'.*'gpt2'"):
        GPTConfig.from_name("gpt-5")
    with pytest.raises(TypeError, match=r"overrides: unknown fields \['n_embd'\]"):
        GPTConfig.from_name("gpt2", n_embd=10)


BASE = {"vocab_size": 10, "embed_dim": 8, "num_layers": 1, "num_heads": 2, "ffn_dim": 16}


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"embed_dim": 9}, ValueError, "embed_dim: 9 is not divisible by num_heads=2"),
        ({"num_kv_heads": 3, "num_heads": 4}, ValueError, "num_kv_heads: 3 does not divide"),
        ({"vocab_size": 0}, ValueError, "vocab_size: expected a positive int, got 0"),
        ({"num_layers": True}, TypeError, "num_layers: expected a positive int, got bool"),
        ({"ffn_dim": 2.0}, TypeError, "ffn_dim: expected a positive int, got float"),
        ({"position": "absolute"}, ValueError, r"position: expected one of \('learned', 'rope', "),
        ({"norm": "batchnorm"}, ValueError, "norm: expected one of"),
        ({"ffn": "relu"}, ValueError, r"ffn: expected one of \('gelu_tanh', 'swiglu'\)"),
        ({"embed_dim": 6}, ValueError, "head_dim = 6 // 2 = 3 is odd"),
        ({"norm_eps": 0.0}, ValueError, "norm_eps: expected a positive float, got 0.0"),
        ({"norm_eps": float("inf")}, ValueError, "norm_eps: expected a finite positive float"),
        ({"rope_base": -1.0}, ValueError, "rope_base: expected a positive float"),
        ({"bias": 1}, TypeError, "bias: expected a bool, got 1"),
        ({"sliding_window": 0}, ValueError, "sliding_window: expected a positive int, got 0"),
        ({"dropout": 1.0}, ValueError, r"dropout: expected a probability in \[0, 1\), got 1.0"),
        ({"attention_dropout": "0.1"}, TypeError, "attention_dropout: expected a float"),
    ],
)
def test_invalid_configs_name_the_field(change, error, message):
    with pytest.raises(error, match=message):
        GPTConfig(**{**BASE, **change})


def test_odd_head_dim_is_fine_with_learned_positions():
    config = GPTConfig(**{**BASE, "embed_dim": 6}, position="learned", norm="layernorm")
    assert config.head_dim == 3
