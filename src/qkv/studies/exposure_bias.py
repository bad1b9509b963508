"""Exposure bias: teacher forcing against scheduled sampling on the German -> English numbers.

A model trained with teacher forcing always reads the reference's previous token, but at test
time it reads its own; an early mistake puts it in states it never saw in training, and the
errors may compound (Bengio et al. 2015, "Scheduled Sampling for Sequence Prediction with
Recurrent Neural Networks", s1). Scheduled sampling (their s2.1-2.3) flips a coin for every
target token of every training sequence: with probability eps_i the decoder reads the
reference's previous token, otherwise its own prediction, and eps_i decays over training
steps i. Here the prediction is the greedy one (the argmax of the previous step's logits, no
gradient through the choice) and the decay is the paper's inverse sigmoid,

    eps_i = k / (k + exp(i / k)),   k >= 1,

which stays near 1 for the first steps and falls to about 0 by the end.

Two copies of the same GRU encoder-decoder (`RNNSeq2Seq` with Luong et al. 2015's general
attention, whose teacher-forced pass runs the whole target at once) start from the same
weights, read the same batches in the same order for the same number of steps, and differ only
in what the decoder reads. Both are scored on held-out numbers by free-running greedy decoding:
the token error at each target position (a position counts as wrong when the token there
differs from the reference's, [EOS] included), the same error among the outputs whose prefix
up to that position is right (the error the decoder makes from a correct history, what teacher
forcing trains), where the first error falls, exact match; beside the teacher-forced
validation loss and token error, which see the reference at every step.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from qkv.models.losses import sequence_cross_entropy
from qkv.models.rnn_seq2seq import RNNSeq2Seq
from qkv.studies.before_transformer import build_model
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler
from qkv.training.tasks.translate import TranslateOptions, TranslateTask

__all__ = [
    "CLAIM",
    "LABELS",
    "RUNS",
    "SIZES",
    "TITLE",
    "figure",
    "inverse_sigmoid_decay",
    "run",
    "scheduled_sampling_loss",
]

TITLE = "Exposure bias: teacher forcing vs scheduled sampling"
CLAIM = (
    "A GRU encoder-decoder trained with teacher forcing reads only reference prefixes, so at "
    "test time its own mistakes are expected to compound along the output; scheduled sampling "
    "(Bengio et al. 2015, s2), which feeds the model its own predictions with a probability "
    "rising over training, is expected to lower the free-running error, most at late positions."
)
RUNS = ("teacher", "scheduled")
LABELS = {"teacher": "teacher forcing", "scheduled": "scheduled sampling"}
_EVAL_BATCH = 250

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "max_number": 99, "num_train": 64, "num_valid": 8, "num_test": 16, "vocab_size": 40,
        "attention": "general", "rnn_embed_dim": 8, "rnn_hidden_size": 8, "attention_dim": 8,
        "train_steps": 3, "batch_size": 8, "learning_rate": 3e-3, "warmup_steps": 1,
        "weight_decay": 0.0, "label_smoothing": 0.1, "dropout": 0.0, "max_length": 16,
        "decay_k": 2.0, "position_edges": [2, 4], "min_position_count": 1,
    },
    "default": {
        "max_number": 999_999, "num_train": 10_000, "num_valid": 300, "num_test": 1_000,
        "vocab_size": 64, "attention": "general", "rnn_embed_dim": 32, "rnn_hidden_size": 32,
        "attention_dim": 32, "train_steps": 600, "batch_size": 64, "learning_rate": 3e-3,
        "warmup_steps": 40, "weight_decay": 0.0, "label_smoothing": 0.1, "dropout": 0.0,
        "max_length": 48, "decay_k": 70.0, "position_edges": [5, 10, 15, 20, 25],
        "min_position_count": 20,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


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


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the model twice (teacher forcing, scheduled sampling) on one data order from one
    initialisation; score both teacher-forced and free-running."""
    task = _task(settings)
    order = data_order(len(task.train_set), steps=settings["train_steps"],
                       batch_size=settings["batch_size"], seed=seed)  # fmt: skip
    epsilons = [inverse_sigmoid_decay(i, k=settings["decay_k"]) for i in range(len(order))]
    series: dict[str, Any] = {"runs": list(RUNS), "epsilon": epsilons}
    for name in RUNS:
        torch.manual_seed(seed)  # the same initial weights for both runs
        model = build_model(settings["attention"], task, settings)
        schedule = epsilons if name == "scheduled" else None
        seconds, loss = _train(model, task, order, settings, schedule=schedule, seed=seed)
        series[name] = {
            "train_seconds": seconds, "final_loss": loss, **_teacher_forced(model, task),
            **_free_running(model, task, settings),
        }  # fmt: skip
        logger.info("%s: %.1f%% exact match, %.0f s", name, 100 * series[name]["exact_match"],
                    seconds)  # fmt: skip
    series["position_edges"] = settings["position_edges"]
    columns, rows = _table(series)
    return StudyResult(
        name="exposure-bias", title=TITLE, claim=CLAIM, columns=columns, rows=rows,
        findings=_findings(series, settings), series=series,
    )  # fmt: skip


def _task(settings: dict[str, Any]) -> TranslateTask:
    """The translate task's pairs and BPE at the study's sizes (its Transformer is unused)."""
    options = TranslateOptions(
        max_number=settings["max_number"], num_train=settings["num_train"],
        num_valid=settings["num_valid"], num_test=settings["num_test"],
        vocab_size=settings["vocab_size"], dropout=settings["dropout"],
        label_smoothing=settings["label_smoothing"], max_length=settings["max_length"],
    )  # fmt: skip
    return TranslateTask(options)


def _train(
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
def _teacher_forced(model: RNNSeq2Seq, task: TranslateTask) -> dict[str, float]:
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
def _free_running(
    model: RNNSeq2Seq, task: TranslateTask, settings: dict[str, Any]
) -> dict[str, Any]:
    """Greedy outputs on the test numbers against the references, position by position."""
    dataset, wrong = task.test_set, []
    for start in range(0, len(dataset), _EVAL_BATCH):
        batch = dataset.collate(list(range(start, min(start + _EVAL_BATCH, len(dataset)))))
        labels = batch["labels"]  # (B, L)
        sequences, _ = model.greedy_decode(
            batch["input_ids"], batch["attention_mask"], max_new_tokens=settings["max_length"]
        )  # (B, 1 + T)
        outputs = torch.full_like(labels, -1)  # -1: no token there
        T = min(labels.shape[1], sequences.shape[1] - 1)
        outputs[:, :T] = sequences[:, 1 : 1 + T]
        for row, reference in zip(outputs.tolist(), labels.tolist(), strict=True):
            length = sum(token >= 0 for token in reference)
            wrong.append([row[t] != reference[t] for t in range(length)])
    return _position_errors(wrong)


def _position_errors(wrong: list[list[bool]]) -> dict[str, Any]:
    """From each output's per-position mistakes: counts, errors and errors after a correct
    prefix at every position, first-error positions, token error and exact match."""
    longest = max(len(flags) for flags in wrong)
    count, errors = [0] * longest, [0] * longest
    prefix_right, prefix_errors = [0] * longest, [0] * longest
    first_error = []
    for flags in wrong:
        first = flags.index(True) if True in flags else None
        first_error.append(first)
        for t, flag in enumerate(flags):
            count[t] += 1
            errors[t] += flag
            if first is None or t <= first:  # the prefix before t is right
                prefix_right[t] += 1
                prefix_errors[t] += flag
    return {
        "count": count, "errors": errors, "prefix_right": prefix_right,
        "prefix_errors": prefix_errors, "first_error": first_error,
        "token_error": sum(errors) / sum(count),
        "exact_match": sum(first is None for first in first_error) / len(wrong),
    }  # fmt: skip


def _bins(edges: list[int], longest: int) -> list[tuple[str, range]]:
    """Target-position bins: 0..e0-1, e0..e1-1, ..., e_last.. (positions from 0)."""
    bounds = [0, *edges, max(longest, edges[-1] + 1)]
    labels = [f"{low}-{high - 1}" for low, high in zip(bounds[:-2], bounds[1:-1], strict=True)]
    labels.append(f">={edges[-1]}")
    return [(label, range(bounds[i], bounds[i + 1])) for i, label in enumerate(labels)]


def _rate(numerator: list[int], denominator: list[int], positions: range) -> float | None:
    total = sum(denominator[t] for t in positions if t < len(denominator))
    return sum(numerator[t] for t in positions if t < len(numerator)) / total if total else None


def _table(series: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per run: losses, teacher-forced and free-running error, exact match, error by
    target position."""
    longest = max(len(series[name]["count"]) for name in RUNS)
    bins = _bins(series["position_edges"], longest)
    columns = ["training", "train s", "final loss", "valid loss (TF)", "token err (TF)",
               "token err (free)", "exact match"]  # fmt: skip
    columns += [f"err pos {label}" for label, _ in bins]
    rows = []
    for name in RUNS:
        part = series[name]
        row = {
            "training": LABELS[name], "train s": part["train_seconds"],
            "final loss": part["final_loss"], "valid loss (TF)": part["valid_loss"],
            "token err (TF)": part["teacher_forced_error"],
            "token err (free)": part["token_error"], "exact match": part["exact_match"],
        }  # fmt: skip
        for label, positions in bins:
            row[f"err pos {label}"] = _rate(part["errors"], part["count"], positions)
        rows.append(row)
    return columns, rows


def _findings(series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the numbers: exact match and token error free-running, the gap to
    the teacher-forced figures, how much of the error follows an earlier error, where the first
    error falls, and the schedule."""
    teacher, scheduled = series["teacher"], series["scheduled"]
    change = 100 * (scheduled["exact_match"] - teacher["exact_match"])
    findings = [
        f"Free-running greedy decoding of {len(teacher['first_error'])} held-out numbers after "
        f"{settings['train_steps']} steps of {settings['batch_size']} pairs: exact match "
        f"{teacher['exact_match']:.1%} (teacher forcing) and {scheduled['exact_match']:.1%} "
        f"(scheduled sampling, {change:+.1f} points); token error {teacher['token_error']:.2%} "
        f"and {scheduled['token_error']:.2%}. One seed: the binomial standard error of one "
        f"run's exact match on these numbers is {_standard_error(teacher, scheduled):.1%}.",
        "Teacher-forced on the validation numbers (reading the reference) the loss is "
        + " and ".join(f"{series[name]['valid_loss']:.3f}" for name in RUNS)
        + " and the token error "
        + " and ".join(f"{series[name]['teacher_forced_error']:.2%}" for name in RUNS)
        + "; free-running the token error is "
        + " and ".join(
            f"{_ratio(series[name]['token_error'], series[name]['teacher_forced_error'])} the "
            f"teacher-forced one ({LABELS[name]})" for name in RUNS
        ) + ".",
    ]  # fmt: skip
    findings.append(_compounding_finding(series))
    findings.append(_first_error_finding(series))
    epsilons = series["epsilon"]
    own = 1 - sum(epsilons) / len(epsilons)
    findings.append(
        f"Inverse sigmoid decay with k = {settings['decay_k']:g}: eps goes from "
        f"{epsilons[0]:.3f} at the first step to {epsilons[-1]:.3f} at the last, and the "
        f"scheduled-sampling run reads its own prediction for {own:.0%} of"
        " its training tokens in expectation."
    )
    return findings


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.1f} times" if reference > 0 else "(no teacher-forced error)"


def _compounding_finding(series: dict[str, Any]) -> str:
    """The share of wrong tokens that follow an earlier error; in the position bin where
    teacher forcing errs most, the error overall against after a correct prefix; the bin where
    scheduled sampling changes the error most."""
    longest = max(len(series[name]["count"]) for name in RUNS)
    bins = _bins(series["position_edges"], longest)
    overall = {
        name: [_rate(series[name]["errors"], series[name]["count"], p) or 0.0 for _, p in bins]
        for name in RUNS
    }
    peak = max(range(len(bins)), key=lambda b: overall["teacher"][b])
    parts = []
    for name in RUNS:
        part = series[name]
        errors = sum(part["errors"])
        after = 1 - sum(part["prefix_errors"]) / errors if errors else 0.0
        clean = _rate(part["prefix_errors"], part["prefix_right"], bins[peak][1])
        parts.append(
            f"with {LABELS[name]}, {after:.0%} of the wrong tokens follow an earlier error, "
            f"and at positions {bins[peak][0]} {overall[name][peak]:.1%} of all tokens are "
            f"wrong but {_percent(clean)} of those that follow a correct prefix"
        )
    change = [overall["scheduled"][b] - overall["teacher"][b] for b in range(len(bins))]
    most = max(range(len(bins)), key=lambda b: abs(change[b]))
    return (
        "Free-running, "
        + "; ".join(parts)
        + f". Scheduled sampling changes the error most at positions "
        f"{bins[most][0]}: {overall['teacher'][most]:.1%} -> {overall['scheduled'][most]:.1%}."
    )


def _standard_error(*parts: dict[str, Any]) -> float:
    """sqrt(p (1 - p) / n) at the runs' mean exact match p over n test numbers."""
    p = sum(part["exact_match"] for part in parts) / len(parts)
    return math.sqrt(p * (1 - p) / len(parts[0]["first_error"]))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _first_error_finding(series: dict[str, Any]) -> str:
    parts = []
    for name in RUNS:
        firsts = sorted(f for f in series[name]["first_error"] if f is not None)
        if firsts:
            median = firsts[len(firsts) // 2]
            parts.append(f"{len(firsts)} outputs with an error, the first at median position "
                         f"{median} ({LABELS[name]})")  # fmt: skip
        else:
            parts.append(f"no output with an error ({LABELS[name]})")
    return "Where the first error falls: " + "; ".join(parts) + "."


def figure(result: StudyResult):
    """Token error by target position, overall and after a correct prefix; where the first
    error falls; the schedule eps_i."""
    import matplotlib.pyplot as plt

    series, colors = result.series, {"teacher": "tab:blue", "scheduled": "tab:orange"}
    minimum = result.settings.get("min_position_count", 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in RUNS:
        part = series[name]
        shown = [t for t, n in enumerate(part["count"]) if n >= minimum]
        axes[0].plot(shown, [part["errors"][t] / part["count"][t] for t in shown], marker=".",
                     color=colors[name], label=f"{LABELS[name]}: all outputs")  # fmt: skip
        clean = [t for t in shown if part["prefix_right"][t]]
        axes[0].plot(clean, [part["prefix_errors"][t] / part["prefix_right"][t] for t in clean],
                     color=colors[name], linestyle="--",
                     label=f"{LABELS[name]}: after a correct prefix")  # fmt: skip
        firsts = [f for f in part["first_error"] if f is not None]
        axes[1].hist(firsts, bins=range(len(part["count"]) + 1), alpha=0.5,
                     color=colors[name], label=LABELS[name])  # fmt: skip
    axes[0].set(xlabel="target position", ylabel="token error rate (free-running)",
                title="Error rate by position")  # fmt: skip
    axes[1].set(xlabel="position of the first error", ylabel="test outputs",
                title="First error")  # fmt: skip
    axes[2].plot(range(len(series["epsilon"])), series["epsilon"], color=colors["scheduled"])
    axes[2].set(xlabel="training step i", ylabel="eps_i (reference token read)",
                title="Inverse sigmoid decay", ylim=(0, 1.02))  # fmt: skip
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    fig.suptitle(result.title, fontsize=11)
    fig.tight_layout()
    return fig
