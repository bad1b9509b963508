"""How a diffusion Transformer takes its conditions: adaLN-Zero, cross-attention with the
timestep added, and in-context tokens, trained alike on the 8x8 digits and compared.

Peebles & Xie 2023 (DiT, s3.2 and Figure 5) compare the ways a Transformer denoiser can read
the timestep and the class: as extra tokens in the sequence ("in-context"), through
cross-attention, and by adaptive layer norm whose gates start at zero ("adaLN-Zero"); at equal
training, adaLN-Zero reaches the lowest FID, cross-attention the next, in-context the highest.
`DiffusionConfig.conditioning` offers three of these, and the study trains each as
`qkv train diffusion` trains it (the same data, steps, data order and seeds; only the
conditioning differs):

    adaln_zero  the timestep sets the shift, scale and gate of every sub-layer, zero-initialised;
                the prompt enters by cross-attention
    add         the timestep embedding is added to the image tokens; the prompt enters by
                cross-attention (the latent diffusion U-Net's way, Rombach et al. 2022, s3.3)
    in_context  the timestep and the encoded prompt are tokens before the image tokens; plain
                self-attention blocks, no cross-attention

Each model is scored by its validation loss (the mean squared noise error with the prompts, Ho
et al. 2020 eq. 14, at the timesteps and noise the task draws once) and by how often its
samples (DDIM, classifier-free guidance at one scale) are read as their prompt's digit by a
Vision Transformer trained in the study, as `qkv study cfg-digits` reads them. The seeds are
paired: the same seed gives every variant the same data order and noise draws. The variants
differ in parameters too (the table gives them): adaLN-Zero's modulation adds a linear map
from the timestep embedding to a shift, scale and gate per sub-layer of every block, in-context
conditioning drops the cross-attention; DiT compares its variants at the FLOPs of each, not at
equal parameters.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch

from qkv.data.digits import NUM_CLASSES
from qkv.data.prompts import evaluation_prompt
from qkv.studies.cfg_digits import SIZES as CFG_SIZES
from qkv.studies.cfg_digits import measure_samples, train_quietly
from qkv.studies.record import StudyResult, Verdict
from qkv.studies.statistics import paired_t_p_value
from qkv.training.tasks.diffusion import DiffusionOptions, DiffusionTask, sample_digits
from qkv.training.tasks.vit import VitOptions, VitTask

__all__ = [
    "CLAIM", "COLUMNS", "SIZES", "TITLE", "VARIANTS", "figure", "run", "seed_figure",
    "train_variants", "verdicts",
]  # fmt: skip

TITLE = "Conditioning a diffusion Transformer: adaLN-Zero, added timestep, in-context tokens"
CLAIM = (
    "At equal training, a diffusion Transformer that takes its timestep by adaLN-Zero "
    "reaches a lower denoising loss than one that adds it to the tokens (prompt by "
    "cross-attention) or reads timestep and prompt as in-context tokens, and its samples "
    "follow their prompt at least as often (Peebles & Xie 2023, s3.2, Figure 5)."
)
VARIANTS = {"adaLN-Zero": "adaln_zero", "added timestep": "add", "in-context": "in_context"}
COLUMNS = [
    "variant", "conditioning", "parameters", "validation loss", "loss range over seeds",
    "ViT accuracy", "accuracy range over seeds", "training seconds",
]  # fmt: skip
SPREAD = "loss range over seeds"


def _settings(size: str, training_steps: int, **changes: Any) -> dict[str, Any]:
    """cfg-digits' diffusion model, ViT and sampling of `size`, at `training_steps` diffusion
    training steps."""
    base = CFG_SIZES[size]
    common = {
        "diffusion": base["diffusion"], "vit": base["vit"], "vit_training": base["vit_training"],
        "diffusion_training": {**base["diffusion_training"], "steps": training_steps},
        "guidance": 3, "samples_per_prompt": 12, "sampling_steps": base["sampling_steps"],
        "num_seeds": 2,
    }  # fmt: skip
    return {**common, **changes}


SIZES: dict[str, dict[str, Any]] = {
    "tiny": _settings("tiny", 3, samples_per_prompt=2),
    "default": _settings("default", 1500),
}

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the ViT once, then each conditioning on each seed; score every model."""
    changes = {label: {"conditioning": kind} for label, kind in VARIANTS.items()}
    rows, measured, seeds = train_variants(settings, changes, seed=seed)
    series = {"seeds": seeds, "measured": measured}
    return StudyResult(
        name="conditioning", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, measured, settings), series=series,
    )  # fmt: skip


def train_variants(
    settings: dict[str, Any], variants: dict[str, dict[str, Any]], *, seed: int
) -> tuple[list[dict], dict[str, dict[str, list[float]]], list[int]]:
    """Train the study's ViT once, then each variant (its changes to settings["diffusion"]'s
    `DiffusionOptions`) on each seed, as `qkv train diffusion` trains it: (a row per variant,
    with its changes as columns; {variant: {"loss", "accuracy", "seconds": a value per seed}};
    the seeds)."""
    _, vit, _ = train_quietly(VitTask(VitOptions(**settings["vit"])), settings["vit_training"],
                              seed)  # fmt: skip
    seeds = list(range(seed, seed + settings["num_seeds"]))
    measured: dict[str, dict[str, list[float]]] = {}
    rows = []
    for label, changes in variants.items():
        options = DiffusionOptions(**{**settings["diffusion"], **changes})
        per_seed = {"loss": [], "accuracy": [], "seconds": []}
        for each in seeds:
            task, model, seconds = train_quietly(
                DiffusionTask(options), settings["diffusion_training"], each
            )
            per_seed["loss"].append(task.evaluate(model)["valid_loss"])
            per_seed["accuracy"].append(_accuracy(model, task.tokenizer, vit, settings, each))
            per_seed["seconds"].append(seconds)
            logger.info("%s, seed %d: validation loss %.4f, ViT accuracy %.3f (%.0f s)", label,
                        each, per_seed["loss"][-1], per_seed["accuracy"][-1], seconds)  # fmt: skip
        measured[label] = per_seed
        rows.append(_row(label, changes, model, per_seed))
    return rows, measured, seeds


@torch.no_grad()
def _accuracy(model, tokenizer, vit, settings: dict[str, Any], seed: int) -> float:
    """The share of samples_per_prompt samples of each digit's prompt, at the study's guidance
    scale, that the ViT reads as that digit."""
    per_prompt = settings["samples_per_prompt"]
    prompts = [evaluation_prompt(digit) for digit in range(NUM_CLASSES) for _ in range(per_prompt)]
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_prompt)
    images = sample_digits(model, tokenizer, prompts, guidance=settings["guidance"], seed=seed,
                           sampler="ddim", steps=settings["sampling_steps"])  # fmt: skip
    return measure_samples(vit, images, labels, per_prompt)["ViT accuracy"]


def _row(label: str, changes: dict[str, Any], model, per_seed: dict[str, list[float]]) -> dict:
    return {
        "variant": label, **changes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "validation loss": statistics.fmean(per_seed["loss"]),
        "loss range over seeds": max(per_seed["loss"]) - min(per_seed["loss"]),
        "ViT accuracy": statistics.fmean(per_seed["accuracy"]),
        "accuracy range over seeds": max(per_seed["accuracy"]) - min(per_seed["accuracy"]),
        "training seconds": statistics.fmean(per_seed["seconds"]),
    }  # fmt: skip


def _findings(rows: list[dict], measured: dict, settings: dict[str, Any]) -> list[str]:
    """The losses and accuracies, and adaLN-Zero against each other variant seed by seed."""
    findings = [
        "Validation loss (mean over seeds, range in brackets): " + ", ".join(
            f"{row['variant']} {row['validation loss']:.4f} ({row[SPREAD]:.4f})"
            for row in rows) + "; ViT accuracy on the samples at guidance "
        f"{settings['guidance']:g}: " + ", ".join(
            f"{row['variant']} {row['ViT accuracy']:.1%}" for row in rows)
        + f" (chance {1 / NUM_CLASSES:.0%}). Parameters: " + ", ".join(
            f"{row['variant']} {row['parameters']:,}" for row in rows) + ".",
    ]  # fmt: skip
    reference = measured["adaLN-Zero"]["loss"]
    for label in list(VARIANTS)[1:]:
        differences = [a - b for a, b in zip(reference, measured[label]["loss"], strict=True)]
        text = ", ".join(f"{d:+.4f}" for d in differences)
        if len(differences) > 1:
            text += f" (paired t-test p = {paired_t_p_value(differences):.2g})"
        findings.append(f"adaLN-Zero - {label}, validation loss seed by seed: {text}.")
    return findings


WHY = (
    "4-block denoisers of width 64 trained 1500 steps on 8x8 digits (16 image tokens) over 2 "
    "seeds, where Peebles & Xie 2023 train DiT-XL/2 for 400k steps on 256x256 ImageNet latents "
    "and compare FID: with 16 tokens and a few words of prompt, each way of conditioning sees "
    "everything, and a difference of the size they report may be within the seeds here."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Both parts of CLAIM from the table's means and ranges over seeds."""
    by = {row["variant"]: row for row in rows}
    ada, others = by["adaLN-Zero"], [by[label] for label in list(VARIANTS)[1:]]
    gaps = [ada["validation loss"] - o["validation loss"] for o in others]
    noise = [max(ada["loss range over seeds"], o["loss range over seeds"]) for o in others]
    if all(g < -n for g, n in zip(gaps, noise, strict=True)):
        loss_verdict = "supported"
    elif any(g > n for g, n in zip(gaps, noise, strict=True)):
        loss_verdict = "not supported"
    else:
        loss_verdict = "mixed"
    matched = sum(ada["ViT accuracy"] >= o["ViT accuracy"] for o in others)
    accuracy_verdict = ("supported" if matched == len(others) else
                        "not supported" if matched == 0 else "mixed")  # fmt: skip
    names = [o["variant"] for o in others]
    return [
        Verdict("adaLN-Zero's denoising loss is the lowest", loss_verdict,
                "Supported if adaLN-Zero's mean validation loss is below each other variant's "
                "by more than the larger of the two loss ranges over seeds, not supported if it "
                "is above either by more than that, mixed otherwise.",
                "; ".join(f"adaLN-Zero - {name} {gap:+.4f} (range {n:.4f})"
                          for name, gap, n in zip(names, gaps, noise, strict=True)),
                "" if loss_verdict == "supported" else WHY),
        Verdict("adaLN-Zero's samples follow the prompt at least as often", accuracy_verdict,
                "Supported if adaLN-Zero's mean ViT accuracy is at least each other variant's, "
                "not supported if below both, mixed if below one.",
                ", ".join(f"{row['variant']} {100 * row['ViT accuracy']:.1f}%" for row in rows),
                "" if accuracy_verdict == "supported" else WHY),
    ]  # fmt: skip


def figure(result: StudyResult):
    """Validation loss and ViT accuracy of each variant, a point per seed and the mean."""
    return seed_figure(result, TITLE)


def seed_figure(result: StudyResult, title: str):
    """Two panels from `train_variants`' measurements: each variant's validation loss and ViT
    accuracy, a point per seed and the mean."""
    from matplotlib.figure import Figure

    measured, labels = result.series["measured"], list(result.series["measured"])
    fig = Figure(figsize=(10, 4))
    panels = fig.subplots(1, 2)
    for ax, key, name in zip(panels, ("loss", "accuracy"),
                             ("validation loss (noise MSE)", "ViT accuracy on the samples"),
                             strict=True):  # fmt: skip
        for index, label in enumerate(labels):
            values = measured[label][key]
            ax.plot([index] * len(values), values, "o", color="grey", alpha=0.6,
                    label="one seed" if index == 0 else None)  # fmt: skip
            ax.plot([index], [statistics.fmean(values)], "s", color="tab:blue", markersize=9,
                    label="mean" if index == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set(ylabel=name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
