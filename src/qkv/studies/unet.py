"""A U-Net or a Transformer as the denoiser of a text-conditioned diffusion model, trained alike on
the 8x8 digits and compared.

Diffusion models were U-Nets (Ho et al. 2020; Rombach et al. 2022: convolutions at several
resolutions, self- and cross-attention at the coarse ones) until Peebles & Xie 2023 (DiT, s5,
Table 4) replaced the U-Net by a Transformer over patches and found it better at equal compute:
DiT-XL/2 reaches a lower FID than the U-Net-based LDM and ADM models on ImageNet. The study
trains three denoisers as `qkv train diffusion` trains them (the same data, steps, data order,
seeds and prompt encoder; `qkv.models.DiffusionUNet` against `DiffusionTransformer`):

    DiT (adaLN-Zero)      the diffusion Transformer as DiT has it, over 2 x 2 patches
    DiT (added timestep)  the same, its timestep added to the tokens: the U-Net's conditioning
    U-Net                 ResBlocks (the timestep added) and a Transformer block with self- and
                          cross-attention at 8 x 8 and at 4 x 4, a skip connection across

Each is scored by its validation loss (the noise's mean squared error with the prompts, Ho et
al. 2020 eq. 14) and by how often its samples (DDIM, classifier-free guidance) are read as their
prompt's digit by a ViT trained in the study (`qkv study conditioning` does the same), over
paired seeds; the table gives parameters and training time, the compute each paid.
"""

from __future__ import annotations

from typing import Any

from qkv.studies.conditioning import SIZES as CONDITIONING_SIZES
from qkv.studies.conditioning import seed_figure, train_variants
from qkv.studies.record import StudyResult, Verdict
from qkv.studies.statistics import paired_t_p_value

__all__ = ["CLAIM", "COLUMNS", "SIZES", "TITLE", "VARIANTS", "figure", "run", "verdicts"]

TITLE = "The denoiser of a diffusion model: a U-Net against a diffusion Transformer"
CLAIM = (
    "At equal training, a diffusion Transformer (adaLN-Zero, over patches) reaches a denoising "
    "loss at least as low as a U-Net with self- and cross-attention at two resolutions, and its "
    "samples follow their prompt at least as often (Peebles & Xie 2023, s5, Table 4)."
)
VARIANTS = {
    "DiT (adaLN-Zero)": {"denoiser": "transformer", "conditioning": "adaln_zero"},
    "DiT (added timestep)": {"denoiser": "transformer", "conditioning": "add"},
    "U-Net": {"denoiser": "unet", "conditioning": "add"},
}
COLUMNS = [
    "variant", "denoiser", "conditioning", "parameters", "validation loss",
    "loss range over seeds", "ViT accuracy", "accuracy range over seeds", "training seconds",
]  # fmt: skip
SIZES = CONDITIONING_SIZES  # the conditioning study's models, ViT, sampling and seeds
DIT, UNET = "DiT (adaLN-Zero)", "U-Net"
SPREAD = "loss range over seeds"


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the ViT once, then each denoiser on each seed; score every model."""
    rows, measured, seeds = train_variants(settings, VARIANTS, seed=seed)
    return StudyResult(
        name="unet", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, measured, settings), series={"seeds": seeds, "measured": measured},
    )  # fmt: skip


def _findings(rows: list[dict], measured: dict, settings: dict[str, Any]) -> list[str]:
    """The losses, accuracies and costs, and the U-Net against each DiT seed by seed."""
    findings = [
        "Validation loss (mean over seeds, range in brackets): " + ", ".join(
            f"{row['variant']} {row['validation loss']:.4f} ({row[SPREAD]:.4f})"
            for row in rows) + f"; ViT accuracy on the samples at guidance "
        f"{settings['guidance']:g}: " + ", ".join(
            f"{row['variant']} {row['ViT accuracy']:.1%}" for row in rows) + ".",
        "Cost: " + ", ".join(
            f"{row['variant']} {row['parameters']:,} parameters, {row['training seconds']:.0f} s"
            for row in rows) + " of training (2 CPU threads).",
    ]  # fmt: skip
    for label in (DIT, "DiT (added timestep)"):
        differences = [a - b for a, b in zip(measured[label]["loss"], measured[UNET]["loss"],
                                             strict=True)]  # fmt: skip
        text = ", ".join(f"{d:+.4f}" for d in differences)
        if len(differences) > 1:
            text += f" (paired t-test p = {paired_t_p_value(differences):.2g})"
        findings.append(f"{label} - U-Net, validation loss seed by seed: {text}.")
    return findings


WHY = (
    "denoisers of width 64 trained 1500 steps on 8x8 digits over 2 seeds, where Peebles & Xie "
    "2023 compare DiT-XL/2 with U-Nets of hundreds of millions of parameters after hundreds of "
    "thousands of steps on 256x256 ImageNet latents, by FID and at equal compute: at 64 pixels "
    "a convolution's locality and the skip connection are a strong prior, which scale and data "
    "remove, and here the U-Net's steps cost more (attention over all 64 positions at full "
    "resolution, against the DiT's 16 patches: see the training seconds)."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Both parts of CLAIM, the DiT (adaLN-Zero) against the U-Net, from the table's means and
    ranges over seeds."""
    by = {row["variant"]: row for row in rows}
    dit, unet = by[DIT], by[UNET]
    gap = dit["validation loss"] - unet["validation loss"]
    noise = max(dit[SPREAD], unet[SPREAD])
    loss_verdict = "supported" if gap <= 0 else "mixed" if gap <= noise else "not supported"
    lag = unet["ViT accuracy"] - dit["ViT accuracy"]
    spread = max(dit["accuracy range over seeds"], unet["accuracy range over seeds"])
    accuracy_verdict = "supported" if lag <= 0 else "mixed" if lag <= spread else "not supported"
    return [
        Verdict("the DiT's denoising loss is at least as low as the U-Net's", loss_verdict,
                "Supported if the DiT's mean validation loss is at most the U-Net's, mixed if "
                "above it by no more than the larger loss range over seeds, not supported if "
                "above it by more.",
                f"DiT - U-Net {gap:+.4f} (range {noise:.4f})",
                "" if loss_verdict == "supported" else WHY),
        Verdict("the DiT's samples follow the prompt at least as often", accuracy_verdict,
                "Supported if the DiT's mean ViT accuracy is at least the U-Net's, mixed if "
                "below it by no more than the larger accuracy range over seeds, not supported "
                "if below it by more.",
                f"DiT {100 * dit['ViT accuracy']:.1f}%, U-Net {100 * unet['ViT accuracy']:.1f}% "
                f"(range {100 * spread:.1f} points)",
                "" if accuracy_verdict == "supported" else WHY),
    ]  # fmt: skip


def figure(result: StudyResult):
    """Validation loss and ViT accuracy of each denoiser, a point per seed and the mean."""
    return seed_figure(result, TITLE)
