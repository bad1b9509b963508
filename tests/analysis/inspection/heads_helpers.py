"""Shared by the head-analysis tests: random ids, and transformers' BERT with qkv's copy."""

import torch
import transformers

import qkv
from tests.layers.helpers import randomize_

HF_CONFIG = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
)  # fmt: skip


def random_ids(vocab_size, shape, seed):
    return torch.randint(3, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def make_bert_pair(path):
    """transformers' BertForSequenceClassification (eager attention, random N(0, 0.3) weights)
    saved with save_pretrained and loaded by qkv; and a padded batch of sentence pairs."""
    torch.manual_seed(0)
    config = transformers.BertConfig(**HF_CONFIG, attn_implementation="eager")
    theirs = randomize_(transformers.BertForSequenceClassification(config)).eval()
    theirs.save_pretrained(path)
    ours = qkv.models.from_pretrained(path).eval()
    batches = []
    for seed, lengths in ((1, [12, 7, 4]), (2, [9, 12, 5])):
        ids = random_ids(99, (3, 12), seed)
        mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, L)
        segments = (torch.arange(12)[None, :] >= 5).long() * mask
        batches.append((ids.masked_fill(mask == 0, 0), mask, segments, torch.tensor([0, 1, 1])))
    return theirs, ours, path, batches
