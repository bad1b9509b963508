"""Training on the model's own predictions from the first step, against teacher forcing.

Scheduled sampling (Bengio et al. 2015, s2) starts from teacher forcing and moves towards the
model's own predictions as training goes on, because reading its own predictions from the
start, while they are still noise, gives the decoder inputs it cannot learn from: in their
Table 1 (image captioning), "always sampling" reaches a BLEU-4 of 11.2 against 28.8 for the
teacher-forced baseline. The study trains the GRU encoder-decoder of `qkv study exposure-bias`
on the German -> English numbers twice per seed, from the same weights and batches: with
teacher forcing, and reading its own greedy prediction at every target position from the
first step (scheduled sampling with eps = 0 throughout: `scheduled_sampling_loss`); both are
scored free-running on the held-out numbers, as exposure-bias scores them.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from qkv.studies.exposure_bias import SIZES as EXPOSURE_SIZES
from qkv.studies.exposure_bias import train_and_score
from qkv.studies.exposure_bias_training import numbers_task
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult, Verdict, beyond_noise
from qkv.studies.statistics import paired_t_p_value

__all__ = ["CLAIM", "COLUMNS", "RUNS", "SIZES", "TITLE", "figure", "run", "verdicts"]

TITLE = "Own predictions from the first step against teacher forcing"
CLAIM = (
    "A decoder that reads its own predictions from the first training step, instead of the "
    "reference's previous token, learns worse than with teacher forcing (Bengio et al. 2015, "
    "Table 1: 'always sampling')."
)
RUNS = {"teacher forcing": None, "own predictions from the start": 0.0}  # label -> eps
COLUMNS = [
    "training", "exact match", "exact match range over seeds", "token err (free)",
    "valid loss (TF)",
]  # fmt: skip
RANGE = "exact match range over seeds"
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**EXPOSURE_SIZES["tiny"], "seeds": 2},
    "default": {**EXPOSURE_SIZES["default"], "seeds": 3},
}

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Both trainings on each seed (the same initial weights, batches and coins), scored."""
    task = numbers_task(settings)
    steps = settings["train_steps"]
    seeds = list(range(seed, seed + settings["seeds"]))
    scores: dict[str, list[dict]] = {label: [] for label in RUNS}
    for one in seeds:
        order = data_order(len(task.train_set), steps=steps, batch_size=settings["batch_size"],
                           seed=one)  # fmt: skip
        for label, epsilon in RUNS.items():
            schedule = None if epsilon is None else [epsilon] * steps
            scores[label].append(train_and_score(task, order, settings, schedule=schedule,
                                                 seed=one))  # fmt: skip
            logger.info("seed %d, %s: %.1f%% exact match", one, label,
                        100 * scores[label][-1]["exact_match"])  # fmt: skip
    rows = [_row(label, runs) for label, runs in scores.items()]
    measured = {label: {key: [run[key] for run in runs]
                        for key in ("exact_match", "token_error", "valid_loss")}
                for label, runs in scores.items()}  # fmt: skip
    return StudyResult(
        name="own-predictions", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, measured), series={"seeds": seeds, "measured": measured},
    )  # fmt: skip


def _row(label: str, runs: list[dict]) -> dict[str, Any]:
    exact = [run["exact_match"] for run in runs]
    return {
        "training": label, "exact match": statistics.fmean(exact), RANGE: max(exact) - min(exact),
        "token err (free)": statistics.fmean(run["token_error"] for run in runs),
        "valid loss (TF)": statistics.fmean(run["valid_loss"] for run in runs),
    }  # fmt: skip


def _findings(rows: list[dict], measured: dict) -> list[str]:
    teacher, own = (measured[label]["exact_match"] for label in RUNS)
    differences = [o - t for o, t in zip(own, teacher, strict=True)]
    test = f", paired t-test p = {paired_t_p_value(differences):.2g}" if len(own) > 1 else ""
    return [
        "Exact match on the held-out numbers (mean over seeds): " + ", ".join(
            f"{row['training']} {row['exact match']:.1%}" for row in rows) + "; free-running "
        "token error: " + ", ".join(
            f"{row['training']} {row['token err (free)']:.1%}" for row in rows)
        + "; teacher-forced validation loss: " + ", ".join(
            f"{row['training']} {row['valid loss (TF)']:.3f}" for row in rows) + ".",
        "Seed by seed, own predictions - teacher forcing, exact match: " + ", ".join(
            f"{100 * d:+.1f} points" for d in differences) + test + ".",
    ]  # fmt: skip


WHY = (
    "a GRU encoder-decoder of width 32 trained 500 steps on 10,000 number pairs over 3 seeds, "
    "where Bengio et al. 2015 train image-captioning LSTMs on MSCOCO: a task this regular may "
    "be learnable from the model's own early outputs."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """The claim from the exact matches and their ranges over seeds."""
    teacher, own = rows
    gap = teacher["exact match"] - own["exact match"]
    noise = max(teacher[RANGE], own[RANGE])
    verdict = beyond_noise(gap, noise)
    return [Verdict(
        "own predictions from the start learn worse than teacher forcing", verdict,
        "Supported if teacher forcing's mean exact match is above that of the run on its own "
        "predictions by more than the larger of their ranges over seeds, not supported if "
        "below by more, mixed otherwise.",
        f"teacher forcing - own predictions {100 * gap:+.1f} points (range {100 * noise:.1f})",
        "" if verdict == "supported" else WHY)]  # fmt: skip


def figure(result: StudyResult):
    """Exact match and free-running token error of each training: a point per seed."""
    from matplotlib.figure import Figure

    measured, labels = result.series["measured"], list(result.series["measured"])
    fig = Figure(figsize=(10, 4))
    for ax, key, name in zip(fig.subplots(1, 2), ("exact_match", "token_error"),
                             ("exact match (free-running)", "token error (free-running)"),
                             strict=True):  # fmt: skip
        for index, label in enumerate(labels):
            values = measured[label][key]
            ax.plot([index] * len(values), values, "o", color="tab:blue", alpha=0.7)
            ax.plot([index], [statistics.fmean(values)], "s", color="tab:orange", markersize=9)
        ax.set_xticks(range(len(labels)), [label.replace(" from", "\nfrom") for label in labels])
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set(ylabel=name)
        ax.grid(True, alpha=0.3)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig
