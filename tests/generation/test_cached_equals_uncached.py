"""Cached decoding gives the tokens and logits of recomputing the whole prefix every step:
the reference is the model run without any cache on the full left-padded sequence, with the
positions every row's real tokens would have alone."""

import pytest
import torch

from qkv.generation import decode_steps, generate
from tests.generation.reference_models import left_padded_prompts, qkv_model

PRESETS = ["tiny-gpt2", "tiny-llama", "tiny-llama-mqa", "tiny-mistral"]
NEW_TOKENS = 12


def _recompute(model, ids, mask, steps):
    """Greedy decoding without a cache: the whole (left-padded) prefix, every step.

    Returns the sequences (B, L + steps) and each step's last-position logits (B, steps, V).
    """
    logits_per_step = []
    with torch.no_grad():
        for _ in range(steps):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            logits_per_step.append(logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids, torch.stack(logits_per_step, dim=1)


@pytest.mark.parametrize("preset", PRESETS)
def test_cached_logits_and_tokens_equal_recompute_on_a_left_padded_batch(preset):
    """GPT-2 (learned positions), Llama GQA, MQA and Mistral's window of 4 (narrower than the
    21 tokens decoded, so the window bites): every step's logits within 1e-5."""
    model = qkv_model(preset)
    ids, mask = left_padded_prompts()
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS))
    cached_tokens = torch.stack([s.tokens for s in steps], dim=1)  # (B, new)
    cached_logits = torch.stack([s.logits for s in steps], dim=1)  # (B, new, V)
    expected_ids, expected_logits = _recompute(model, ids, mask, NEW_TOKENS)
    assert expected_logits.abs().max() > 1.0  # far from the near-zero, near-tied regime
    # 1e-5 absolute or relative: logits of magnitude ~10 in fp32 carry about 1e-6 of relative
    # rounding from summing in a different order (one query against the cache vs all of them).
    torch.testing.assert_close(cached_logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(cached_tokens, expected_ids[:, ids.shape[1] :])


@pytest.mark.parametrize("position", ["sinusoidal", "alibi", "t5", "none"])
def test_cached_logits_equal_recompute_for_every_position_kind(position):
    """Sinusoids added at each row's positions; ALiBi's and T5's biases over the cache, whose
    left padding shifts no distance between real tokens; no positions at all."""
    model = qkv_model("tiny-llama", position=position)
    ids, mask = left_padded_prompts()
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS))
    cached_logits = torch.stack([s.logits for s in steps], dim=1)  # (B, new, V)
    _, expected_logits = _recompute(model, ids, mask, NEW_TOKENS)
    torch.testing.assert_close(cached_logits, expected_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_generate_stream_and_on_token_agree(preset):
    model = qkv_model(preset)
    ids, mask = left_padded_prompts()
    streamed = []
    output = generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                      on_token=streamed.append)  # fmt: skip
    expected, _ = _recompute(model, ids, mask, NEW_TOKENS)
    assert torch.equal(output, expected)
    assert torch.equal(torch.stack(streamed, dim=1), output[:, ids.shape[1] :])


def test_a_padded_row_decodes_as_it_would_alone():
    """Row 1 of the batch (4 pads) gives the logits of its unpadded prompt decoded by itself."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    batch = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=6))
    alone = list(decode_steps(model, ids[1:2, 4:], max_new_tokens=6))
    for in_batch, single in zip(batch, alone, strict=True):
        torch.testing.assert_close(in_batch.logits[1:2], single.logits, rtol=0, atol=1e-5)


def test_decoding_builds_no_autograd_graph():
    """Without the caller's torch.no_grad, neither the logits nor the cache keep a graph, and
    grad mode is unchanged in the caller's code between steps."""
    model = qkv_model("tiny-llama")
    ids, _ = left_padded_prompts()
    for step in decode_steps(model, ids, max_new_tokens=3):
        assert torch.is_grad_enabled()
        assert not step.logits.requires_grad
        assert not any(t.requires_grad for t in step.cache.keys + step.cache.values)


CHUNKED = [*PRESETS, "alibi", "t5"]


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("kind", CHUNKED)
def test_a_prompt_in_chunks_decodes_as_the_recomputed_prefix(monkeypatch, kind, padded):
    """A prompt longer than PROMPT_CHUNK goes through the model a chunk at a time, each chunk
    attending over the cache the earlier ones filled (causal aligned bottom-right, the window,
    ALiBi's and T5's biases, the padding): chunks of 3 over prompts of 9 (the last chunk
    whole) and 5 (the last one short) give the recomputed logits and tokens."""
    import qkv.generation.steps as steps_module

    monkeypatch.setattr(steps_module, "PROMPT_CHUNK", 3)
    model = qkv_model(kind) if kind in PRESETS else qkv_model("tiny-llama", position=kind)
    ids, mask = left_padded_prompts()
    if not padded:
        ids, mask = ids[1:2, 4:], mask[1:2, 4:]
    assert ids.shape[1] > 3
    lengths = []
    hook = model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS))
    hook.remove()
    assert lengths[: -(NEW_TOKENS - 1)] == ([3, 3, 3] if padded else [3, 2])
    cached_tokens = torch.stack([s.tokens for s in steps], dim=1)  # (B, new)
    cached_logits = torch.stack([s.logits for s in steps], dim=1)  # (B, new, V)
    expected_ids, expected_logits = _recompute(model, ids, mask, NEW_TOKENS)
    torch.testing.assert_close(cached_logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(cached_tokens, expected_ids[:, ids.shape[1] :])
