"""The `translate` task: train the encoder-decoder `Transformer` on German -> English numbers.

Training is teacher forcing: the model sees the source and the target shifted right behind [BOS],
and predicts every target token at once under the look-ahead mask; the loss is label-smoothed
cross-entropy (Vaswani et al. 2017 section 5.4). Evaluation decodes greedily, one token at a time
with the decoder cache, and counts exact matches: a translation is right only if every word, hyphen
and comma is.

The default model (E=128, 4 heads, 2 + 2 layers, FFN 512, about 0.95M parameters) is sized so
that the README's command reaches >= 99% exact match on held-out numbers in a few minutes on 2
CPU cores.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from qkv.data.tokenizers import load_tokenizer
from qkv.data.translate import (
    PAD_ID,
    TranslationDataset,
    TranslationPairs,
    check_texts,
    number_pairs,
    pad_sequences,
    read_pairs,
    train_translation_tokenizer,
)
from qkv.generation.beam import beam_search, greedy_decode
from qkv.models import Transformer, TransformerConfig, load, save
from qkv.models.losses import IGNORE_INDEX

__all__ = ["TranslateOptions", "TranslateTask", "load_translator", "translate"]

logger = logging.getLogger(__name__)  # the stages of data preparation, at INFO

TASK_FILE = "task.json"
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class TranslateOptions:
    """Data and model sizes of the translate task (`qkv train translate --help`)."""

    data: str | None = None  # tab-separated pairs instead of the generated numbers
    max_number: int = 999_999
    num_train: int = 40_000
    num_valid: int = 500
    num_test: int = 1_000
    vocab_size: int = 200
    embed_dim: int = 128
    num_heads: int = 4
    num_layers: int = 2
    ffn_dim: int = 512
    dropout: float = 0.1
    label_smoothing: float = 0.1
    max_length: int = 64
    data_seed: int = 0  # which numbers go to train, validation and test

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "max_number": "numbers are drawn from 0 .. this",
        "num_train": "training pairs",
        "num_valid": "validation pairs",
        "num_test": "held-out test pairs",
        "vocab_size": "BPE vocabulary size (source and target share it)",
        "num_layers": "blocks in the encoder and in the decoder",
        "label_smoothing": "label smoothing of the loss",
        "max_length": "longest sentence in tokens",
    }


class TranslateTask:
    """Pairs, tokenizer and model of the translate task; see the module docstring."""

    name = "translate"

    def __init__(self, options: TranslateOptions = TranslateOptions()) -> None:
        self.options = options
        self.pairs = _pairs(options)
        logger.info(
            "training a BPE tokenizer of %d tokens on %d pairs",
            options.vocab_size, len(self.pairs.train),
        )  # fmt: skip
        self.tokenizer = train_translation_tokenizer(
            self.pairs.train, vocab_size=options.vocab_size
        )
        splits = (self.pairs.train, self.pairs.valid, self.pairs.test)
        logger.info("encoding %d pairs", sum(len(split) for split in splits))
        encode = lambda pairs: TranslationDataset(  # noqa: E731
            pairs, self.tokenizer, max_length=options.max_length
        )
        self.train_set, self.valid_set, self.test_set = (
            encode(self.pairs.train), encode(self.pairs.valid), encode(self.pairs.test),
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.train_set)

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.options)}

    def build_model(self) -> Transformer:
        options = self.options
        vocab = self.tokenizer.get_vocab_size()
        config = TransformerConfig(
            src_vocab_size=vocab, tgt_vocab_size=vocab, embed_dim=options.embed_dim,
            num_heads=options.num_heads, num_encoder_layers=options.num_layers,
            num_decoder_layers=options.num_layers, ffn_dim=options.ffn_dim,
            dropout=options.dropout, max_positions=options.max_length,
            share_embeddings=True, label_smoothing=options.label_smoothing,
        )  # fmt: skip
        return Transformer(config)

    def collate(self, indices: list[int], *, step: int = 0) -> dict[str, torch.Tensor]:
        return self.train_set.collate(indices)

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {"tokens": int((batch["labels"] != IGNORE_INDEX).sum())}

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum()) + self.counts(batch)["tokens"]

    def loss_sums(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Summed label-smoothed cross-entropy over the target tokens of the batch."""
        logits = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).logits
        return {"tokens": _summed_cross_entropy(logits, batch["labels"], self.options)}

    @torch.no_grad()
    def evaluate(self, model: Transformer, *, split: str = "valid") -> dict[str, float]:
        """Teacher-forced cross-entropy (no smoothing) and perplexity, and greedy exact match."""
        dataset = {"valid": self.valid_set, "test": self.test_set}[split]
        device = next(model.parameters()).device
        total, count, correct = 0.0, 0, 0
        for start in range(0, len(dataset), 250):
            indices = list(range(start, min(start + 250, len(dataset))))
            batch = {k: v.to(device) for k, v in dataset.collate(indices).items()}
            logits = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
            total += float(_summed_cross_entropy(logits.logits, batch["labels"], None))
            count += self.counts(batch)["tokens"]
            pairs = [dataset.pairs[i] for i in indices]
            outputs = translate(model, self.tokenizer, [source for source, _ in pairs])
            correct += sum(out == target for out, (_, target) in zip(outputs, pairs, strict=True))
        loss = total / max(count, 1)
        return {
            f"{split}_loss": loss,
            f"{split}_perplexity": float(torch.tensor(loss).exp()),
            f"{split}_exact_match": correct / len(dataset),
        }

    def save(self, model: Transformer, path: str | os.PathLike) -> Path:
        """The trained model as a qkv checkpoint, with tokenizer.json and task.json beside it."""
        path = save(model, path)
        self.tokenizer.save(str(path / TOKENIZER_FILE))
        (path / TASK_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path


@torch.no_grad()
def translate(
    model: Transformer, tokenizer, texts: list[str], *, num_beams: int = 1, max_new_tokens=None
) -> list[str]:
    """Translate `texts` with greedy decoding (num_beams=1) or beam search; returns strings."""

    texts = check_texts(texts)
    if not texts:
        return []
    max_positions = model.config.max_positions
    sources = [tokenizer.encode(text).ids[:max_positions] or [PAD_ID] for text in texts]
    input_ids = pad_sequences(sources, PAD_ID).to(next(model.parameters()).device)
    limit = max_new_tokens or max_positions - 1
    if num_beams == 1:
        sequences, _ = greedy_decode(
            model, input_ids, attention_mask=input_ids != PAD_ID, max_new_tokens=limit
        )
    else:
        sequences, _ = beam_search(
            model, input_ids, attention_mask=input_ids != PAD_ID, max_new_tokens=limit,
            num_beams=num_beams,
        )  # fmt: skip
    return [tokenizer.decode(row, skip_special_tokens=True) for row in sequences.tolist()]


def load_translator(path: str | os.PathLike):
    """(model, tokenizer) saved by `TranslateTask.save`."""
    path = Path(path)
    if not (path / TOKENIZER_FILE).is_file():
        raise ValueError(
            f"model: {path} has no {TOKENIZER_FILE}; expected a folder written by "
            f"`qkv train translate` (its model/ folder)"
        )
    model = load(path)
    if not isinstance(model, Transformer):
        raise ValueError(f"model: {path} holds a {type(model).__name__}, not a Transformer")
    return model.eval(), load_tokenizer(path / TOKENIZER_FILE)


def _pairs(options: TranslateOptions) -> TranslationPairs:
    if options.data is not None:
        logger.info("reading pairs from %s", options.data)
        return read_pairs(options.data, seed=options.data_seed)
    logger.info(
        "generating %d number pairs (0 .. %d)",
        options.num_train + options.num_valid + options.num_test, options.max_number,
    )  # fmt: skip
    return number_pairs(
        max_number=options.max_number, num_train=options.num_train,
        num_valid=options.num_valid, num_test=options.num_test, seed=options.data_seed,
    )  # fmt: skip


def _summed_cross_entropy(logits, labels, options: TranslateOptions | None) -> torch.Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, V).float(),  # (B * L_tgt, V)
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        label_smoothing=0.0 if options is None else options.label_smoothing,
        reduction="sum",
    )
