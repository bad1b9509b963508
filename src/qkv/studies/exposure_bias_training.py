"""Training and scoring for the exposure-bias study (`qkv.studies.exposure_bias`): a GRU
encoder-decoder (`RNNSeq2Seq`) on the translate task's German -> English numbers
(`numbers_task`).

Scheduled sampling (Bengio et al. 2015, "Scheduled Sampling for Sequence Prediction with
Recurrent Neural Networks", s2.1-2.3) flips a coin for every target token of every training
sequence: with probability eps_i the decoder reads the reference's previous token, otherwise its
own greedy prediction (no gradient through the choice), and eps_i decays over training steps i
by the inverse sigmoid `inverse_sigmoid_decay`. `train_model` trains with it or with teacher
forcing; `teacher_forced_scores` scores a model reading the reference, `free_running_mistakes`
its own greedy outputs, token by token.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from qkv.models.losses import sequence_cross_entropy
from qkv.models.rnn_seq2seq import RNNSeq2Seq
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler
from qkv.training.tasks.translate import TranslateOptions, TranslateTask

__all__ = [
    "free_running_mistakes",
    "inverse_sigmoid_decay",
    "numbers_task",
    "scheduled_sampling_loss",
    "teacher_forced_scores",
    "train_model",
]

_EVAL_BATCH = 250


def numbers_task(settings: dict[str, Any]) -> TranslateTask:
    """The translate task's pairs and BPE at the study's sizes (its Transformer is unused)."""
    options = TranslateOptions(
        max_number=settings["max_number"], num_train=settings["num_train"],
        num_valid=settings["num_valid"], num_test=settings["num_test"],
        vocab_size=settings["vocab_size"], dropout=settings["dropout"],
        label_smoothing=settings["label_smoothing"], max_length=settings["max_length"],
    )  # fmt: skip
    return TranslateTask(options)


def inverse_sigmoid_decay(step: int, *, k: float) -> float:
    """eps_i = k / (k + exp(i / k)) (Bengio et al. 2015 s2.1, inverse sigmoid decay): the
    probability of reading the reference's token at training step i; k >= 1 sets the speed."""
    if not k >= 1.0:
        raise ValueError(f"k: expected a number >= 1, got {k!r}")
    exponent = step / k
    return 0.0 if exponent > 700 else k / (k + math.exp(exponent))


def scheduled_sampling_loss(
    model: RNNSeq2Seq,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    epsilon: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder run one target step at a time, reading at each step the reference's
    previous token with probability epsilon, else its own greedy prediction (Bengio et al.
    2015 s2.1; one coin per token and sequence).

    labels (B, L) with -100 where nothing is predicted. Returns (loss: the model's
    label-smoothed cross-entropy, logits (B, L, V), decoder_input_ids (B, L): [BOS] and the
    tokens read). With epsilon = 1 this is the model's teacher-forced pass.
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon <= 1:
        raise ValueError(f"epsilon: expected a probability in [0, 1], got {epsilon!r}")
    config = model.config
    B, L = labels.shape
    gold = labels.masked_fill(labels < 0, config.pad_token_id)  # (B, L)
    state = model.encode(input_ids, attention_mask)
    previous = labels.new_full((B,), config.bos_token_id)  # (B,)
    read, steps = [previous], []
    for t in range(L):
        logits, _ = model.decode(previous[:, None], state)  # (B, 1, V)
        steps.append(logits[:, 0])
        if t == L - 1:
            break
        coin = torch.rand(B, generator=generator, device=labels.device)
        predicted = logits[:, 0].detach().argmax(dim=-1)  # (B,)
        previous = torch.where(coin < epsilon, gold[:, t], predicted)
        read.append(previous)
    logits = torch.stack(steps, dim=1)  # (B, L, V)
    loss = sequence_cross_entropy(logits, labels, label_smoothing=config.label_smoothing)
    return loss, logits, torch.stack(read, dim=1)


def train_model(
    model: RNNSeq2Seq,
    task: TranslateTask,
    order: torch.Tensor,
    settings: dict[str, Any],
    *,
    schedule: list[float] | None,
    seed: int,
) -> tuple[float, float]:
    """AdamW, warm-up then cosine decay, gradients clipped at 1; teacher forcing when schedule
    is None, else scheduled sampling with eps_i = schedule[i]. Returns (seconds, last loss)."""
    optimizer = build_optimizer(
        model, learning_rate=settings["learning_rate"], weight_decay=settings["weight_decay"]
    )
    scheduler = build_scheduler(
        optimizer, warmup_steps=settings["warmup_steps"], total_steps=len(order), kind="cosine"
    )
    coins = torch.Generator().manual_seed(seed)
    model.train()
    started, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step, indices in enumerate(order.tolist()):
        batch = task.train_set.collate(indices)
        inputs = (batch["input_ids"], batch["attention_mask"], batch["labels"])
        if schedule is None:
            loss = model(*inputs[:2], labels=inputs[2]).loss
        else:
            loss = scheduled_sampling_loss(model, *inputs, epsilon=schedule[step],
                                           generator=coins)[0]  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    model.eval()
    return time.perf_counter() - started, float(loss.detach())


@torch.no_grad()
def teacher_forced_scores(model: RNNSeq2Seq, task: TranslateTask) -> dict[str, float]:
    """On the validation numbers, reading the reference: mean cross-entropy per target token
    (no smoothing) and the share of tokens whose argmax is wrong."""
    dataset = task.valid_set
    total, wrong, count = 0.0, 0, 0
    for start in range(0, len(dataset), _EVAL_BATCH):
        batch = dataset.collate(list(range(start, min(start + _EVAL_BATCH, len(dataset)))))
        labels = batch["labels"]  # (B, L)
        logits = model(batch["input_ids"], batch["attention_mask"], labels=labels).logits
        n = int((labels >= 0).sum())
        total += n * float(sequence_cross_entropy(logits, labels))
        wrong += int(((logits.argmax(dim=-1) != labels) & (labels >= 0)).sum())
        count += n
    return {"valid_loss": total / count, "teacher_forced_error": wrong / count}


@torch.no_grad()
def free_running_mistakes(
    model: RNNSeq2Seq, task: TranslateTask, *, max_length: int
) -> list[list[bool]]:
    """Greedy outputs on the test numbers against the references: for each number, whether the
    token at each target position differs from the reference's ([EOS] included; a position the
    output does not reach counts as wrong)."""
    dataset, wrong = task.test_set, []
    for start in range(0, len(dataset), _EVAL_BATCH):
        batch = dataset.collate(list(range(start, min(start + _EVAL_BATCH, len(dataset)))))
        labels = batch["labels"]  # (B, L)
        sequences, _ = model.greedy_decode(
            batch["input_ids"], batch["attention_mask"], max_new_tokens=max_length
        )  # (B, 1 + T)
        outputs = torch.full_like(labels, -1)  # -1: no token there
        T = min(labels.shape[1], sequences.shape[1] - 1)
        outputs[:, :T] = sequences[:, 1 : 1 + T]
        for row, reference in zip(outputs.tolist(), labels.tolist(), strict=True):
            length = sum(token >= 0 for token in reference)
            wrong.append([row[t] != reference[t] for t in range(length)])
    return wrong
