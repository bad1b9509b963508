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
with the cross-attention weight of its digit word over the image patches (Hertz et al. 2022
read such per-word maps): averaged over the blocks and heads, and in the one head that gives
the digit words of the ten prompts the largest share, since a head that reads the word can be
averaged away. The prompt reaches the cross-attention as its token and position embeddings
(text_layers = 0, the task's default): each key is one word's own, and the prompts' keys differ
at their digit word only, so its map shows where the digit is read.
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
from qkv.studies.record import StudyResult, Verdict, grade
from qkv.training import TrainingConfig, train
from qkv.training.tasks.diffusion import DiffusionOptions, DiffusionTask, sample_digits
from qkv.training.tasks.vit import VitOptions, VitTask

try:  # the figure needs matplotlib; the study's record and table do not
    from qkv.analysis.plots.diffusion import guidance_figure
except ImportError:  # pragma: no cover - without matplotlib the figure is not drawn
    guidance_figure = None

__all__ = [
    "CLAIM", "COLUMNS", "SIZES", "TITLE", "figure", "measure_samples", "run", "train_quietly",
    "verdicts",
]  # fmt: skip

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
    task, model, diffusion_seconds = train_quietly(diffusion, settings["diffusion_training"], seed)
    vit_task, vit, vit_seconds = train_quietly(
        VitTask(VitOptions(**settings["vit"])), settings["vit_training"], seed
    )
    logger.info("trained the diffusion model in %.0f s and the ViT in %.0f s",
                diffusion_seconds, vit_seconds)  # fmt: skip
    rows, grids = _sample_and_read(model, task.tokenizer, vit, settings, seed)
    real_images, real_labels, real_count = _real_digits(vit_task.test_set,
                                                        settings["samples_per_prompt"])  # fmt: skip
    rows.append({"guidance": "real test digits",
                 **measure_samples(vit, real_images, real_labels, real_count)})  # fmt: skip
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


def train_quietly(task, training: dict[str, Any], seed: int):
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
        rows.append({"guidance": guidance, **measure_samples(vit, images, labels, per_prompt)})
        grids[str(guidance)] = _grid(images, per_prompt, settings["grid_columns"])
        logger.info("guidance %g: ViT accuracy %.3f, pairwise distance %.3f (%.0f s)", guidance,
                    rows[-1]["ViT accuracy"], rows[-1]["pairwise distance"],
                    time.perf_counter() - started)  # fmt: skip
    return rows, grids


@torch.no_grad()
def measure_samples(
    vit, images: torch.Tensor, labels: torch.Tensor, per_prompt: int
) -> dict[str, Any]:
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
    """Every digit's prompt sampled once at attention_guidance, its cross-attention recorded.
    For the prompt of attention_digit: the clean-image estimate at each DDIM step and its digit
    word's weight over the patches, as the mean over blocks and heads and in the head that
    gives the digit words the largest share over the ten prompts (mean over steps and
    patches); the share of each prompt's digit word, per block and head."""
    digit = settings["attention_digit"]
    prompts = [evaluation_prompt(d) for d in range(NUM_CLASSES)]
    tokens = tokenizer.encode(prompts[digit]).tokens
    positions = [tokenizer.encode(p).tokens.index(DIGIT_WORDS[d]) for d, p in enumerate(prompts)]
    estimates, recorded = [], []

    def on_step(x_t, t, eps) -> None:
        one = slice(digit, digit + 1)
        estimates.append(predict_x0(model.schedule, x_t[one], t[one], eps[one]).clamp(-1, 1))

    with recording_cross_attention(model, recorded):
        sample_digits(model, tokenizer, prompts, guidance=settings["attention_guidance"],
                      seed=seed, sampler=settings["sampler"], steps=settings["sampling_steps"],
                      on_step=on_step)  # fmt: skip
    word = _word_weights(recorded, positions)  # (steps, prompts, blocks, heads, N)
    shares = word.mean(dim=(0, 4))  # (prompts, blocks, heads)
    block, head = divmod(int(shares.mean(dim=0).argmax()), shares.shape[2])
    rows, columns = model.config.grid
    shown = _spread(len(recorded), settings["steps_shown"])
    timesteps = [int(t) for t in _timesteps_seen(model, settings)]
    return {
        "prompt": prompts[digit], "token": DIGIT_WORDS[digit], "tokens": tokens,
        "guidance": settings["attention_guidance"],
        "steps": [timesteps[i] for i in shown],
        "x0": ((torch.cat(estimates)[shown, 0] + 1) / 2).round(decimals=3).tolist(),
        "maps": word[shown, digit].mean(dim=(1, 2)).view(-1, rows, columns).tolist(),
        "head": [block, head],
        "head_maps": word[shown, digit, block, head].view(-1, rows, columns).tolist(),
        "word_share": word[:, digit].mean(dim=(1, 2, 3)).tolist(),  # per step
        "head_shares": shares[digit].tolist(),  # (blocks, heads)
        "digit_shares": shares.mean(dim=(1, 2)).tolist(),  # per prompt, digit by digit
        "digit_head_shares": shares[:, block, head].tolist(),
        "token_count": len(tokens),
    }  # fmt: skip


def _word_weights(recorded: list[list[torch.Tensor]], positions: list[int]) -> torch.Tensor:
    """Each prompt's attention to its digit word: (steps, prompts, blocks, heads, N) from the
    recorded (rows, H, N, S) weights of each step and block, whose first rows are the prompts'
    conditional ones (at s = 1 the only ones; else followed by the null prompt's)."""
    B = len(positions)
    weights = torch.stack([torch.stack([w[:B] for w in calls], dim=1)
                           for calls in recorded])  # (steps, B, blocks, H, N, S)  # fmt: skip
    index = torch.tensor(positions).view(1, B, 1, 1, 1, 1)
    index = index.expand(*weights.shape[:-1], 1)
    return weights.gather(-1, index).squeeze(-1)  # (steps, B, blocks, H, N)


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
    return [
        f"The ViT, trained in the study, reads {series['vit_test_accuracy']:.1%} of the held-out "
        f"test digits right; it reads the samples as their prompt's digit {accuracy} (chance: "
        f"{1 / NUM_CLASSES:.0%}), most often at s = {best['guidance']:g}.",
        f"Variety (mean pairwise distance between the {settings['samples_per_prompt']} samples "
        f"of one prompt): {distance}; it {trend} from s = {first['guidance']:g} to s = "
        f"{last['guidance']:g}. Real held-out digits of one class: {real['pairwise distance']:.2f} "
        f"(ViT accuracy {real['ViT accuracy']:.1%} on them).",
        *_attention_findings(series["attention"], settings["diffusion"]["text_layers"]),
        f"The diffusion model's validation loss is {series['diffusion_metrics']['valid_loss']:.4f} "
        f"with the prompts and {series['diffusion_metrics']['valid_loss_null']:.4f} with the null "
        f"prompt (mean squared noise error, Ho et al. 2020 eq. 14).",
    ]


def _attention_findings(attention: dict[str, Any], text_layers: int) -> list[str]:
    """The digit word's share of the cross-attention: averaged over blocks and heads, and per
    block and head (with the head the figure draws)."""
    token, share = attention["token"], attention["word_share"]
    digits = torch.tensor(attention["digit_shares"])  # (10,): each prompt's digit word
    low, high = int(digits.argmin()), int(digits.argmax())
    context = (f"through {text_layers} encoder block(s)" if text_layers else
               "as its token and position embeddings alone (text_layers = 0), so two prompts' "
               "keys differ at their digit word only")  # fmt: skip
    per_head = torch.tensor(attention["head_shares"])  # (blocks, heads)
    top = divmod(int(per_head.argmax()), per_head.shape[1])
    chosen = torch.tensor(attention["digit_head_shares"])  # (10,)
    head_maps, mean_maps = torch.tensor(attention["head_maps"]), torch.tensor(attention["maps"])
    return [
        f"The prompt reaches the cross-attention {context}. The word {token!r} in "
        f"{attention['prompt']!r} (s = {attention['guidance']:g}), averaged over patches, blocks "
        f"and heads, gets {share[0]:.1%} of the attention at the first sampling step, "
        f"{share[-1]:.1%} at the last, {sum(share) / len(share):.1%} over all steps; a uniform "
        f"share over its {attention['token_count']} tokens would be "
        f"{1 / attention['token_count']:.1%}. Over the ten prompts 'a handwritten zero' .. "
        f"'nine', the digit word gets {digits[low]:.1%} ({DIGIT_WORDS[low]!r}) to "
        f"{digits[high]:.1%} ({DIGIT_WORDS[high]!r}), {digits.mean():.1%} on average.",
        f"Per block and head (mean over steps and patches), {token!r} gets at most "
        f"{per_head.max():.1%} ({_block_head(top, per_head.shape)}). The head that gives the "
        f"digit words the largest share over the ten prompts, "
        f"{_block_head(attention['head'], per_head.shape)}, gives them {chosen.mean():.1%} on "
        f"average ({chosen.min():.1%} to {chosen.max():.1%}) "
        f"and {token!r} {chosen[DIGIT_WORDS.index(token)]:.1%}; in the steps drawn, its weight on "
        f"{token!r} runs from {head_maps.min():.1%} to {head_maps.max():.1%} over the patches, "
        f"the mean over blocks and heads' from {mean_maps.min():.1%} to {mean_maps.max():.1%}. "
        f"The figure's last row draws that head.",
    ]


def _block_head(where: tuple[int, int], shape: tuple[int, int]) -> str:
    """(block, head), counted from 0, of (blocks, heads) -> "block 2 of 4, head 3 of 4"."""
    return f"block {where[0] + 1} of {shape[0]}, head {where[1] + 1} of {shape[1]}"


def figure(result: StudyResult):
    """The samples per guidance scale (one row per digit), then one prompt's clean-image
    estimates and its digit word's cross-attention through the sampling steps: averaged over
    blocks and heads, and in the head that reads the digit words most."""
    if guidance_figure is None:  # pragma: no cover
        raise ImportError("the figure needs matplotlib: pip install matplotlib")
    series, settings = result.series, result.settings
    attention = series["attention"]
    grids = {f"s = {float(scale):g}": torch.tensor(images)
             for scale, images in series["grids"].items()}  # fmt: skip
    block, head = attention["head"]
    maps = {"mean over blocks\nand heads": torch.tensor(attention["maps"]),
            f"block {block + 1}, head {head + 1}\n(reads digit\nwords most)":
                torch.tensor(attention["head_maps"])}  # fmt: skip
    return guidance_figure(
        grids, columns=settings["grid_columns"], steps=attention["steps"],
        trajectory=torch.tensor(attention["x0"]), maps=maps,
        token=attention["token"], prompt=attention["prompt"],
        title="Samples of 'a handwritten 0' .. 'a handwritten 9' (rows) at each guidance scale s",
    )  # fmt: skip


WHY = "one small denoiser trained for minutes on 8x8 digits, read by one small ViT."


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table: the rows of numeric guidance scales, in order."""
    scales = sorted((row for row in rows if isinstance(row["guidance"], int | float)),
                    key=lambda row: row["guidance"])  # fmt: skip
    accuracy = [row["ViT accuracy"] for row in scales]
    distance = [row["pairwise distance"] for row in scales]
    steps = list(zip(scales, scales[1:], strict=False))
    listed = ", ".join(f"s = {row['guidance']:g}" for row in scales)
    return [
        Verdict("samples match their prompt more often as s grows",
                grade(sum(b["ViT accuracy"] >= a["ViT accuracy"] for a, b in steps)
                      + (accuracy[-1] > accuracy[0]), len(steps) + 1),
                "Supported if the ViT's accuracy on the samples never falls from one scale to the "
                "next and rises from the smallest scale to the largest, mixed if in part.",
                f"{listed}: " + ", ".join(f"{100 * value:.1f}%" for value in accuracy), WHY),
        Verdict("samples differ less from one another as s grows",
                grade(sum(b["pairwise distance"] < a["pairwise distance"] for a, b in steps),
                      len(steps)),
                "Supported if the mean pairwise distance between one prompt's samples falls "
                "from each scale to the next, mixed if from some.",
                f"{listed}: " + ", ".join(f"{value:.3g}" for value in distance), WHY),
    ]  # fmt: skip
