"""GPT over sequences packed without padding (`sequence_lengths`): each equals its own run,
and the training loss equals that of the padded batch (transformers' Llama on the same weights
as the outside reference for the padded run)."""

import tempfile

import pytest
import torch
import transformers

import qkv
from qkv.models import GPT


@pytest.fixture(scope="module")
def models():
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).double().eval()
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = GPT.from_pretrained(directory).double().eval()
    return ours, theirs


LENGTHS = [7, 3, 12, 1]


def sequences():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=generator) for n in LENGTHS]


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_each_packed_sequence_equals_its_own_run(models, backend):
    ours, _ = models
    for module in ours.modules():
        if isinstance(module, qkv.layers.MultiHeadAttention):
            module.backend = backend
    packed = torch.cat(sequences())[None]  # (1, sum L)
    with torch.no_grad():
        logits = ours(packed, sequence_lengths=LENGTHS).logits  # (1, sum L, V)
        start = 0
        for tokens in sequences():
            alone = ours(tokens[None]).logits
            torch.testing.assert_close(logits[:, start : start + len(tokens)], alone)
            start += len(tokens)
    for module in ours.modules():
        if isinstance(module, qkv.layers.MultiHeadAttention):
            module.backend = "auto"


def test_packed_loss_equals_the_padded_batch_loss_of_transformers(models):
    ours, theirs = models
    parts = sequences()
    longest = max(LENGTHS)
    padded = torch.zeros(len(parts), longest, dtype=torch.long)
    mask = torch.zeros(len(parts), longest, dtype=torch.long)
    for row, tokens in enumerate(parts):
        padded[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
    labels = padded.masked_fill(mask == 0, -100)
    expected = theirs(padded, attention_mask=mask, labels=labels).loss
    packed = torch.cat(parts)[None]
    loss = ours(packed, labels=packed, sequence_lengths=LENGTHS).loss
    torch.testing.assert_close(loss, expected)
    loss.backward()  # the packed loss trains: every parameter gets a finite gradient
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())
    ours.zero_grad()


def test_bad_sequence_lengths_name_the_argument(models):
    ours, _ = models
    tokens = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence_lengths: \\[3, 4\\] sum to 7"):
        ours(tokens, sequence_lengths=[3, 4])
