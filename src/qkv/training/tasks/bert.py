"""The `bert` task: MLM + NSP pre-training on the documentation CPython ships.

Pre-training (Devlin et al. 2019, section 3.1): the masked language model selects ~15% of the
tokens, of which 80% become [MASK], 10% a random token and 10% stay, and predicts the original
there; next-sentence prediction asks whether sentence B follows A (50%) or comes from elsewhere
(50%). The text is `pydoc_data.topics` (or `--data FILE`), split by document into training and
validation; the tokenizer is a WordPiece trained on the training documents (`tokenizer="trained"`)
or MiniLM's 30,522-token vocabulary (`"minilm"`).

The [CLS] A [SEP] B [SEP] pairs are built once (`qkv.data.nsp`), dupe_factor times with seeds
data_seed, data_seed + 1, ... (as the reference's create_pretraining_data.py does: the same text
cut into other pairs, so NSP cannot memorise one set); one training example is one pair.
Masking is dynamic (RoBERTa's): each example is masked afresh at every step, by a generator
seeded from (data_seed, step, example index) alone. So the loop can re-create any batch on
resume, and an example's mask does not depend on which micro-batch or process it lands in:
gradient accumulation and DDP see exactly the masks of one big batch.
Validation pairs are masked with a fixed seed, so evaluations at different steps compare.

Loss terms: "mlm", the cross-entropy summed over the selected tokens, and "nsp", summed over the
pairs; the loop divides each by its count in the global batch, so the loss is BERT's, mean MLM
+ mean NSP. Evaluation reports both, the MLM perplexity and accuracy, and the unigram entropy of
the training tokens: the MLM loss of a model that ignores context, the number to get below.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from qkv.data import (
    IGNORE_INDEX,
    NspExample,
    bert_special_ids,
    make_nsp_examples,
    mask_tokens,
    minilm_wordpiece,
    pad_examples,
    pydoc_documents,
    text_file_documents,
    train_validation_split,
    train_wordpiece,
)
from qkv.models import BertConfig, BertForPreTraining, save
from qkv.training.tasks.gpt import check_validation_fraction, unigram_entropy
from qkv.validation import check_positive_int

__all__ = ["BertOptions", "BertTask"]

logger = logging.getLogger(__name__)  # the stages of data preparation, at INFO

TASK_FILE = "task.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZERS = ("trained", "minilm")
_EVAL_BATCH = 64


@dataclass(frozen=True)
class BertOptions:
    """Data and model sizes of the bert task (`qkv train bert --help`)."""

    data: str | None = None  # a UTF-8 text file: blank lines separate documents
    tokenizer: str = "trained"  # "trained" WordPiece on the corpus, or "minilm" (30,522)
    vocab_size: int = 4000  # of the trained WordPiece (at most; a small corpus may give fewer)
    max_length: int = 64  # tokens per pair, with [CLS] and two [SEP]
    embed_dim: int = 128
    num_layers: int = 2
    num_heads: int = 2
    ffn_dim: int = 512
    dropout: float = 0.1
    dupe_factor: int = 5  # pair sets drawn from the training text, each with its own seed
    validation_fraction: float = 0.1
    data_seed: int = 0  # the split, the pairs and the masks
    pack: bool = False  # each micro-batch's pairs in one row, no padding (sparse.Packed)

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "tokenizer": "'trained' (a WordPiece trained on the corpus) or 'minilm' (30,522 tokens)",
        "vocab_size": "size of the trained WordPiece (at most)",
        "max_length": "tokens per sentence pair, [CLS] and both [SEP] included",
        "num_layers": "encoder blocks",
        "dupe_factor": "pair sets drawn from the training text, each with its own masks",
        "validation_fraction": "share of the documents held out for validation",
        "data_seed": "seed of the split, the pairs and the masks",
        "pack": "pack each micro-batch's pairs into one row without padding, each attending "
        "only to itself (the same loss; projections and FFN skip the padding)",
    }


class BertTask:
    """Sentence pairs, tokenizer and model of the bert task; see the module docstring."""

    name = "bert"
    # `qkv train bert` defaults. Small batches learn more per CPU-second; post-norm BERT at
    # this learning rate needs the longer warm-up (with 10% it stays at the unigram loss), and
    # 800 steps stop on the plateau at ~4.9.
    training_defaults = {
        "batch_size": 32, "learning_rate": 3e-3, "warmup_fraction": 0.2, "steps": 2000,
    }  # fmt: skip

    def __init__(self, options: BertOptions = BertOptions()) -> None:
        if options.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer: expected one of {TOKENIZERS}, got {options.tokenizer!r}")
        check_validation_fraction(options.validation_fraction)
        self.options = options
        logger.info("reading %s", options.data or "the documents of pydoc_data.topics")
        documents = _documents(options.data)
        train, valid = train_validation_split(
            documents, validation_fraction=options.validation_fraction, seed=options.data_seed
        )
        if options.tokenizer == "trained":
            texts = [" ".join(document) for document in train]
            logger.info(
                "training a WordPiece of %d tokens on %d documents", options.vocab_size,
                len(train),
            )  # fmt: skip
            self.tokenizer = train_wordpiece(texts, vocab_size=options.vocab_size)
        else:
            self.tokenizer = minilm_wordpiece()
        self.special = bert_special_ids(self.tokenizer)
        logger.info(
            "building sentence pairs: %d sets of %d documents, and validation's",
            options.dupe_factor, len(train),
        )  # fmt: skip
        self.train_pairs = _training_pairs(train, self.tokenizer, options)
        self.valid_pairs = _validation_pairs(valid, train, self.tokenizer, options)
        self.valid_batches = [
            self._masked(self.valid_pairs, range(start, start + _EVAL_BATCH), split="valid")
            for start in range(0, len(self.valid_pairs), _EVAL_BATCH)
        ]
        train_ids = torch.tensor([i for pair in self.train_pairs for i in pair.input_ids])
        self.unigram_entropy = unigram_entropy(train_ids, exclude=self.special.never_selected)

    def __len__(self) -> int:
        return len(self.train_pairs)

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.options)}

    def build_model(self) -> BertForPreTraining:
        options = self.options
        config = BertConfig(
            vocab_size=self.tokenizer.get_vocab_size(), embed_dim=options.embed_dim,
            num_layers=options.num_layers, num_heads=options.num_heads,
            ffn_dim=options.ffn_dim, max_positions=options.max_length,
            dropout=options.dropout, attention_dropout=options.dropout,
            pad_token_id=self.special.pad,
        )  # fmt: skip
        return BertForPreTraining(config)

    def collate(self, indices: list[int], *, step: int = 0) -> dict[str, torch.Tensor]:
        """The training pairs at `indices`, padded and masked for this step: input_ids,
        attention_mask, token_type_ids, labels (B, L), next_sentence_label (B,); with the
        `pack` option, the same tokens and masks packed into one row (`pack_batch`)."""
        batch = self._masked(self.train_pairs, indices, split="train", step=step)
        return pack_batch(batch) if self.options.pack else batch

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {
            "mlm": int((batch["labels"] != IGNORE_INDEX).sum()),
            "nsp": len(batch["next_sentence_label"]),
        }

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def loss_sums(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cross-entropy summed over the selected tokens ("mlm") and over the pairs ("nsp").
        The MLM head scores the selected positions only (`masked_positions`)."""
        selected = batch["labels"] != IGNORE_INDEX
        lengths = batch.get("sequence_lengths")
        packed = {} if lengths is None else {"sequence_lengths": lengths.tolist()}
        output = model(
            batch["input_ids"], None if packed else batch["attention_mask"],
            batch["token_type_ids"], masked_positions=selected, **packed,
        )  # fmt: skip
        return _summed_losses(output, batch, selected)

    @torch.no_grad()
    def evaluate(self, model: BertForPreTraining) -> dict[str, float]:
        """MLM and NSP loss and accuracy on the validation pairs (masked with a fixed seed),
        the MLM perplexity, and the unigram entropy of the training tokens for comparison.
        Call it with the model in eval mode."""
        sums = dict.fromkeys(("mlm", "nsp", "mlm_correct", "nsp_correct"), 0.0)
        counts = {"mlm": 0, "nsp": 0}
        for batch in self.valid_batches:
            output = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            for name, value in _summed_losses(output, batch).items():
                sums[name] += float(value)
            labels, selected = batch["labels"], batch["labels"] != IGNORE_INDEX
            predicted = output.logits.argmax(dim=-1)  # (B, L)
            sums["mlm_correct"] += int((predicted == labels)[selected].sum())
            nsp_predicted = output.nsp_logits.argmax(dim=-1)  # (B,)
            sums["nsp_correct"] += int((nsp_predicted == batch["next_sentence_label"]).sum())
            for name, count in self.counts(batch).items():
                counts[name] += count
        mlm, nsp = (sums[name] / max(counts[name], 1) for name in ("mlm", "nsp"))
        return {
            "valid_loss": mlm + nsp,
            "valid_mlm_loss": mlm,
            "valid_nsp_loss": nsp,
            "valid_perplexity": math.exp(min(mlm, 700.0)),  # of the MLM; exp(700) ~ float max
            "valid_mlm_accuracy": sums["mlm_correct"] / max(counts["mlm"], 1),
            "valid_nsp_accuracy": sums["nsp_correct"] / max(counts["nsp"], 1),
            "unigram_entropy": self.unigram_entropy,
        }

    def save(self, model: BertForPreTraining, path: str | os.PathLike) -> Path:
        """The model as a qkv checkpoint, with tokenizer.json and task.json beside it."""
        path = save(model, path)
        self.tokenizer.save(str(path / TOKENIZER_FILE))
        (path / TASK_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path

    def _masked(
        self, pairs: Sequence[NspExample], indices, *, split: str, step: int = 0
    ) -> dict[str, torch.Tensor]:
        """Pad pairs[indices] and mask each row with its own generator, seeded from
        (split, data_seed, step, index): the same example at the same step is always masked
        the same way, whatever batch it is in."""
        indices = [index for index in indices if index < len(pairs)]
        batch = pad_examples([pairs[index] for index in indices], pad_id=self.special.pad)
        input_ids, labels = batch["input_ids"], torch.full_like(batch["input_ids"], IGNORE_INDEX)
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        for row, (index, length) in enumerate(zip(indices, lengths, strict=True)):
            seed = _seed(split, self.options.data_seed, step, index)
            input_ids[row, :length], labels[row, :length] = mask_tokens(
                input_ids[row, :length],  # (length,): no padding, so no special_mask
                special_ids=self.special.never_selected,
                vocab_size=self.tokenizer.get_vocab_size(),
                mask_token_id=self.special.mask,
                generator=torch.Generator().manual_seed(seed),
            )
        return {**batch, "input_ids": input_ids, "labels": labels}


def pack_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A padded batch's real tokens in one row, pair after pair: input_ids, token_type_ids,
    labels and attention_mask (1, T), sequence_lengths (B,) and next_sentence_label (B,) for
    `BertForPreTraining(..., sequence_lengths=...)` (FlashAttention's varlen layout: no
    padding, attention kept within each pair by `qkv.sparse.Packed`)."""
    real = batch["attention_mask"].bool()  # (B, L), right-padded rows
    packed = {
        name: batch[name][real][None]  # (1, T): row after row, real tokens only
        for name in ("input_ids", "token_type_ids", "labels", "attention_mask")
    }
    lengths = real.sum(dim=1)  # (B,)
    return {
        **packed,
        "sequence_lengths": lengths,
        "next_sentence_label": batch["next_sentence_label"],
    }


def _summed_losses(
    output, batch: dict[str, torch.Tensor], selected: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """{"mlm": CE summed over labelled tokens, "nsp": CE summed over pairs}, in fp32. With
    `selected`, output.logits hold only those positions' scores, (N, V)."""
    V = output.logits.shape[-1]
    labels = batch["labels"] if selected is None else batch["labels"][selected]
    mlm = F.cross_entropy(
        output.logits.reshape(-1, V).float(),  # (B * L, V) or (N, V)
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    nsp = F.cross_entropy(
        output.nsp_logits.float(), batch["next_sentence_label"], reduction="sum"
    )  # (B, 2) against (B,)
    return {"mlm": mlm, "nsp": nsp}


def _seed(split: str, data_seed: int, step: int, index: int) -> int:
    """A 63-bit generator seed that depends on nothing but its arguments (no process state)."""
    key = f"{split}:{data_seed}:{step}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _documents(data: str | None) -> list[list[str]]:
    return pydoc_documents() if data is None else text_file_documents(data)


def _training_pairs(train, tokenizer, options: BertOptions) -> list[NspExample]:
    """dupe_factor sets of NSP pairs of the training documents, one per seed (the reference's
    dupe_factor: the same text cut into other pairs, with other random sentences B, so that
    next-sentence prediction cannot just memorise one set of pairs)."""
    check_positive_int("dupe_factor", options.dupe_factor)
    return [
        pair
        for copy in range(options.dupe_factor)
        for pair in make_nsp_examples(
            train, tokenizer, max_length=options.max_length, seed=options.data_seed + copy
        )
    ]


def _validation_pairs(valid, train, tokenizer, options: BertOptions) -> list[NspExample]:
    """NSP pairs of the validation documents. A random B comes from another validation
    document; only when a single document is held out (a small --data file) from a training
    one, whose tokens the model has then seen."""
    if not valid:
        raise ValueError(
            "data: expected at least 3 documents (blank lines separate them): two to train "
            "next-sentence prediction on and one to hold out for validation"
        )
    documents = valid if len(valid) >= 2 else [*valid, *train]
    pairs = make_nsp_examples(
        documents, tokenizer, max_length=options.max_length, seed=options.data_seed
    )
    return [pair for pair in pairs if pair.document_index < len(valid)]
