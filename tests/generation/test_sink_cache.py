"""StreamingLLM decoding (Xiao et al. 2024): attention sinks + a window.

The policy: keep the first `num_sinks` tokens and the last `window` ones, and give the kept
tokens the positions 0 .. n - 1 in that order. The reference is the model run without a cache
on exactly those tokens, at every step.

That equality is exact only for a one-layer model. With more layers, a cached token's keys and
values in layer 2 and above were computed when the token was new, from hidden states that saw
tokens since evicted; a recompute on the kept tokens alone cannot see those, and StreamingLLM
deliberately does not recompute (it is what makes each step O(window)). So multi-layer models
are checked against the full recompute while nothing has been evicted yet.
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation import decode_steps, generate
from tests.generation.reference_models import qkv_model

NUM_SINKS, WINDOW = 2, 6
CAPACITY = NUM_SINKS + WINDOW


def _prompt(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(3))


def _kept(sequence: torch.Tensor, count: int) -> torch.Tensor:
    """The tokens a sink cache holds once `count` tokens have been fed: sinks, then window."""
    recent_start = max(NUM_SINKS, count - WINDOW)
    return torch.cat([sequence[:, : min(NUM_SINKS, count)], sequence[:, recent_start:count]], 1)


def _recompute_last_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """No cache; positions 0 .. n - 1 (the default)."""
    with torch.no_grad():
        return model(tokens).logits[:, -1]


@pytest.mark.parametrize(
    ("preset", "position"),
    [("tiny-llama", "rope"), ("tiny-llama-mqa", "rope"), ("tiny-llama", "alibi"),
     ("tiny-llama", "t5"), ("tiny-llama", "none")],
)  # fmt: skip
def test_every_step_equals_a_recompute_over_sinks_and_window(preset, position):
    """One layer; a 10-token prompt (longer than the 8-slot cache) and 60 new tokens: 70 in
    all, past the model's context of 64 and 7.5 times the cache. ALiBi's and T5's biases, like
    RoPE, see the kept tokens at their cache positions."""
    model = qkv_model(preset, num_layers=1, position=position)
    prompt = _prompt(10)
    new_tokens = 60
    assert prompt.shape[1] + new_tokens > model.config.max_positions
    sequence = prompt
    for step in decode_steps(model, prompt, max_new_tokens=new_tokens, sinks=(NUM_SINKS, WINDOW)):
        kept = _kept(sequence, sequence.shape[1])
        assert kept.shape[1] == CAPACITY
        expected = _recompute_last_logits(model, kept)
        torch.testing.assert_close(step.logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(step.tokens, expected.argmax(dim=-1))
        sequence = torch.cat([sequence, step.tokens[:, None]], dim=1)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral"])
def test_before_any_eviction_sinks_change_nothing(preset):
    """Two layers, 5 + 20 tokens in a 2 + 30 cache: the logits of decoding without sinks.
    (tiny-mistral: its own window of 4 still applies inside the sink cache.)"""
    model = qkv_model(preset)
    prompt = _prompt(5)
    plain = list(decode_steps(model, prompt, max_new_tokens=20))
    sinks = list(decode_steps(model, prompt, max_new_tokens=20, sinks=(2, 30)))
    sequence = torch.cat([prompt, torch.stack([s.tokens for s in plain], dim=1)], dim=1)
    for index, (with_sinks, without) in enumerate(zip(sinks, plain, strict=True)):
        expected = _recompute_last_logits(model, sequence[:, : 5 + index])
        torch.testing.assert_close(with_sinks.logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(without.logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(with_sinks.tokens, without.tokens)


def test_memory_stays_constant_for_four_times_the_cache():
    """The same tensors (two per layer), same addresses, same size from the first step to the
    last."""
    model = qkv_model("tiny-llama")
    prompt = _prompt(4)
    new_tokens = 4 * CAPACITY
    steps = decode_steps(model, prompt, max_new_tokens=new_tokens, sinks=(NUM_SINKS, WINDOW))
    first = next(steps)
    cache = first.cache
    keys, values = cache.keys, cache.values

    def addresses():
        return [t.data_ptr() for t in cache.keys + cache.values]

    before = (addresses(), cache.nbytes)
    config = model.config
    per_sample = CAPACITY * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert cache.nbytes == 2 * per_sample  # batch 2, fp32
    count = 1 + sum(1 for step in steps if step.cache is cache)
    assert count == new_tokens
    assert cache.keys is keys and cache.values is values
    assert (addresses(), cache.nbytes) == before
    assert cache.length == prompt.shape[1] + new_tokens - 1  # every token but the last was fed


def test_sinks_need_rotary_positions():
    model = qkv_model("tiny-gpt2")  # learned positions: a table indexed by absolute position
    with pytest.raises(ValueError, match=r"sinks: .*inside attention.*'learned'"):
        generate(model, _prompt(4), max_new_tokens=3, sinks=(2, 6))


def test_sinks_refuse_padded_prompts():
    model = qkv_model("tiny-llama")
    mask = torch.ones(2, 4, dtype=torch.long)
    mask[1, 0] = 0
    with pytest.raises(ValueError, match=r"attention_mask: padded prompts .* sinks"):
        generate(model, _prompt(4), attention_mask=mask, max_new_tokens=3, sinks=(2, 6))


@pytest.mark.parametrize("sinks", [(2,), (-1, 6), (2, 0), (2.0, 6), 8, (10, 60)])
def test_malformed_or_oversized_sinks_are_refused(sinks):
    model = qkv_model("tiny-llama")  # context 64: (10, 60) is a 70-slot cache
    with pytest.raises(ValueError, match=r"^sinks: .*(expected|exceeds)"):
        generate(model, _prompt(4), max_new_tokens=3, sinks=sinks)
