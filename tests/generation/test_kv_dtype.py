"""`kv_dtype`: a KV cache in half precision for an fp32 model, attention then run in that dtype
(llama.cpp's default f16 cache). The reference is the same decoding with the fp32 cache (itself
tested against recomputing the prefix): the logits within a few rounding units of the cache's
dtype, the same greedy tokens, half the cache's bytes."""

import pytest
import torch

from qkv.generation import PromptCache, decode_steps
from tests.generation.reference_models import VOCAB, left_padded_prompts, qkv_model

NEW_TOKENS = 8


def _decode(model, ids, mask=None, **options):
    """(tokens (B, new), logits (B, new, V), the cache) of greedy decoding."""
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              **options))  # fmt: skip
    tokens = torch.stack([s.tokens for s in steps], 1)
    return tokens, torch.stack([s.logits for s in steps], 1), steps[-1].cache


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-mqa", "tiny-gpt2", "tiny-mistral"])
def test_a_half_precision_cache_decodes_as_the_fp32_one_to_its_rounding(preset, dtype):
    """GQA, MQA (their queries stacked, attention in the cache's dtype), MHA (its one query row
    computed in fp32 over the cache cast up) and Mistral's window, a left-padded batch: within
    4 rounding units of the dtype relative to the logits' largest magnitude."""
    model = qkv_model(preset)
    ids, mask = left_padded_prompts()
    tokens, logits, cache = _decode(model, ids, mask)
    half_tokens, half_logits, half_cache = _decode(model, ids, mask, kv_dtype=dtype)
    assert half_cache.keys[0].dtype == dtype and 2 * half_cache.nbytes == cache.nbytes
    assert torch.equal(half_tokens, tokens)
    assert half_logits.dtype == torch.float32
    gap = (half_logits - logits).abs().max()
    assert 0 < gap <= 4 * torch.finfo(dtype).eps * logits.abs().max()


def test_a_prompt_cache_keeps_its_dtype_and_another_dtype_starts_afresh():
    model = qkv_model("tiny-llama")
    prompt_cache = PromptCache()
    first = torch.randint(VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    answer, _, _ = _decode(model, first, prompt_cache=prompt_cache, kv_dtype=torch.float16)
    second = torch.cat([first, answer, first[:, :3]], dim=1)
    tokens, logits, cache = _decode(model, second, prompt_cache=prompt_cache,
                                    kv_dtype=torch.float16)  # fmt: skip
    assert prompt_cache.reused == first.shape[1] + NEW_TOKENS - 1
    assert cache.keys[0].dtype == torch.float16
    afresh_tokens, afresh_logits, _ = _decode(model, second, kv_dtype=torch.float16)
    assert torch.equal(tokens, afresh_tokens)
    bound = 4 * torch.finfo(torch.float16).eps * afresh_logits.abs().max()
    assert (logits - afresh_logits).abs().max() <= bound  # the prompt in chunks, rounded apart
    _decode(model, second, prompt_cache=prompt_cache)  # the model's own dtype: afresh
    assert prompt_cache.reused == 0 and prompt_cache.cache.keys[0].dtype == torch.float32


def test_kv_dtype_is_a_floating_dtype():
    model = qkv_model("tiny-llama")
    with pytest.raises(ValueError, match="kv_dtype: expected one of"):
        decode_steps(model, torch.arange(1, 4).unsqueeze(0), max_new_tokens=2, kv_dtype=torch.int8)
