"""Causal LM blocks: the token stream decodes back to the exact texts joined by <|endoftext|>,
the blocks are that stream cut in order, and a batch of blocks gives a qkv GPT the loss that
F.cross_entropy gives on next tokens (so labels = input_ids is right for GPT's own shift)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from qkv.data import END_OF_TEXT, TokenBlocks, causal_lm_blocks, token_stream, train_bpe
from qkv.models import GPT, GPTConfig


@pytest.fixture(scope="module")
def bpe(texts):
    return train_bpe(texts, vocab_size=2000)


def test_stream_decodes_to_the_texts(bpe, texts):
    stream = token_stream(texts[:12], bpe)
    assert stream.dtype == torch.long
    decoded = bpe.decode(stream.tolist(), skip_special_tokens=False)
    assert decoded == "".join(text + END_OF_TEXT for text in texts[:12])
    assert int((stream == bpe.token_to_id(END_OF_TEXT)).sum()) == 12


def test_blocks_cut_the_stream_in_order(bpe, texts):
    texts = texts[:20]
    stream = token_stream(texts, bpe)
    blocks = causal_lm_blocks(texts, bpe, block_size=64)
    assert len(blocks) == len(stream) // 64 and blocks.block_size == 64
    assert torch.equal(blocks.blocks.flatten(), stream[: len(blocks) * 64])
    item = blocks[3]
    assert torch.equal(item["input_ids"], stream[192:256])
    assert torch.equal(item["labels"], item["input_ids"])
    assert torch.equal(causal_lm_blocks(texts, bpe, block_size=64).blocks, blocks.blocks)


def test_gpt_loss_on_a_batch_is_next_token_cross_entropy(bpe, texts):
    blocks = causal_lm_blocks(texts[:5], bpe, block_size=32)
    batch = default_collate([blocks[0], blocks[1], blocks[2]])  # (3, 32) each
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=bpe.get_vocab_size(), embed_dim=32, num_layers=1, num_heads=4, ffn_dim=64
    )
    model = GPT(config)
    output = model(**batch)
    expected = F.cross_entropy(
        output.logits[:, :-1].reshape(-1, config.vocab_size), batch["input_ids"][:, 1:].reshape(-1)
    )
    torch.testing.assert_close(output.loss, expected)


def test_errors(bpe, minilm):
    with pytest.raises(ValueError, match="fewer than one block"):
        causal_lm_blocks(["tiny"], bpe, block_size=64)
    with pytest.raises(ValueError, match="end_of_text"):
        token_stream(["text"], minilm)
    with pytest.raises(TypeError, match="texts"):
        token_stream("one string", bpe)
    with pytest.raises(TypeError, match="block_size"):
        causal_lm_blocks(["text"], bpe, block_size=2.5)
    with pytest.raises(TypeError, match="blocks"):
        TokenBlocks(torch.zeros(3))
