"""Classifier-free guidance, measured: how well samples follow their prompt, and what that
costs in variety, as the guidance scale grows.

A text-conditioned diffusion Transformer is trained as `qkv train diffusion` trains it (Ho et
al. 2020's DDPM over the 8x8 digits in patches, cross-attention to the prompt, adaLN-Zero
timestep conditioning from Peebles & Xie 2023, the prompt replaced by the null prompt 10% of
the time), and a Vision Transformer classifier as `qkv train vit` trains it (Dosovitskiy et al.
2021), on the same split of scikit-learn's digits. For each digit, samples_per_prompt images of
"a handwritten <digit>" are drawn with DDIM (Song et al. 2021, eta = 0) at each guidance scale
s, from the same starting noise at every s, following eps_u + s (eps_c - eps_u) (Ho & Salimans
2022): s = 0 is the unconditional model, s = 1 the conditional one.

The table reports, per s, the share of samples the ViT reads as the digit of their prompt, the
ViT's mean probability for that digit, and the variety of the samples of one prompt: the mean
pairwise Euclidean distance between them (pixels in [0, 1]), averaged over the prompts. The
last row holds the same numbers for real held-out digits. The figure shows the samples of
each prompt at each s, and for one prompt the clean-image estimate at a few sampling steps
with the cross-attention weight of its digit word over the image patches (averaged over the
blocks and heads; Hertz et al. 2022 read such per-word maps).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from typing import Any

import torch

from qkv.data.digits import NUM_CLASSES
from qkv.data.prompts import DIGIT_WORDS, evaluation_prompt
from qkv.models.ddpm import ddim_timesteps, predict_x0
from qkv.models.diffusion import recording_cross_attention
from qkv.studies.record import StudyResult
from qkv.training import TrainingConfig, train
from qkv.training.tasks.diffusion import DiffusionOptions, DiffusionTask, sample_digits
from qkv.training.tasks.vit import VitOptions, VitTask

try:  # the figure needs matplotlib; the study's record and table do not
    from qkv.analysis.plots.diffusion import guidance_figure
except ImportError:  # pragma: no cover - without matplotlib the figure is not drawn
    guidance_figure = None

__all__ = ["CLAIM", "COLUMNS", "SIZES", "TITLE", "figure", "run"]

TITLE = "Classifier-free guidance on the 8x8 digits: prompt accuracy against variety"
CLAIM = (
    "Classifier-free guidance (Ho & Salimans 2022) trades variety for fidelity: as the scale s "
    "grows from 0 (the unconditional model) through 1 (the conditional one) to 3 and 7, samples "
    "of a text-conditioned DDPM (Ho et al. 2020; a Transformer denoiser with adaLN-Zero, "
    "Peebles & Xie 2023) are expected to match their prompt more often, as read by a Vision "
    "Transformer classifier (Dosovitskiy et al. 2021), and to differ less from one another."
)
COLUMNS = ["guidance", "samples", "ViT accuracy", "ViT probability", "pairwise distance"]


def _settings(**changes: Any) -> dict[str, Any]:
    """`qkv train diffusion` and `qkv train vit` defaults (options and training), and the
    sampling; with `changes`."""
    common = {
        "diffusion": dataclasses.asdict(DiffusionOptions()),
        "diffusion_training": dict(DiffusionTask.training_defaults),
        "vit": dataclasses.asdict(VitOptions()),
        "vit_training": dict(VitTask.training_defaults),
        "guidances": [0, 1, 3, 7], "samples_per_prompt": 24, "sampler": "ddim",
        "sampling_steps": 50, "attention_digit": 7, "attention_guidance": 3,
        "steps_shown": 6, "grid_columns": 6,
    }  # fmt: skip
    return {**common, **changes}


SIZES: dict[str, dict[str, Any]] = {
    "tiny": _settings(
        diffusion={
            **dataclasses.asdict(DiffusionOptions()),
            "patch_size": 4,
            "embed_dim": 16,
            "num_layers": 1,
            "num_heads": 2,
            "ffn_dim": 32,
            "num_timesteps": 50,
        },
        diffusion_training={**DiffusionTask.training_defaults, "steps": 3, "batch_size": 16},
        vit={
            **dataclasses.asdict(VitOptions()),
            "patch_size": 4,
            "embed_dim": 16,
            "num_layers": 1,
            "num_heads": 2,
            "ffn_dim": 32,
            "dropout": 0.0,
        },
        vit_training={**VitTask.training_defaults, "steps": 3, "batch_size": 16},
        guidances=[0, 1, 3],
        samples_per_prompt=3,
        sampling_steps=4,
        steps_shown=3,
        grid_columns=2,
    ),  # fmt: skip
    "default": _settings(),
}

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the diffusion model and the ViT, sample every prompt at every guidance scale,
    read the samples with the ViT, and record one prompt's cross-attention."""
    if settings["attention_guidance"] <= 0:
        raise ValueError(f"attention_guidance: expected a scale > 0 (at 0 the prompt is not "
                         f"read), got {settings['attention_guidance']}")  # fmt: skip
    diffusion = DiffusionTask(DiffusionOptions(**settings["diffusion"]))
    task, model, diffusion_seconds = _train(diffusion, settings["diffusion_training"], seed)
    vit_task, vit, vit_seconds = _train(VitTask(VitOptions(**settings["vit"])),
                                        settings["vit_training"], seed)  # fmt: skip
    logger.info("trained the diffusion model in %.0f s and the ViT in %.0f s",
                diffusion_seconds, vit_seconds)  # fmt: skip
    rows, grids = _sample_and_read(model, task.tokenizer, vit, settings, seed)
    real_images, real_labels, real_count = _real_digits(vit_task.test_set,
                                                        settings["samples_per_prompt"])  # fmt: skip
    rows.append({"guidance": "real test digits",
                 **_measure(vit, real_images, real_labels, real_count)})  # fmt: skip
    series = {
        "grids": grids,
        "attention": _attention_through_steps(model, task.tokenizer, settings, seed),
        "vit_test_accuracy": vit_task.evaluate(vit)["test_accuracy"],
        "diffusion_metrics": task.evaluate(model),
        "training_seconds": {"diffusion": diffusion_seconds, "vit": vit_seconds},
    }
    return StudyResult(
        name="cfg-digits", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, series, settings), series=series,
    )  # fmt: skip


def _train(task, training: dict[str, Any], seed: int):
    """(task, trained model in eval mode, seconds) of one `qkv train` run, not kept on disk."""
    config = TrainingConfig(seed=seed, log_every=0, eval_every=0, checkpoint_every=0,
                            **training)  # fmt: skip
    with tempfile.TemporaryDirectory() as out_dir:
        started = time.perf_counter()
        model = train(task, config, out_dir=out_dir).model
    return task, model, time.perf_counter() - started


def _sample_and_read(model, tokenizer, vit, settings: dict[str, Any], seed: int):
    """(a table row per guidance scale, the grid of samples shown per scale): every digit's
    prompt sampled samples_per_prompt times from the same noise at each scale, read by the ViT."""
    per_prompt = settings["samples_per_prompt"]
    prompts = [evaluation_prompt(digit) for digit in range(NUM_CLASSES) for _ in range(per_prompt)]
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_prompt)
    rows, grids = [], {}
    for guidance in settings["guidances"]:
        started = time.perf_counter()
        images = sample_digits(
            model, tokenizer, prompts, guidance=guidance, seed=seed,
            sampler=settings["sampler"], steps=settings["sampling_steps"],
        )  # fmt: skip
        rows.append({"guidance": guidance, **_measure(vit, images, labels, per_prompt)})
        grids[str(guidance)] = _grid(images, per_prompt, settings["grid_columns"])
        logger.info("guidance %g: ViT accuracy %.3f, pairwise distance %.3f (%.0f s)", guidance,
                    rows[-1]["ViT accuracy"], rows[-1]["pairwise distance"],
                    time.perf_counter() - started)  # fmt: skip
    return rows, grids


@torch.no_grad()
def _measure(vit, images: torch.Tensor, labels: torch.Tensor, per_prompt: int) -> dict[str, Any]:
    """ViT accuracy and mean probability of the prompted digit; the mean pairwise distance
    within each prompt's samples (consecutive groups of per_prompt), averaged over prompts."""
    probabilities = vit(images).logits.float().softmax(dim=-1)  # (n, 10)
    groups = images.flatten(1).view(-1, per_prompt, images[0].numel())  # (prompts, k, 64)
    distances = torch.cdist(groups.double(), groups.double())  # (prompts, k, k)
    pairs = per_prompt * (per_prompt - 1)
    return {
        "samples": len(images),
        "ViT accuracy": float((probabilities.argmax(-1) == labels).float().mean()),
        "ViT probability": float(probabilities.gather(1, labels[:, None]).mean()),
        "pairwise distance": float(distances.sum(dim=(1, 2)).mean() / max(pairs, 1)),
    }


def _real_digits(data, per_prompt: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The first k held-out digits of each class (k = per_prompt, or fewer when a class has
    fewer), class by class: the reference row."""
    count = min(per_prompt, *(int((data.labels == c).sum()) for c in range(NUM_CLASSES)))
    chosen = torch.cat([torch.nonzero(data.labels == c).flatten()[:count]
                        for c in range(NUM_CLASSES)])  # fmt: skip
    return data.images[chosen], data.labels[chosen], count


def _grid(images: torch.Tensor, per_prompt: int, columns: int) -> list:
    """The first `columns` samples of each prompt, prompt by prompt: (10 * columns, H, W)."""
    shown = images[:, 0].view(NUM_CLASSES, per_prompt, *images.shape[2:])[:, :columns]
    return shown.flatten(0, 1).round(decimals=3).tolist()


@torch.no_grad()
def _attention_through_steps(model, tokenizer, settings: dict[str, Any], seed: int) -> dict:
    """For one prompt's first sample: at each DDIM step, the clean-image estimate and the
    cross-attention weight of the digit word over the patches (mean over blocks and heads)."""
    digit = settings["attention_digit"]
    prompt, word = evaluation_prompt(digit), DIGIT_WORDS[digit]
    tokens = tokenizer.encode(prompt).tokens
    position = tokens.index(word)
    estimates, recorded = [], []

    def on_step(x_t, t, eps) -> None:
        estimates.append(predict_x0(model.schedule, x_t[:1], t[:1], eps[:1]).clamp(-1, 1))

    with recording_cross_attention(model, recorded):
        sample_digits(model, tokenizer, [prompt], guidance=settings["attention_guidance"],
                      seed=seed, sampler=settings["sampler"], steps=settings["sampling_steps"],
                      on_step=on_step)  # fmt: skip
    # each forward: [conditional; unconditional] rows; the conditional one is row 0
    weights = torch.stack([torch.stack([w[0] for w in calls]).mean(dim=(0, 1))
                           for calls in recorded])  # (steps, N, S)  # fmt: skip
    rows, columns = model.config.grid
    shown = _spread(len(recorded), settings["steps_shown"])
    timesteps = [int(t) for t in _timesteps_seen(model, settings)]
    return {
        "prompt": prompt, "token": word, "tokens": tokens,
        "guidance": settings["attention_guidance"],
        "steps": [timesteps[i] for i in shown],
        "maps": weights[shown, :, position].view(len(shown), rows, columns).tolist(),
        "x0": ((torch.cat(estimates)[shown, 0] + 1) / 2).round(decimals=3).tolist(),
        "word_share": weights[:, :, position].mean(dim=1).tolist(),  # per step: mean over patches
        "token_count": len(tokens),
    }  # fmt: skip


def _timesteps_seen(model, settings: dict[str, Any]) -> list[int]:
    """The timesteps the sampler calls the model at, in order."""
    T = model.config.num_timesteps
    if settings["sampler"] == "ddpm":
        return list(range(T - 1, -1, -1))
    return ddim_timesteps(T, settings["sampling_steps"])


def _spread(count: int, shown: int) -> list[int]:
    """`shown` indices spread evenly over 0 .. count - 1, both ends included."""
    if shown >= count:
        return list(range(count))
    return [round(i * (count - 1) / (shown - 1)) for i in range(shown)]


def _findings(rows: list[dict], series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    sampled, real = rows[:-1], rows[-1]
    accuracy = ", ".join(f"{row['ViT accuracy']:.1%} at s = {row['guidance']:g}" for row in sampled)
    distance = ", ".join(f"{row['pairwise distance']:.2f} at s = {row['guidance']:g}"
                         for row in sampled)  # fmt: skip
    best = max(sampled, key=lambda row: row["ViT accuracy"])
    first, last = sampled[0], sampled[-1]
    trend = "falls" if last["pairwise distance"] < first["pairwise distance"] else "does not fall"
    attention = series["attention"]
    share = attention["word_share"]
    return [
        f"The ViT, trained in the study, reads {series['vit_test_accuracy']:.1%} of the held-out "
        f"test digits right; it reads the samples as their prompt's digit {accuracy} (chance: "
        f"{1 / NUM_CLASSES:.0%}), most often at s = {best['guidance']:g}.",
        f"Variety (mean pairwise distance between the {settings['samples_per_prompt']} samples "
        f"of one prompt): {distance}; it {trend} from s = {first['guidance']:g} to s = "
        f"{last['guidance']:g}. Real held-out digits of one class: {real['pairwise distance']:.2f} "
        f"(ViT accuracy {real['ViT accuracy']:.1%} on them).",
        f"Cross-attention of the word {attention['token']!r} in {attention['prompt']!r} (s = "
        f"{attention['guidance']:g}), averaged over patches, blocks and heads: {share[0]:.1%} of "
        f"the attention at the first sampling step, {share[-1]:.1%} at the last, "
        f"{max(share):.1%} at most; a uniform share over its {attention['token_count']} tokens "
        f"would be {1 / attention['token_count']:.1%}.",
        f"The diffusion model's validation loss is {series['diffusion_metrics']['valid_loss']:.4f} "
        f"with the prompts and {series['diffusion_metrics']['valid_loss_null']:.4f} with the null "
        f"prompt (mean squared noise error, Ho et al. 2020 eq. 14).",
    ]


def figure(result: StudyResult):
    """The samples per guidance scale (one row per digit), then one prompt's clean-image
    estimates and its digit word's cross-attention through the sampling steps."""
    if guidance_figure is None:  # pragma: no cover
        raise ImportError("the figure needs matplotlib: pip install matplotlib")
    series, settings = result.series, result.settings
    attention = series["attention"]
    grids = {f"s = {float(scale):g}": torch.tensor(images)
             for scale, images in series["grids"].items()}  # fmt: skip
    return guidance_figure(
        grids, columns=settings["grid_columns"], steps=attention["steps"],
        trajectory=torch.tensor(attention["x0"]), maps=torch.tensor(attention["maps"]),
        token=attention["token"], prompt=attention["prompt"],
        title="Samples of 'a handwritten 0' .. 'a handwritten 9' (rows) at each guidance scale s",
    )  # fmt: skip
