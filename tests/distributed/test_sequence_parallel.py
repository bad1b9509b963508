"""Sequence-parallel models in one process: the shards `shard_lm_batch` cuts, a GPT whose
attention layers are rings (a ring of one), and the refusals. The multi-process runs are in
test_parallel_training.py (training) and test_ring_attention.py (the attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.distributed import (
    RingAttention,
    local_attention,
    shard_lm_batch,
    use_ring_attention,
)
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gpt2"])
def test_a_ring_of_one_on_padded_shards_gives_the_loss_of_the_whole_sequence(family):
    torch.manual_seed(0)
    config = GPTConfig.from_name(family, vocab_size=50, embed_dim=32, num_layers=2, num_heads=4,
                                 ffn_dim=64, max_positions=16)  # fmt: skip
    plain = GPT(config).eval()
    ids = torch.randint(0, 50, (3, 13))  # 13 tokens: zigzag over 1 process pads them to 14
    expected = F.cross_entropy(plain(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                               reduction="sum")  # fmt: skip
    ring = use_ring_attention(plain, RingAttention(length=13))
    shard = shard_lm_batch(ids, 0, 1)
    assert shard["input_ids"].shape == (3, 14)
    logits = ring(shard["input_ids"], position_ids=shard["position_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), shard["targets"].flatten(), reduction="sum",
                           ignore_index=-100)  # fmt: skip
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-5)
    with local_attention(ring):
        torch.testing.assert_close(ring(ids).logits, plain(ids).logits)
    assert all(block.self_attn.attention is not None for block in ring.blocks)


def test_shards_of_two_ranks_hold_every_position_once_with_its_next_token():
    ids = torch.randint(0, 50, (2, 11))
    seen = []
    for rank in range(2):
        shard = shard_lm_batch(ids, rank, 2)  # 11 pads to 12: 4 chunks of 3
        assert shard["input_ids"].shape == shard["targets"].shape == (2, 6)
        for t, position in enumerate(shard["position_ids"].tolist()):
            target = shard["targets"][:, t]
            if (target == -100).all():  # the last position, or padding
                continue
            seen.append(position)
            torch.testing.assert_close(shard["input_ids"][:, t], ids[:, position])
            torch.testing.assert_close(target, ids[:, position + 1])
    assert sorted(seen) == list(range(10))  # every position with a next token, once


def test_what_a_ring_cannot_take_is_refused_by_name():
    q = torch.randn(1, 2, 4, 8)
    ring = RingAttention()
    with pytest.raises(ValueError, match="mask: ring attention .* takes no mask"):
        ring(q, q, q, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p: ring attention"):
        ring(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="layout: expected one of"):
        RingAttention(layout="diagonal")
    translation = Transformer(TransformerConfig.from_name("transformer-tiny"))
    with pytest.raises(ValueError, match="cross-attention layers cannot run as a ring"):
        use_ring_attention(translation, ring)
