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

For each of several seeds, two copies of the same GRU encoder-decoder (`RNNSeq2Seq` with Luong
et al. 2015's general attention, whose teacher-forced pass runs the whole target at once) start
from the same weights, read the same batches in the same order for the same number of steps,
and differ only in what the decoder reads; the seeds differ in both the initial weights and the
data order. Every run is scored on held-out numbers by free-running greedy decoding:
the token error at each target position (a position counts as wrong when the token there
differs from the reference's, [EOS] included), the same error among the outputs whose prefix
up to that position is right (the error the decoder makes from a correct history, what teacher
forcing trains), exact match; beside the teacher-forced validation loss and token error, which
see the reference at every step. The two trainings are compared seed by seed: the mean and
standard deviation over seeds of each, and of the paired difference, with the number of seeds
each one wins and a paired t-test (Student 1908). The decay, the loss, the training and the
scoring are `qkv.studies.exposure_bias_training`'s; this module runs them and reports.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import torch

from qkv.studies.before_transformer import build_model
from qkv.studies.exposure_bias_training import (
    free_running_mistakes,
    inverse_sigmoid_decay,
    numbers_task,
    scheduled_sampling_loss,
    teacher_forced_scores,
    train_model,
)
from qkv.studies.exposure_bias_verdict import verdicts  # noqa: F401
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult
from qkv.studies.statistics import mean_std, mean_std_text, paired_t_p_value
from qkv.training.tasks.translate import TranslateTask

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
    "train_and_score",
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

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "max_number": 99, "num_train": 64, "num_valid": 8, "num_test": 16, "vocab_size": 40,
        "attention": "general", "rnn_embed_dim": 8, "rnn_hidden_size": 8, "attention_dim": 8,
        "train_steps": 3, "batch_size": 8, "learning_rate": 3e-3, "warmup_steps": 1,
        "weight_decay": 0.0, "label_smoothing": 0.1, "dropout": 0.0, "max_length": 16,
        "decay_k": 2.0, "position_edges": [2, 4], "min_position_count": 1, "seeds": 2,
    },
    "default": {
        "max_number": 999_999, "num_train": 10_000, "num_valid": 300, "num_test": 1_000,
        "vocab_size": 64, "attention": "general", "rnn_embed_dim": 32, "rnn_hidden_size": 32,
        "attention_dim": 32, "train_steps": 500, "batch_size": 64, "learning_rate": 3e-3,
        "warmup_steps": 40, "weight_decay": 0.0, "label_smoothing": 0.1, "dropout": 0.0,
        "max_length": 48, "decay_k": 58.0, "position_edges": [5, 10, 15, 20, 25],
        "min_position_count": 20, "seeds": 5,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the model twice (teacher forcing, scheduled sampling) for each of the
    settings["seeds"] seeds seed, seed + 1, ...; a seed sets the initial weights, the data
    order and the sampling coins, the same for both runs of that seed. Every run is scored
    teacher-forced and free-running."""
    count = settings["seeds"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        raise ValueError(f"seeds: expected an int >= 2 (a spread needs two), got {count!r}")
    task = numbers_task(settings)
    steps = settings["train_steps"]
    epsilons = [inverse_sigmoid_decay(i, k=settings["decay_k"]) for i in range(steps)]
    series: dict[str, Any] = {
        "runs": list(RUNS), "seeds": list(range(seed, seed + count)), "epsilon": epsilons,
        "position_edges": settings["position_edges"], "teacher": [], "scheduled": [],
    }  # fmt: skip
    for one in series["seeds"]:
        order = data_order(len(task.train_set), steps=steps, batch_size=settings["batch_size"],
                           seed=one)  # fmt: skip
        for name in RUNS:
            schedule = epsilons if name == "scheduled" else None
            series[name].append(train_and_score(task, order, settings, schedule=schedule, seed=one))
            logger.info("seed %d, %s: %.1f%% exact match", one, name,
                        100 * series[name][-1]["exact_match"])  # fmt: skip
    columns, rows = _table(series)
    return StudyResult(
        name="exposure-bias", title=TITLE, claim=CLAIM, columns=columns, rows=rows,
        findings=_findings(series, settings), series=series,
    )  # fmt: skip


def train_and_score(
    task: TranslateTask,
    order: torch.Tensor,
    settings: dict[str, Any],
    *,
    schedule: list[float] | None,
    seed: int,
) -> dict[str, Any]:
    """One model from the initial weights of `seed`, trained on `order`, then scored."""
    torch.manual_seed(seed)
    model = build_model(settings["attention"], task, settings)
    seconds, loss = train_model(model, task, order, settings, schedule=schedule, seed=seed)
    mistakes = free_running_mistakes(model, task, max_length=settings["max_length"])
    scores = _position_errors(mistakes)
    del scores["first_error"]  # one entry per test number: the counts by position suffice
    return {"seed": seed, "train_seconds": seconds, "final_loss": loss,
            **teacher_forced_scores(model, task), **scores}  # fmt: skip


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


_METRICS = {"train s": "train_seconds", "valid loss (TF)": "valid_loss",
            "token err (TF)": "teacher_forced_error", "token err (free)": "token_error",
            "exact match": "exact_match"}  # fmt: skip


def _metrics(part: dict[str, Any], bins: list[tuple[str, range]]) -> dict[str, float | None]:
    """One run's table cells: losses, errors, exact match, error by target position."""
    values: dict[str, float | None] = {column: part[key] for column, key in _METRICS.items()}
    for label, positions in bins:
        values[f"err pos {label}"] = _rate(part["errors"], part["count"], positions)
    return values


def _table(series: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """A row per seed and run, then each run's mean +- standard deviation over the seeds and
    the paired difference (scheduled sampling - teacher forcing, seed by seed)."""
    bins = _bins(series["position_edges"], len(series["teacher"][0]["count"]))
    cells = {name: [_metrics(part, bins) for part in series[name]] for name in RUNS}
    columns = ["training", "seed", *cells["teacher"][0]]
    rows = [
        {"training": LABELS[name], "seed": seed, **cells[name][i]}
        for i, seed in enumerate(series["seeds"]) for name in RUNS
    ]  # fmt: skip
    for name in RUNS:
        summary = {c: mean_std([one[c] for one in cells[name]]) for c in columns[2:]}
        rows.append({"training": LABELS[name], "seed": "mean ± std", **summary})
    differences = {
        c: mean_std([_minus(s[c], t[c]) for t, s in zip(*cells.values(), strict=True)], sign="+")
        for c in columns[2:]
    }  # fmt: skip
    rows.append({"training": "scheduled - teacher", "seed": "paired mean ± std", **differences})
    return columns, rows


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _comparison(series: dict[str, Any], key: str, *, scale: float, unit: str) -> str:
    """Both runs' mean +- std over seeds, the per-seed paired differences, their mean +- std,
    how many seeds each run wins (the lower error / higher exact match) and the verdict."""
    teacher, scheduled = ([part[key] for part in series[name]] for name in RUNS)
    differences = [s - t for t, s in zip(teacher, scheduled, strict=True)]
    better = 1 if key == "exact_match" else -1  # the sign of scheduled sampling doing better
    wins = sum(better * d > 0 for d in differences)
    losses = sum(better * d < 0 for d in differences)
    n, p = len(differences), paired_t_p_value(differences)
    ahead = LABELS["scheduled" if wins > losses else "teacher"]
    if wins == losses == 0:
        verdict = "no difference in any seed"
    elif n in (wins, losses):
        verdict = (f"a consistent difference, {ahead} ahead" if p < 0.05
                   else f"{ahead} ahead in every seed, but not clear of the spread")  # fmt: skip
    elif p < 0.05:
        verdict = f"{ahead} ahead on average, though not in every seed"
    else:
        verdict = "not consistent across seeds: no clear difference"
    shown = ", ".join(f"{scale * d:+.2f}" for d in differences)
    return (
        f"{mean_std_text(teacher, scale, unit)} (teacher forcing) and "
        f"{mean_std_text(scheduled, scale, unit)} "
        "(scheduled sampling), mean ± standard deviation over seeds; scheduled minus teacher, "
        f"seed by seed: {shown} points, {mean_std_text(differences, scale, sign='+')} on average "
        f"(paired t-test p = {p:.2g}); {wins} of {n} seeds favour scheduled sampling and "
        f"{losses} teacher forcing: {verdict}."
    )


def _findings(series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the numbers: exact match and free-running token error compared seed
    by seed, the gap to the teacher-forced error, the error by position, how much of the error
    follows an earlier error, and the schedule."""
    seeds, tested, epsilons = series["seeds"], series["teacher"][0]["count"][0], series["epsilon"]
    match = statistics.mean(p["exact_match"] for name in RUNS for p in series[name])
    forced = {name: [p["teacher_forced_error"] for p in series[name]] for name in RUNS}
    free = {name: statistics.mean(p["token_error"] for p in series[name]) for name in RUNS}
    gaps = [f"{_ratio(free[name], statistics.mean(forced[name]))} with {LABELS[name]}"
            for name in RUNS]  # fmt: skip
    return [
        f"{len(seeds)} seeds ({seeds[0]} to {seeds[-1]}), each its own initial weights and data "
        f"order, shared by its two runs; free-running greedy decoding of {tested} held-out "
        f"numbers after {settings['train_steps']} steps of {settings['batch_size']} pairs. "
        "Exact match: " + _comparison(series, "exact_match", scale=100, unit="%")
        + " The binomial standard error of one run's exact match on these numbers is "
        f"{math.sqrt(match * (1 - match) / tested):.1%}.",
        "Free-running token error: " + _comparison(series, "token_error", scale=100, unit="%")
        + " Teacher-forced on the validation numbers (reading the reference) it is "
        + " and ".join(mean_std_text(forced[name], 100, "%") for name in RUNS)
        + "; free-running it is " + " and ".join(gaps) + " (means over seeds).",
        _position_finding(series, settings),
        _compounding_finding(series),
        f"Inverse sigmoid decay with k = {settings['decay_k']:g}: eps goes from "
        f"{epsilons[0]:.3f} at the first step to {epsilons[-1]:.3f} at the last, and the "
        f"scheduled-sampling runs read their own prediction for {1 - statistics.mean(epsilons):.0%}"
        " of their training tokens in expectation.",
    ]  # fmt: skip


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.1f} times that" if reference > 0 else "(no teacher-forced error)"


def _position_finding(series: dict[str, Any], settings: dict[str, Any]) -> str:
    """Per position bin: the paired difference in free-running error, mean +- std, and the
    seeds where scheduled sampling errs less; the bin of the largest mean reduction."""
    count, n = series["teacher"][0]["count"], len(series["seeds"])
    parts, means = [], {}
    for label, positions in _bins(series["position_edges"], len(count)):
        if sum(count[t] for t in positions if t < len(count)) < settings["min_position_count"]:
            continue
        rates = [[_rate(p["errors"], p["count"], positions) for p in series[name]]
                 for name in RUNS]  # fmt: skip
        differences = [s - t for t, s in zip(*rates, strict=True)]
        means[label] = (statistics.mean(differences), statistics.mean(rates[0]))
        parts.append(f"{label}: {mean_std_text(differences, 100, sign='+')} points, lower in "
                     f"{sum(d < 0 for d in differences)} of {n}, "
                     f"p = {paired_t_p_value(differences):.2g}")  # fmt: skip
    largest = min(means, key=lambda label: means[label][0])
    summary = (
        f"The largest mean reduction is at positions {largest} ({100 * means[largest][0]:+.2f}"
        f" points, where teacher forcing errs on {means[largest][1]:.2%} of the tokens)."
        if means[largest][0] < 0 else "Scheduled sampling lowers the mean error at no position."
    )  # fmt: skip
    return (
        "Free-running token error by target position, scheduled minus teacher (mean ± "
        "standard deviation over seeds, the seeds where scheduled sampling errs less, the "
        "paired t-test): " + "; ".join(parts) + ". " + summary
    )


def _compounding_finding(series: dict[str, Any]) -> str:
    """How far an error spreads: the share of wrong tokens that follow an earlier error, the
    wrong tokens per output with an error, and the error after a correct prefix against the
    error over all tokens, for each run (means over seeds)."""
    parts = []
    for name in RUNS:
        runs = series[name]
        after = [1 - sum(p["prefix_errors"]) / max(sum(p["errors"]), 1) for p in runs]
        spread = statistics.mean(
            sum(p["errors"]) / max(p["count"][0] * (1 - p["exact_match"]), 1) for p in runs
        )  # fmt: skip
        clean = statistics.mean(sum(p["prefix_errors"]) / sum(p["prefix_right"]) for p in runs)
        overall = statistics.mean(p["token_error"] for p in runs)
        followed = mean_std_text(after, 100, "%")
        parts.append(f"with {LABELS[name]} {followed} of the wrong tokens follow "
                     f"an earlier error, an output with an error has {spread:.1f} wrong tokens, "
                     f"and the token error is {clean:.2%} after a correct prefix against "
                     f"{overall:.2%} over all tokens")  # fmt: skip
    return "Free-running, " + "; ".join(parts) + " (means over seeds)."


def figure(result: StudyResult):
    """Free-running token error by target position (one thin line per seed, the mean bold),
    the paired difference by position, exact match seed by seed, the schedule eps_i."""
    import matplotlib.pyplot as plt

    series = result.series
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    _position_panels(axes[0], axes[1], series, result.settings.get("min_position_count", 1))
    for i in range(len(series["seeds"])):
        axes[2].plot([0, 1], [series[name][i]["exact_match"] for name in RUNS], marker="o",
                     color="gray", alpha=0.7, label="one seed" if i == 0 else None)  # fmt: skip
    axes[2].set_xticks([0, 1], [LABELS[name] for name in RUNS])
    axes[2].set(xlim=(-0.3, 1.3), ylabel="exact match (free-running)",
                title="Exact match, seed by seed")  # fmt: skip
    axes[2].legend(fontsize=8)
    axes[3].plot(range(len(series["epsilon"])), series["epsilon"], color=_COLORS["scheduled"])
    axes[3].set(xlabel="training step i", ylabel="eps_i (reference token read)",
                title="Inverse sigmoid decay", ylim=(0, 1.02))  # fmt: skip
    fig.suptitle(result.title, fontsize=11)
    fig.tight_layout()
    return fig


_COLORS = {"teacher": "tab:blue", "scheduled": "tab:orange"}


def _position_panels(errors, gaps, series: dict[str, Any], minimum: int) -> None:
    """Per seed (thin) and mean (bold): each run's error by position on `errors`, the paired
    difference on `gaps`; positions that at least `minimum` test outputs reach."""
    count = series["teacher"][0]["count"]
    shown = [t for t, n in enumerate(count) if n >= minimum]
    curves = {name: [[p["errors"][t] / count[t] for t in shown] for p in series[name]]
              for name in RUNS}  # fmt: skip
    pairs = zip(curves["teacher"], curves["scheduled"], strict=True)  # seed by seed
    differences = [[s - t for t, s in zip(*pair, strict=True)] for pair in pairs]
    lines = [(errors, curves[name], _COLORS[name], f"{LABELS[name]} (mean; thin: seeds)")
             for name in RUNS]  # fmt: skip
    lines.append((gaps, differences, "tab:green", "mean (thin: seeds)"))
    for ax, rows, color, label in lines:
        for row in rows:
            ax.plot(shown, row, color=color, alpha=0.3, linewidth=0.8)
        mean = [statistics.mean(column) for column in zip(*rows, strict=True)]
        ax.plot(shown, mean, color=color, linewidth=2, marker=".", label=label)
    gaps.axhline(0.0, color="black", linewidth=0.6)
    errors.set(xlabel="target position", ylabel="token error rate (free-running)",
               title="Error rate by position")  # fmt: skip
    gaps.set(xlabel="target position", ylabel="scheduled - teacher error rate",
             title="Paired difference by position")  # fmt: skip
    for ax in (errors, gaps):
        ax.legend(fontsize=8)
