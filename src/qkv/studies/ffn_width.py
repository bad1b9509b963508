"""FFN width: validation loss of small GPTs whose feed-forward layer is 1, 2, 4 and 8 times
d_model wide, at a fixed depth and d_model.

Every model is a `qkv.models.GPT` (RoPE, RMSNorm, no biases) with the plain two-matrix FFN
W_2 act(W_1 x) (ffn="gelu_tanh", GPT-2's; Vaswani et al. 2017 use ReLU, which `GPTConfig`
does not offer), so that "k x d_model" is the hidden width itself, as in Vaswani et al. 2017
(d_ff = 2048 = 4 x 512). The models are trained as the heads study trains them
(`qkv.studies.ablation_training`: the documentation blocks, the same steps, data order and
initial draws per seed) and scored by their mean next-token loss on the held-out documents.
Each widening from one width to the next adds 2 * layers * d_model * (its extra width)
parameters; the table reports the parameters as built and the forward FLOPs per token
(`qkv.analysis.cost.layout_of`), and the verdict divides each widening's loss drop by the
parameters it adds. The loss on the first training blocks (`train_eval_tokens`) is reported
beside the validation loss: their difference shows how much of a width's fit to the training
text carries over to the held-out documents.
"""

from __future__ import annotations

import statistics
from typing import Any

from qkv.models import GPTConfig
from qkv.studies.ablation_training import base_config, seed_ranges, train_variants, variant_row
from qkv.studies.record import StudyResult, Verdict, grade

__all__ = ["CLAIM", "SIZES", "TITLE", "figure", "run", "verdicts"]

TITLE = "FFN width: validation loss at 1x, 2x, 4x and 8x d_model"
CLAIM = (
    "At a fixed depth and d_model, a wider feed-forward layer (d_ff = 1, 2, 4, 8 x d_model; "
    "Vaswani et al. 2017 use 4x) lowers the validation loss, with diminishing returns per "
    "parameter added: Kaplan et al. 2020 (s3, Fig. 5) find the loss a power law in the "
    "parameter count, with the shape mattering little at a fixed count."
)
COLUMNS = [
    "variant", "ffn", "ffn dim", "ffn dim / d_model", "parameters", "FLOPs per token",
    "validation loss", "loss range over seeds", "training loss", "validation - training",
]  # fmt: skip

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "block_size": 16, "embed_dim": 16, "num_layers": 1, "num_heads": 4,
        "ffn_multiples": [1, 2, 4, 8], "train_steps": 3, "batch_size": 4, "learning_rate": 3e-3,
        "warmup_steps": 1, "weight_decay": 0.1, "eval_tokens": 256, "validation_fraction": 0.1,
        "train_eval_tokens": 256, "num_seeds": 2,
    },
    "default": {
        "vocab_size": 1024, "block_size": 64, "embed_dim": 64, "num_layers": 2, "num_heads": 4,
        "ffn_multiples": [1, 2, 4, 8], "train_steps": 200, "batch_size": 16,
        "learning_rate": 3e-3, "warmup_steps": 20, "weight_decay": 0.1, "eval_tokens": 16384,
        "train_eval_tokens": 16384, "validation_fraction": 0.1, "num_seeds": 3,
    },
}  # fmt: skip


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train one model per FFN width and seed; score each on the validation blocks."""
    multiples = settings["ffn_multiples"]
    if sorted(set(multiples)) != multiples or len(multiples) < 2:
        raise ValueError(f"ffn_multiples: expected at least 2 increasing widths, got {multiples}")

    def configs(vocab_size: int) -> dict[str, GPTConfig]:
        return {
            f"{k}x": base_config(
                settings, vocab_size, ffn="gelu_tanh", ffn_dim=k * settings["embed_dim"]
            )  # fmt: skip
            for k in multiples
        }

    built, losses, parameters, vocab_size = train_variants(configs, settings, seed=seed)
    rows = []
    for label, config in built.items():
        row = variant_row(label, config, losses[label], parameters[label], settings["block_size"])
        row["training loss"] = statistics.fmean(losses.pop(f"train {label}"))
        row["validation - training"] = row["validation loss"] - row["training loss"]
        rows.append(row)
    series = {"losses": losses, "vocab_size": vocab_size}
    return StudyResult(
        name="ffn-width", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, settings), series=series,
    )  # fmt: skip


def _widenings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step from one width to the next: its loss drop, the parameters and FLOPs per token
    it adds, and the drop per 1,000 added parameters."""
    steps = []
    for narrow, wide in zip(rows, rows[1:], strict=False):
        drop = narrow["validation loss"] - wide["validation loss"]
        added = wide["parameters"] - narrow["parameters"]
        steps.append({
            "step": f"{narrow['variant']} -> {wide['variant']}", "drop": drop, "added": added,
            "per 1k": 1000 * drop / added,
            "noise": max(narrow["loss range over seeds"], wide["loss range over seeds"]),
        })  # fmt: skip
    return steps


def _findings(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the table: loss, parameters and FLOPs by width, and each widening's
    drop against the parameters it adds and the spread over seeds."""
    first, last = rows[0], rows[-1]
    change = last["validation loss"] - first["validation loss"]
    findings = [
        f"At d_model {settings['embed_dim']} and {settings['num_layers']} layers, validation "
        "loss by FFN width: " + ", ".join(
            f"{r['variant']} {r['validation loss']:.3f} ({r['parameters']:,} parameters)"
            for r in rows
        ) + f"; {last['variant']} has {last['parameters'] / first['parameters']:.2f}x the "
        f"parameters and {last['FLOPs per token'] / first['FLOPs per token']:.2f}x the FLOPs per "
        f"token of {first['variant']}, and a loss {change:+.3f} from it.",
        "Loss drop per widening (per 1,000 added parameters): " + ", ".join(
            f"{s['step']} {s['drop']:+.3f} ({s['per 1k']:+.4f})" for s in _widenings(rows)
        ) + ".",
    ]  # fmt: skip
    findings.append(
        "Validation minus training loss (training loss on the first "
        f"{settings['train_eval_tokens']:,} training tokens), by width: "
        + ", ".join(f"{r['variant']} {r['validation - training']:+.3f}" for r in rows)
        + f"; {rows[-1]['variant']} minus {rows[0]['variant']}: "
        f"{rows[-1]['validation - training'] - rows[0]['validation - training']:+.3f}."
    )
    if settings["num_seeds"] > 1:
        spread = max(row["loss range over seeds"] for row in rows)
        findings.append(
            f"Over {settings['num_seeds']} seeds a width's loss varies by up to {spread:.3f}."
        )
    return findings


def _why(rows: list[dict[str, Any]]) -> str:
    """Why the small models may disagree: their size, steps and data, and, where the table
    shows it (a validation - training gap wider at the widest FFN than at the narrowest), that
    the wide FFNs fit the training text more than they generalise."""
    gaps = [row.get("validation - training") for row in rows]
    overfit = None not in gaps and gaps[-1] > gaps[0]
    return (
        "the models here are 2-layer decoders of d_model 64 trained 200 steps (about 0.2M "
        "tokens, 1.4 passes over the 147k training tokens of the CPython documentation) over 3 "
        "seeds, where Kaplan et al. 2020 fit models of 10^3 to 10^9 parameters on about 2 x "
        "10^10 tokens of WebText2, counting the parameters without the embeddings, which hold a "
        "large part of them here"
        + (
            f"; the wider FFNs fit the training text more than they generalise (validation "
            f"- training {gaps[0]:+.3f} at {rows[0]['variant']}, {gaps[-1]:+.3f} at "
            f"{rows[-1]['variant']})"
            if overfit
            else ""
        )
        + "; and the differences are near the seed range."
    )


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table's validation losses (means over seeds), their ranges
    over seeds, and the parameters of each width, in the table's order (narrow to wide)."""
    steps, why = _widenings(rows), _why(rows)
    lower = [s["step"] for s in steps if s["drop"] > s["noise"]]
    found = [Verdict(
        "a wider FFN lowers the loss", grade(len(lower), len(steps)),
        "Supported if every widening to the next width lowers the mean loss by more than the "
        "larger loss range over seeds of the two widths, mixed if some do.",
        "loss drop " + ", ".join(f"{s['step']} {s['drop']:+.3f} (range {s['noise']:.3f})"
                                 for s in steps)
        + f"; lower past the seed range: {', '.join(lower) or 'none'}", why)]  # fmt: skip
    pairs = list(zip(steps, steps[1:], strict=False))
    smaller = [after["step"] for before, after in pairs if after["per 1k"] < before["per 1k"]]
    found.append(Verdict(
        "with diminishing returns per parameter", grade(len(smaller), len(pairs)),
        "Supported if each widening's loss drop per added parameter is smaller than the "
        "widening's before it (a rise counts as a negative drop), mixed if some are.",
        "drop per 1,000 added parameters: "
        + ", ".join(f"{s['step']} {s['per 1k']:+.4f}" for s in steps)
        + f"; smaller than the widening before: {', '.join(smaller) or 'none'}", why))  # fmt: skip
    return found


def figure(result: StudyResult):
    """Two panels: validation loss against parameters per FFN width (bars: the range over
    seeds), and each widening's loss drop per 1,000 added parameters."""
    from matplotlib.figure import Figure

    rows = result.rows
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    xs = [row["parameters"] for row in rows]
    ys = [row["validation loss"] for row in rows]
    errors = [row["loss range over seeds"] / 2 for row in rows]
    left.errorbar(xs, ys, yerr=errors, fmt="o-", capsize=3, label="mean over seeds")
    for losses in zip(*result.series["losses"].values(), strict=True):  # one line per seed
        left.plot(xs, losses, color="grey", alpha=0.35, linewidth=0.8)
    for x, y, row in zip(xs, ys, rows, strict=True):
        left.annotate(f"d_ff {row['variant']}", (x, y), textcoords="offset points",
                      xytext=(4, 4), fontsize=7)  # fmt: skip
    left.set(xlabel="parameters", ylabel="validation loss",
             title="Loss against parameters (grey: each seed)")  # fmt: skip
    left.legend(fontsize=8)
    steps = _widenings(rows)
    ranges = seed_ranges(rows)
    right.bar([s["step"] for s in steps], [s["per 1k"] for s in steps], color="tab:orange")
    right.axhline(0.0, color="black", linewidth=0.8)
    right.set(
        xlabel="widening",
        ylabel="loss drop per 1,000 added parameters",
        title=f"Returns per parameter (largest seed range {max(ranges.values()):.3f})",
    )
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig
