"""The `gpt` task: causal language modelling on the documentation CPython ships.

GPT learns to predict every next token from the ones before it (the causal mask: position i sees
only positions j <= i). The text is that of `pydoc_data.topics` (or the user's `--data FILE`), split
by document into training and validation, tokenised with a byte-level BPE trained on the training
documents (GPT-2's scheme, Radford et al. 2019 section 2.2), joined with <|endoftext|> and cut into
blocks of block_size tokens (`qkv.data.lm`). The loss is the summed next-token cross-entropy; a
block of T tokens gives T - 1 predictions.

The model is GPT-2 style by default (`family="gpt2"`: learned positions, LayerNorm, a GELU FFN,
biases, output head tied to the token embedding, which halves the parameters of a small model
whose embedding is most of it); `family="llama"` gives RoPE, RMSNorm, SwiGLU, no biases and a
separate head, with GQA through num_kv_heads. Evaluation reports the validation loss, its
perplexity exp(loss) and, as the number to beat, the unigram entropy of the training tokens:
the loss of the best model that ignores context.

With `pack` (`qkv train gpt --pack`), each document attends only to itself: a micro-batch's
blocks are laid end to end in one row, cut after every <|endoftext|> and at block edges, and
the pieces go to the model as `sequence_lengths` (`qkv.sparse.Packed`: positions restart per
piece, no attention and no loss across a cut). The loss is then exactly that of running every
piece alone, as a padded batch of documents would, with no work spent on padding.

With `context_parallel` N (`torchrun --nproc-per-node N -m qkv.cli train gpt --context-parallel
N`), the N processes share every sequence instead of every batch: each holds a zigzag share of
each block (`qkv.distributed.shard_lm_batch`: its tokens, their next-token targets and global
positions) and every attention layer is a ring over them (`qkv.distributed.RingAttention`,
Liu et al. 2023), so a block longer than one process could attend over fits. The loss and the
gradients are those of one process on the same batch; evaluation runs whole blocks on rank 0.

After `qkv train gpt`, `qkv generate runs/gpt/model --prompt "The"` continues a prompt: the
model folder holds qkv's checkpoint and the tokenizer.json that `load_for_generation` reads.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qkv.data import (
    END_OF_TEXT,
    IGNORE_INDEX,
    causal_lm_blocks,
    pydoc_texts,
    text_file_texts,
    train_bpe,
    train_validation_split,
)
from qkv.distributed import RingAttention, local_attention, shard_lm_batch, use_ring_attention
from qkv.models import GPT, GPTConfig, save
from qkv.training.distributed import Distributed, shard

__all__ = ["GPTOptions", "GPTTask", "check_validation_fraction", "unigram_entropy"]

logger = logging.getLogger(__name__)  # the stages of data preparation, at INFO

TASK_FILE = "task.json"
TOKENIZER_FILE = "tokenizer.json"  # the name `qkv generate` looks for
FAMILIES = {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}  # the GPTConfig preset each starts from
_EVAL_BATCH = 64


@dataclass(frozen=True)
class GPTOptions:
    """Data and model sizes of the gpt task (`qkv train gpt --help`)."""

    data: str | None = None  # a UTF-8 text file (blank lines separate documents)
    family: str = "gpt2"  # "gpt2" (learned positions, LayerNorm, GELU, tied) or "llama"
    vocab_size: int = 4000
    block_size: int = 128
    embed_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: = num_heads; fewer for GQA, 1 for MQA
    ffn_dim: int = 512
    dropout: float = 0.1
    validation_fraction: float = 0.1
    data_seed: int = 0  # which documents go to validation
    pack: bool = False  # documents attend only to themselves (cut at <|endoftext|>)
    context_parallel: int = 1  # processes sharing each sequence (ring attention)

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "family": "'gpt2' (learned positions, LayerNorm, GELU, tied head) or 'llama' (RoPE, "
        "RMSNorm, SwiGLU, untied head)",
        "vocab_size": "size of the trained byte-level BPE (at most)",
        "block_size": "tokens per training sequence",
        "num_layers": "decoder blocks",
        "num_kv_heads": "key/value heads (fewer than num-heads: GQA; 1: MQA; default: MHA)",
        "validation_fraction": "share of the documents held out for validation",
        "pack": "each document attends only to itself: blocks cut after every <|endoftext|>, "
        "packed into one row (no attention or loss across documents)",
        "context_parallel": "processes sharing each sequence by ring attention (the number of "
        "torchrun processes; needs --dropout 0)",
    }


class GPTTask:
    """Token blocks, BPE tokenizer and model of the gpt task; see the module docstring."""

    name = "gpt"
    # `qkv train gpt` defaults: on a CPU, smaller batches and a larger learning rate than the
    # shared TrainingConfig defaults learn more per second.
    training_defaults = {"batch_size": 32, "learning_rate": 2e-3, "steps": 300}

    def __init__(self, options: GPTOptions = GPTOptions()) -> None:
        if options.family not in FAMILIES:
            raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {options.family!r}")
        check_validation_fraction(options.validation_fraction)
        _check_context_parallel(options)
        self.options = options
        logger.info("reading %s", options.data or "the texts of pydoc_data.topics")
        texts = pydoc_texts() if options.data is None else text_file_texts(options.data)
        train, valid = train_validation_split(
            texts, validation_fraction=options.validation_fraction, seed=options.data_seed
        )
        if not valid:
            raise ValueError(
                f"data: {len(texts)} document(s); expected at least 2 (blank lines separate "
                f"documents), so that one can be held out for validation"
            )
        logger.info(
            "training a byte-level BPE of %d tokens on %d documents", options.vocab_size,
            len(train),
        )  # fmt: skip
        self.tokenizer = train_bpe(train, vocab_size=options.vocab_size)
        logger.info("cutting %d documents into blocks of %d tokens", len(texts), options.block_size)
        self.train_blocks = causal_lm_blocks(train, self.tokenizer, block_size=options.block_size)
        self.valid_blocks = causal_lm_blocks(valid, self.tokenizer, block_size=options.block_size)
        self.unigram_entropy = unigram_entropy(self.train_blocks.blocks)
        self.end_of_text = self.tokenizer.token_to_id(END_OF_TEXT)

    def __len__(self) -> int:
        return len(self.train_blocks)

    def describe(self) -> dict:
        """The options that shape data and model; not context_parallel, which changes only how
        processes share the work (a run resumes on another number of processes)."""
        options = asdict(self.options)
        del options["context_parallel"]
        return {"name": self.name, **options}

    def share(self, indices: list[int], context: Distributed) -> list[int]:
        """This process's examples of a global batch: every one with context parallelism
        (each process then takes its share of every sequence), else its slice (`shard`)."""
        parallel = self.options.context_parallel
        if parallel == 1:
            return shard(indices, context)
        if context.world_size != parallel:
            raise ValueError(
                f"context_parallel: {parallel} processes share each sequence, but the run has "
                f"{context.world_size}; start it with torchrun --nproc-per-node {parallel}"
            )
        return indices

    def build_model(self) -> GPT:
        options = self.options
        config = GPTConfig.from_name(
            FAMILIES[options.family], vocab_size=self.tokenizer.get_vocab_size(),
            embed_dim=options.embed_dim, num_layers=options.num_layers,
            num_heads=options.num_heads, num_kv_heads=options.num_kv_heads,
            ffn_dim=options.ffn_dim, max_positions=options.block_size,
            dropout=options.dropout, attention_dropout=options.dropout,
        )  # fmt: skip
        model = GPT(config)
        if options.context_parallel > 1:  # a group of its own: DDP's all-reduces use the default
            group = dist.new_group(ranks=list(range(dist.get_world_size())))
            use_ring_attention(model, RingAttention(group=group, length=options.block_size))
        return model

    def collate(self, indices: list[int], *, step: int = 0) -> dict[str, torch.Tensor]:
        """The blocks at `indices`: {"input_ids": (B, T)}; no randomness, so step is unused.
        With `pack`: {"input_ids": (1, B * T), "sequence_lengths": (S,)} (`pack_documents`).
        With context parallelism: this process's share (`shard_lm_batch`)."""
        blocks = self.train_blocks.blocks[indices]  # (B, T)
        parallel = self.options.context_parallel
        if parallel > 1:
            return shard_lm_batch(blocks, dist.get_rank(), parallel)
        return self._batch(blocks)

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        if "targets" in batch:  # a share of each sequence: its real targets
            return {"tokens": int((batch["targets"] != IGNORE_INDEX).sum())}
        B, T = batch["input_ids"].shape
        pieces = len(batch["sequence_lengths"]) if "sequence_lengths" in batch else B
        return {"tokens": B * T - pieces}  # every position but a piece's last predicts

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def loss_sums(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Summed cross-entropy of logits[:, i] against input_ids[:, i + 1] (within a piece)."""
        if "targets" in batch:  # a share of each sequence, its targets and positions given
            logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
            targets = batch["targets"].flatten()  # (B * n,)
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            return {"tokens": loss}
        lengths = batch.get("sequence_lengths")
        packed = {} if lengths is None else {"sequence_lengths": lengths.tolist()}
        logits = model(batch["input_ids"], **packed).logits
        return {"tokens": summed_next_token_loss(logits, batch)}

    def _batch(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.options.pack:
            return {"input_ids": blocks}
        return pack_documents(blocks, self.end_of_text)

    @torch.no_grad()
    def evaluate(self, model: GPT) -> dict[str, float]:
        """Validation next-token loss (nats per token), its perplexity, and the unigram entropy
        of the training tokens for comparison. Call it with the model in eval mode (on one
        process: a context-parallel model attends locally for the duration)."""
        with local_attention(model):
            return self._evaluate(model)

    def _evaluate(self, model: GPT) -> dict[str, float]:
        total, count = 0.0, 0
        for start in range(0, len(self.valid_blocks), _EVAL_BATCH):
            stop = min(start + _EVAL_BATCH, len(self.valid_blocks))
            batch = self._batch(self.valid_blocks.blocks[start:stop])  # (B, T), or packed
            total += float(self.loss_sums(model, batch)["tokens"])
            count += self.counts(batch)["tokens"]
        loss = total / max(count, 1)
        return {
            "valid_loss": loss,
            "valid_perplexity": math.exp(min(loss, 700.0)),  # exp(700) is near float's limit
            "unigram_entropy": self.unigram_entropy,
        }

    def save(self, model: GPT, path: str | os.PathLike) -> Path:
        """The model as a qkv checkpoint, with tokenizer.json and task.json beside it: the
        folder `qkv generate PATH --prompt ...` reads."""
        path = save(model, path)
        self.tokenizer.save(str(path / TOKENIZER_FILE))
        (path / TASK_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path


def pack_documents(blocks: torch.Tensor, end_of_text: int) -> dict[str, torch.Tensor]:
    """Blocks (B, T) laid end to end in one row and cut after every end_of_text token and at
    every block edge: {"input_ids": (1, B * T), "sequence_lengths": (S,) the pieces' lengths}."""
    B, T = blocks.shape
    flat = blocks.reshape(-1)  # (B * T,)
    cuts = set(range(0, B * T + 1, T))  # block edges
    cuts.update((torch.nonzero(flat == end_of_text).flatten() + 1).tolist())  # after each end
    edges = torch.tensor(sorted(cuts))
    return {"input_ids": flat[None], "sequence_lengths": edges.diff()}


def summed_next_token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over b and i < T - 1 of -log softmax(logits[b, i])[input_ids[b, i + 1]], in fp32;
    packed (a "sequence_lengths" entry), no piece's last token predicts the next piece's first.

    The targets move rather than the logits (the last position gets the ignored label), so the
    (B, T, V) logits are not copied; as `qkv.models.gpt.next_token_loss`, but summed.
    """
    input_ids = batch["input_ids"]  # (B, T)
    targets = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
    if "sequence_lengths" in batch:  # (1, T): the last token of every piece predicts nothing
        targets[:, batch["sequence_lengths"].cumsum(0) - 1] = IGNORE_INDEX
    return F.cross_entropy(
        logits.flatten(0, 1).float(),  # (B * T, V)
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def unigram_entropy(token_ids: torch.Tensor, *, exclude: tuple[int, ...] = ()) -> float:
    """H = -sum_t p(t) log p(t) in nats, p the frequency of each token id in `token_ids` (any
    shape), ids in `exclude` left out. It is the cross-entropy on these tokens of the best
    predictor that ignores context, so a language model must get below it to use context."""
    ids = token_ids.flatten()
    if exclude:
        ids = ids[~torch.isin(ids, torch.tensor(exclude, dtype=ids.dtype))]
    if ids.numel() == 0:
        raise ValueError("token_ids: expected at least one token that is not excluded, got none")
    counts = torch.bincount(ids).double()
    p = counts[counts > 0] / ids.numel()
    return float(-(p * p.log()).sum())


def _check_context_parallel(options: GPTOptions) -> None:
    parallel = options.context_parallel
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"context_parallel: expected an int >= 1, got {parallel!r}")
    if parallel > 1 and options.pack:
        raise ValueError("context_parallel: packed documents (--pack) are not sharded; drop one")
    if parallel > 1 and options.dropout > 0:
        raise ValueError(
            f"context_parallel: ring attention has no attention dropout; expected --dropout 0, "
            f"got {options.dropout}"
        )


def check_validation_fraction(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(
            f"validation_fraction: expected a number in (0, 1) (evaluation needs held-out "
            f"documents), got {value!r}"
        )
