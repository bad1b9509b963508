"""Cross-layer parameter sharing: one block applied N times, against N blocks and against one.

ALBERT (Lan et al. 2020, s3.1 and Table 4) shares all parameters across a Transformer's layers:
the parameters of the blocks fall N-fold at the same compute per token, for some loss of
accuracy against the unshared model; the Universal Transformer (Dehghani et al. 2019) applies
one block recurrently in depth. The study trains the small GPT of the heads study
(`qkv.studies.heads`: the CPython documentation blocks, the same optimiser, schedule and paired
seeds) three ways: N blocks (the plain model); N layers that are one block (`share_layers`:
every entry of `model.blocks` is blocks[0], so the forward applies it N times and its
gradient sums the N uses); and one block (the shared model's parameters, 1/N of its compute).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from qkv.analysis.cost.layout import layout_of
from qkv.models import GPT
from qkv.studies.ablation_training import base_config
from qkv.studies.heads import _data, _train, _validation_loss
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult, Verdict

__all__ = ["CLAIM", "COLUMNS", "SIZES", "TITLE", "figure", "run", "share_layers", "verdicts"]

TITLE = "Cross-layer sharing: one block applied N times, against N blocks and one"
CLAIM = (
    "Sharing one block across all N layers (Lan et al. 2020, ALBERT; Dehghani et al. 2019) "
    "costs some loss against N separate blocks at the same compute, and the depth still "
    "helps: the shared model's loss is below that of one block with the same parameters."
)
COLUMNS = [
    "variant", "layers applied", "distinct blocks", "parameters", "FLOPs per token",
    "validation loss", "loss range over seeds",
]  # fmt: skip
SPREAD = "loss range over seeds"

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "block_size": 16, "embed_dim": 16, "num_layers": 2, "num_heads": 4,
        "ffn_dim": 32, "train_steps": 3, "batch_size": 4, "learning_rate": 3e-3,
        "warmup_steps": 1, "weight_decay": 0.1, "eval_tokens": 256, "validation_fraction": 0.1,
        "num_seeds": 2,
    },
    "default": {
        "vocab_size": 1024, "block_size": 64, "embed_dim": 64, "num_layers": 4, "num_heads": 4,
        "ffn_dim": 128, "train_steps": 1200, "batch_size": 16, "learning_rate": 3e-3,
        "warmup_steps": 60, "weight_decay": 0.1, "eval_tokens": 16384,
        "validation_fraction": 0.1, "num_seeds": 4,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def share_layers(model: GPT) -> GPT:
    """Every entry of model.blocks made blocks[0]: one block applied num_layers times (its
    parameters listed once by model.parameters(), its gradient summed over the uses)."""
    for index in range(1, len(model.blocks)):
        model.blocks[index] = model.blocks[0]
    return model


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the three variants on each seed; score them on the validation blocks."""
    blocks, valid, vocab_size = _data(settings)
    N = settings["num_layers"]
    deep = base_config(settings, vocab_size, ffn_dim=settings["ffn_dim"])
    variants = {  # label -> (config, prepare, layers applied, distinct blocks)
        f"{N} blocks": (deep, None, N, N),
        f"{N} layers, one shared block": (deep, share_layers, N, 1),
        "1 block": (base_config({**settings, "num_layers": 1}, vocab_size,
                                ffn_dim=settings["ffn_dim"]), None, 1, 1),
    }  # fmt: skip
    losses: dict[str, list[float]] = {label: [] for label in variants}
    parameters: dict[str, int] = {}
    seeds = list(range(seed, seed + settings["num_seeds"]))
    for run_seed in seeds:
        order = data_order(len(blocks), steps=settings["train_steps"],
                           batch_size=settings["batch_size"], seed=run_seed)  # fmt: skip
        for label, (config, prepare, _, _) in variants.items():
            model = _train(config, "separate", blocks, order, settings, seed=run_seed,
                           prepare=prepare)  # fmt: skip
            losses[label].append(_validation_loss(model, valid, settings["block_size"]))
            parameters[label] = sum(p.numel() for p in model.parameters())
            logger.info("%s (seed %d): validation loss %.3f", label, run_seed, losses[label][-1])
    L = settings["block_size"]
    rows = [{
        "variant": label, "layers applied": applied, "distinct blocks": distinct,
        "parameters": parameters[label],
        "FLOPs per token": layout_of(config).forward_flops(L) // L,
        "validation loss": statistics.fmean(losses[label]),
        "loss range over seeds": max(losses[label]) - min(losses[label]),
    } for label, (config, _, applied, distinct) in variants.items()]  # fmt: skip
    return StudyResult(
        name="layer-sharing", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, losses), series={"seeds": seeds, "losses": losses},
    )  # fmt: skip


def _findings(rows: list[dict[str, Any]], losses: dict[str, list[float]]) -> list[str]:
    deep, shared, one = rows
    return [
        "Validation loss (range over seeds in brackets): " + ", ".join(
            f"{row['variant']} {row['validation loss']:.3f} ({row[SPREAD]:.3f}, "
            f"{row['parameters']:,} parameters, {row['FLOPs per token']:,} FLOPs per token)"
            for row in rows) + ".",
        f"Shared - separate: {shared['validation loss'] - deep['validation loss']:+.3f}; shared "
        f"- one block: {shared['validation loss'] - one['validation loss']:+.3f}. Seed by seed, "
        "shared - one block: " + ", ".join(
            f"{s - o:+.3f}" for s, o in zip(losses[shared["variant"]], losses[one["variant"]],
                                             strict=True)) + ".",
    ]  # fmt: skip


WHY = (
    "4-layer decoders of width 64 trained 1200 steps on the CPython documentation (about 8 "
    "passes over its 147k training tokens) over 4 seeds, where ALBERT pre-trains 12- and "
    "24-layer models for 125k steps on 3.3 billion words: on data this small, seen this often, "
    "fewer parameters may generalise better, and the gaps are of the order of the seed ranges."
)


def _three_way(gap: float, noise: float) -> str:
    return "supported" if gap > noise else "not supported" if gap < -noise else "mixed"


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Both parts of CLAIM from the means and ranges over seeds."""
    deep, shared, one = rows
    noise_deep = max(deep["loss range over seeds"], shared["loss range over seeds"])
    noise_one = max(one["loss range over seeds"], shared["loss range over seeds"])
    cost = shared["validation loss"] - deep["validation loss"]
    depth = one["validation loss"] - shared["validation loss"]
    rule = ("Supported if the difference exceeds the larger of the two loss ranges over seeds, "
            "not supported if it is below minus that range, mixed otherwise.")  # fmt: skip
    return [
        Verdict("sharing costs loss against separate blocks", _three_way(cost, noise_deep),
                f"shared - separate; {rule}", f"{cost:+.3f} (range {noise_deep:.3f})",
                "" if _three_way(cost, noise_deep) == "supported" else WHY),
        Verdict("the shared depth beats one block of the same parameters",
                _three_way(depth, noise_one), f"one block - shared; {rule}",
                f"{depth:+.3f} (range {noise_one:.3f})",
                "" if _three_way(depth, noise_one) == "supported" else WHY),
    ]  # fmt: skip


def figure(result: StudyResult):
    """Validation loss per variant against its parameters: a point per seed and the mean."""
    from matplotlib.figure import Figure

    losses = result.series["losses"]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for row in result.rows:
        values = losses[row["variant"]]
        ax.plot([row["parameters"]] * len(values), values, "o", alpha=0.5)
        ax.plot([row["parameters"]], [row["validation loss"]], "s", markersize=9,
                label=f"{row['variant']} (mean)")  # fmt: skip
    ax.set_xscale("log")
    ax.set(xlabel="parameters", ylabel="validation loss", title=TITLE)
    ax.title.set_fontsize(9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
