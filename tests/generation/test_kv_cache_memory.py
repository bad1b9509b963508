"""KV cache memory against its formula (Pope et al. 2022, on the costs of inference):

    bytes per sample = L_ctx * layers * 2 (K and V) * H_kv * head_dim * bytes per element

and against the figures for Llama-2-70B: about 1.25 GB per sample with GQA (H_kv = 8),
10 GB with plain multi-head attention (4096 tokens, 80 layers, fp16). Large caches are built on
the "meta" device: shapes and dtypes, no memory.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkv.generation import decode_steps, make_cache
from qkv.layers import StaticKVCache
from qkv.models import GPT, GPTConfig
from tests.generation.reference_models import qkv_model

BYTES_PER_ELEMENT = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_bytes_per_sample_is_context_layers_2_kv_heads_head_dim_bytes(num_kv_heads, dtype):
    context, layers, head_dim, batch = 24, 3, 16, 2
    cache = StaticKVCache(
        num_layers=layers, batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_length=context, dtype=dtype,
    )  # fmt: skip
    expected = context * layers * 2 * num_kv_heads * head_dim * BYTES_PER_ELEMENT[dtype]
    assert cache.bytes_per_sample == expected
    assert cache.nbytes == batch * expected


@pytest.mark.parametrize(("num_kv_heads", "gibibytes"), [(8, 1.25), (64, 10)], ids=["GQA", "MHA"])
def test_llama_2_70b_cache_is_1_25_gib_with_gqa_and_10_gib_with_mha(num_kv_heads, gibibytes):
    """Built by `make_cache` (what `generate` uses) from the llama-2-70b preset, on meta."""
    config = GPTConfig.from_name("llama-2-70b", num_kv_heads=num_kv_heads)
    with torch.device("meta"):
        model = GPT(config)
    cache = make_cache(model, batch=1, max_length=4096, dtype=torch.float16)
    assert all(t.device.type == "meta" for t in cache.keys + cache.values)
    assert cache.bytes_per_sample == gibibytes * 2**30


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-mqa"])
def test_the_cache_shrinks_by_num_heads_over_num_kv_heads(preset):
    """Against the same model with every query head keeping its own keys and values (MHA)."""
    config = GPTConfig.from_name(preset)
    mha = GPT(dataclasses.replace(config, num_kv_heads=config.num_heads))
    gqa = GPT(config)
    ratio = config.num_heads // config.num_kv_heads
    assert ratio > 1
    grouped = make_cache(gqa, batch=3, max_length=20)
    full = make_cache(mha, batch=3, max_length=20)
    assert full.nbytes == ratio * grouped.nbytes
    assert len(grouped.keys) == config.num_layers
    assert grouped.keys[0].shape == (3, config.num_kv_heads, 20, config.head_dim)  # (B, H_kv, L, D)


def test_the_cache_generate_decodes_with_has_the_formula_size():
    model = qkv_model("tiny-llama")  # 2 layers, H_kv = 2, head_dim 8, fp32
    prompt = torch.zeros(2, 5, dtype=torch.long)
    step = next(iter(decode_steps(model, prompt, max_new_tokens=7)))
    config = model.config
    per_sample = (5 + 7) * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert step.cache.bytes_per_sample == per_sample
    assert step.cache.nbytes == 2 * per_sample
    assert step.cache.length == 5  # the prompt, written by the prefill


def test_make_cache_follows_the_model_dtype():
    model = qkv_model("tiny-llama").to(torch.bfloat16)
    cache = make_cache(model, batch=1, max_length=4)
    assert all(t.dtype == torch.bfloat16 for t in cache.keys + cache.values)
    assert cache.bytes_per_sample == 4 * 2 * 2 * 2 * 8 * 2


def test_every_layer_has_its_own_keys_and_values():
    """One allocation per layer and per K/V: compiled decoding writes a layer's new slot in
    place only then (slices of one tensor shared by every layer were compiled into copies of
    the whole cache at every layer of every step)."""
    model = qkv_model("tiny-llama")
    cache = make_cache(model, batch=2, max_length=6)
    tensors = cache.keys + cache.values
    assert len(tensors) == 2 * model.config.num_layers
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    assert all(t.shape == (2, model.config.num_kv_heads, 6, model.config.head_dim) for t in tensors)
