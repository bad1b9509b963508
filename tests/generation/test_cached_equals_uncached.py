"""Cached decoding gives the tokens and logits of recomputing the whole prefix every step."""

import pytest
import torch

import qkv.models as models
from qkv.generation import generate


def _recompute(model, ids, mask, steps):
    """Greedy decoding without a cache: the whole (left-padded) prefix, every step."""
    logits_per_step = []
    for _ in range(steps):
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        logits_per_step.append(logits)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids, torch.stack(logits_per_step, dim=1)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama", "tiny-llama-mqa", "tiny-mistral"])
def test_cached_greedy_equals_recompute_on_a_left_padded_batch(preset):
    torch.manual_seed(0)
    model = models.GPT(models.GPTConfig.from_name(preset)).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    streamed = []
    with torch.no_grad():
        cached = generate(model, ids, attention_mask=mask, max_new_tokens=12,
                          on_token=lambda t: streamed.append(t))  # fmt: skip
        expected, _ = _recompute(model, ids, mask, 12)
    assert torch.equal(cached, expected)
    assert torch.equal(torch.stack(streamed, dim=1), cached[:, 9:])
