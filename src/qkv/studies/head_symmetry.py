"""Heads that start identical stay identical; DropHead breaks the tie.

Two heads of one layer whose query, key, value and output weights are equal compute equal
outputs, so they receive equal gradients and equal updates: gradient descent never tells them
apart, and H such heads are one head H times over. Random initialisation breaks this symmetry
(Goodfellow et al. 2016, s8.4: units with the same inputs and the same initial weights are
updated identically). DropHead (Zhou et al. 2020, "Scheduled DropHead") drops whole heads at
random in training, per example, and scales the kept ones by 1 / (1 - p): a dropped head gets
no gradient from that example while the others do, so the tie breaks.

The study trains the small GPT of the heads study (`qkv.studies.heads`: the CPython
documentation blocks, the same optimiser, schedule and paired seeds) three ways: randomly
initialised; with every head of each layer set to head 0 (its rows of q_proj, k_proj and
v_proj, its columns of out_proj); and that identical start trained with DropHead, applied as a
`qkv.inspect` hook on each layer's head outputs (`blocks.{i}.attn.head_out`) in training only.
A layer's head separation is max over heads h of |W_h - W_0| / |W_0|, where W_h joins head h's
q, k, v rows and out_proj columns (0 when the heads are equal); the table gives the mean over
layers, and the validation loss.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch

from qkv.models import GPT
from qkv.studies.ablation_training import base_config
from qkv.studies.heads import _data, _train, _validation_loss
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult, Verdict, beyond_noise

__all__ = ["CLAIM", "COLUMNS", "SIZES", "TITLE", "figure", "identical_heads", "run", "verdicts"]

TITLE = "Identically initialised heads never separate; DropHead separates them"
CLAIM = (
    "Attention heads initialised identically receive identical gradients and stay identical "
    "in training (the symmetry random initialisation breaks; Goodfellow et al. 2016, s8.4), "
    "so such a model learns less than a randomly initialised one; DropHead (Zhou et al. "
    "2020), which drops whole heads at random in training, separates them."
)
COLUMNS = [
    "variant", "DropHead p", "head separation", "separation range over seeds",
    "validation loss", "loss range over seeds",
]  # fmt: skip
SPREAD = "loss range over seeds"
SEPARATIONS = "separation range over seeds"
SAME = 1e-4  # a separation below this is float rounding: the heads are still one
APART = 1e-2  # heads that differ by more than 1% of their norm have separated

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "block_size": 16, "embed_dim": 16, "num_layers": 1, "num_heads": 4,
        "ffn_dim": 32, "train_steps": 3, "batch_size": 4, "learning_rate": 3e-3,
        "warmup_steps": 1, "weight_decay": 0.1, "eval_tokens": 256, "validation_fraction": 0.1,
        "num_seeds": 2, "drop_head": 0.25,
    },
    "default": {
        "vocab_size": 1024, "block_size": 64, "embed_dim": 64, "num_layers": 2, "num_heads": 4,
        "ffn_dim": 128, "train_steps": 1200, "batch_size": 16, "learning_rate": 3e-3,
        "warmup_steps": 60, "weight_decay": 0.1, "eval_tokens": 16384,
        "validation_fraction": 0.1, "num_seeds": 4, "drop_head": 0.25,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the three variants on each seed; measure their head separation and loss."""
    blocks, valid, vocab_size = _data(settings)
    config = base_config(settings, vocab_size, ffn_dim=settings["ffn_dim"])
    p = settings["drop_head"]
    variants = {
        "random init": (None, {}),
        "identical heads": (identical_heads, {}),
        "identical heads + DropHead": (identical_heads, {"blocks.*.attn.head_out": drop_heads(p)}),
    }
    measured = {label: {"separation": [], "loss": []} for label in variants}
    seeds = list(range(seed, seed + settings["num_seeds"]))
    for run_seed in seeds:
        order = data_order(len(blocks), steps=settings["train_steps"],
                           batch_size=settings["batch_size"], seed=run_seed)  # fmt: skip
        for label, (prepare, hook_fns) in variants.items():
            model = _train(config, "separate", blocks, order, settings, seed=run_seed,
                           prepare=prepare, hook_fns=hook_fns)  # fmt: skip
            measured[label]["separation"].append(head_separation(model))
            measured[label]["loss"].append(_validation_loss(model, valid, settings["block_size"]))
            logger.info("%s (seed %d): separation %.3g, validation loss %.3f", label, run_seed,
                        measured[label]["separation"][-1], measured[label]["loss"][-1])  # fmt: skip
    rows = [_row(label, p if hooks else 0.0, measured[label])
            for label, (_, hooks) in variants.items()]  # fmt: skip
    return StudyResult(
        name="head-symmetry", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, measured), series={"seeds": seeds, "measured": measured},
    )  # fmt: skip


@torch.no_grad()
def identical_heads(model: GPT) -> GPT:
    """Every head of each layer set to head 0: its rows of q_proj, k_proj, v_proj (H_kv = H)
    and its columns of out_proj."""
    for block in model.blocks:
        attention, D = block.self_attn, model.config.head_dim
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            heads = projection.weight.view(-1, D, projection.weight.shape[1])  # (H, D, E)
            heads.copy_(heads[:1].expand_as(heads))
        columns = attention.out_proj.weight.view(attention.out_proj.weight.shape[0], -1, D)
        columns.copy_(columns[:, :1].expand_as(columns))  # (E, H, D)
    return model


def drop_heads(p: float):
    """A `qkv.inspect` hook on head_out (B, L, H, D): each head of each example dropped with
    probability p, the kept ones scaled by 1 / (1 - p) (Zhou et al. 2020)."""

    def hook(head_out: torch.Tensor, name: str) -> torch.Tensor:
        B, _, H, _ = head_out.shape
        keep = torch.bernoulli(head_out.new_full((B, 1, H, 1), 1.0 - p))
        return head_out * keep / (1.0 - p)

    return hook


@torch.no_grad()
def head_separation(model: GPT) -> float:
    """Mean over layers of max_h |W_h - W_0| / |W_0|, W_h head h's q, k, v rows and out_proj
    columns joined."""
    D, separations = model.config.head_dim, []
    for block in model.blocks:
        attention = block.self_attn
        parts = [
            projection.weight.view(-1, D * projection.weight.shape[1])  # (H, D E)
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
        ]
        out = attention.out_proj.weight  # (E, H D)
        parts.append(out.view(out.shape[0], -1, D).transpose(0, 1).flatten(1))  # (H, E D)
        heads = torch.cat(parts, dim=1).double()  # (H, 4 D E)
        distances = (heads - heads[:1]).norm(dim=1) / heads[0].norm()
        separations.append(float(distances.max()))
    return statistics.fmean(separations)


def _row(label: str, p: float, measured: dict[str, list[float]]) -> dict[str, Any]:
    separation, loss = measured["separation"], measured["loss"]
    return {
        "variant": label, "DropHead p": p, "head separation": statistics.fmean(separation),
        "separation range over seeds": [min(separation), max(separation)],
        "validation loss": statistics.fmean(loss), "loss range over seeds": max(loss) - min(loss),
    }  # fmt: skip


def _findings(rows: list[dict], measured: dict) -> list[str]:
    by = {row["variant"]: row for row in rows}
    tied, random = by["identical heads"], by["random init"]
    return [
        "Head separation after training (mean over layers and seeds; 0: the heads are equal): "
        + ", ".join(f"{row['variant']} {row['head separation']:.3g}" for row in rows) + ".",
        "Validation loss (range over seeds in brackets): " + ", ".join(
            f"{row['variant']} {row['validation loss']:.3f} ({row[SPREAD]:.3f})"
            for row in rows) + f"; identical heads - random init "
        f"{tied['validation loss'] - random['validation loss']:+.3f}.",
        "Seed by seed, the identical heads' separation: " + ", ".join(
            f"{value:.3g}" for value in measured["identical heads"]["separation"]) + ".",
    ]  # fmt: skip


WHY = (
    "2-layer decoders of width 64 with 4 heads, trained 1200 steps on the CPython documentation "
    "over 4 seeds: a small model, where one head may do most of what four do."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """The three parts of CLAIM from the table's separations and losses."""
    by = {row["variant"]: row for row in rows}
    tied, dropped, random = (by["identical heads"], by["identical heads + DropHead"],
                             by["random init"])  # fmt: skip
    stay = max(tied["separation range over seeds"]) < SAME
    apart = min(dropped["separation range over seeds"]) > APART
    gap = tied["validation loss"] - random["validation loss"]
    noise = max(tied["loss range over seeds"], random["loss range over seeds"])
    worse = beyond_noise(gap, noise)
    return [
        Verdict("identically initialised heads stay identical",
                "supported" if stay else "not supported",
                f"Supported if the identical heads' separation stays below {SAME:g} (float "
                "rounding) on every seed.",
                f"separation {tied['head separation']:.3g} (largest "
                f"{max(tied[SEPARATIONS]):.3g})",
                "" if stay else "rounding that differs between heads grows in training."),
        Verdict("identical heads learn less than random ones", worse,
                "Supported if their mean validation loss is above the random initialisation's "
                "by more than the larger of the two loss ranges over seeds, not supported if "
                "below by more, mixed otherwise.",
                f"identical - random {gap:+.3f} (range {noise:.3f})",
                "" if worse == "supported" else WHY),
        Verdict("DropHead separates identical heads", "supported" if apart else "not supported",
                f"Supported if the separation with DropHead exceeds {APART:g} on every seed.",
                f"separation {dropped['head separation']:.3g} (smallest "
                f"{min(dropped[SEPARATIONS]):.3g})",
                "" if apart else WHY),
    ]  # fmt: skip


def figure(result: StudyResult):
    """Head separation (log scale) and validation loss per variant: a point per seed."""
    from matplotlib.figure import Figure

    measured, labels = result.series["measured"], list(result.series["measured"])
    fig = Figure(figsize=(11, 4))
    panels = fig.subplots(1, 2)
    for ax, key, name in zip(panels, ("separation", "loss"),
                             ("head separation max_h |W_h - W_0| / |W_0|", "validation loss"),
                             strict=True):  # fmt: skip
        for index, label in enumerate(labels):
            values = [max(value, 1e-12) for value in measured[label][key]] if key == "separation" \
                else measured[label][key]  # fmt: skip
            ax.plot([index] * len(values), values, "o", color="tab:blue", alpha=0.7,
                    label="one seed" if index == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(labels)), [label.replace(" + ", "\n+ ") for label in labels])
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set(ylabel=name)
        if key == "separation":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig
