"""Joint against factorised space-time attention on videos of moving digits.

The clips are scikit-learn's 8x8 digits moving in one of eight directions across a larger
canvas (`qkv.data.digit_video`), split by the digits' own training, validation and test sets.
Two tasks: the digit (every frame shows it) and the direction of motion (no single frame
shows it: a model reads it by comparing frames). For each task the same video classifier
(`qkv.models.VideoClassifier`: patch embedding per frame, space and time positions, mean
pooling) is trained with joint space-time attention over all T * N tokens (Arnab et al. 2021,
ViViT, model 1) and with factorised attention, within each frame then across the frames at each
patch position (ViViT model 3; Bertasius et al. 2021, TimeSformer, divided space-time
attention), with the same seed, steps and clips: training clips are drawn afresh at every step
(a new direction and start for each training digit), the same for both models.

The table reports held-out accuracy, training time (the loop, drawing the clips included),
and the attention cost per clip from `qkv.analysis.cost.video`: score-matrix elements and
FLOPs (the scores and the weighted sums alone, and with the q/k/v/out projections, of which a
factorised layer has two sets). The figure shows a test clip, the accuracies, and the attention
FLOPs of one layer against the number of frames T at the study's patch grid: joint,
factorised, and factorised written as joint attention under block masks.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from qkv.analysis.cost.video import VideoAttentionCost, video_attention_cost
from qkv.data.digit_video import (
    DIRECTION_NAMES,
    DIRECTIONS,
    DigitVideoSplits,
    digit_clips,
    digit_video_splits,
)
from qkv.data.digits import LabelledImages, digit_splits
from qkv.models.video import VideoClassifier, VideoClassifierConfig
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult, Verdict, grade
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler

__all__ = ["CLAIM", "SIZES", "TITLE", "figure", "run", "verdicts"]

TITLE = "Joint vs factorised space-time attention on moving digits"
CLAIM = (
    "Factorised space-time attention, within each frame then across frames (Bertasius et al. "
    "2021, TimeSformer; Arnab et al. 2021, ViViT model 3), computes T N^2 + N T^2 scores per "
    "head instead of joint attention's (T N)^2 and is expected to classify both the digit and "
    "its direction of motion in videos of moving digits about as well as joint space-time "
    "attention (ViViT model 1)."
)
NUM_CLASSES = {"digit": 10, "motion": len(DIRECTIONS)}
_EVAL_BATCH = 256

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "targets": ["digit", "motion"], "attentions": ["full", "factorized"], "frames": 3,
        "canvas_size": 10, "speed": 1, "patch_size": 5, "embed_dim": 16, "num_layers": 1,
        "num_heads": 2, "ffn_dim": 32, "dropout": 0.0, "steps": 3, "batch_size": 8,
        "learning_rate": 3e-3, "weight_decay": 0.05, "warmup_steps": 1,
        "flops_frames": [1, 2, 4],
    },
    "default": {
        "targets": ["digit", "motion"], "attentions": ["full", "factorized"], "frames": 4,
        "canvas_size": 16, "speed": 2, "patch_size": 4, "embed_dim": 48, "num_layers": 2,
        "num_heads": 4, "ffn_dim": 96, "dropout": 0.0, "steps": 1200, "batch_size": 32,
        "learning_rate": 3e-3, "weight_decay": 0.05, "warmup_steps": 30,
        "flops_frames": [1, 2, 4, 6, 8, 16, 32, 64],
    },
}  # fmt: skip

COLUMNS = ["target", "attention", "parameters", "valid accuracy", "test accuracy",
           "training s", "scores / clip", "attention MFLOP / clip",
           "with projections MFLOP / clip"]  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train one classifier per (target, attention), test each, and cost their attention."""
    splits = digit_video_splits(
        frames=settings["frames"], canvas_size=settings["canvas_size"],
        speed=settings["speed"], seed=seed,
    )  # fmt: skip
    train_digits = digit_splits(seed=seed).train  # the digits of splits.train
    rows = []
    for target in settings["targets"]:
        for kind in settings["attentions"]:
            config = _config(settings, target=target, attention=kind)
            model, seconds = _train(config, train_digits, target, settings, seed=seed)
            rows.append(_row(config, model, splits, target, seconds))
            logger.info("%s/%s: test accuracy %.4f in %.0f s", target, kind,
                        rows[-1]["test accuracy"], seconds)  # fmt: skip
    config = _config(settings, target="digit", attention="full")
    series = {
        "clip": splits.test.videos[0, :, 0].tolist(),  # (T, S, S)
        "clip_digit": int(splits.test.digits[0]),
        "clip_direction": DIRECTION_NAMES[int(splits.test.directions[0])],
        "patch_size": settings["patch_size"],
        "accuracy": {f"{row['target']}/{row['attention']}": row["test accuracy"] for row in rows},
        "flops_vs_frames": _flops_curves(config, settings["flops_frames"]),
    }
    return StudyResult(
        name="video-attention", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, series, settings), series=series,
    )  # fmt: skip


def _config(settings: dict[str, Any], *, target: str, attention: str) -> VideoClassifierConfig:
    return VideoClassifierConfig(
        frames=settings["frames"], image_size=settings["canvas_size"],
        patch_size=settings["patch_size"], channels=1, embed_dim=settings["embed_dim"],
        num_layers=settings["num_layers"], num_heads=settings["num_heads"],
        ffn_dim=settings["ffn_dim"], num_classes=NUM_CLASSES[target], attention=attention,
        dropout=settings["dropout"],
    )  # fmt: skip


def _train(
    config: VideoClassifierConfig,
    train: LabelledImages,
    target: str,
    settings: dict,
    *,
    seed: int,
) -> tuple[VideoClassifier, float]:
    """AdamW with warm-up and cosine decay on fresh clips of the training digits (the same
    clips for every model: a pure function of seed and step); the model in eval mode."""
    torch.manual_seed(seed)
    model = VideoClassifier(config)
    optimizer = build_optimizer(model, learning_rate=settings["learning_rate"],
                                weight_decay=settings["weight_decay"])  # fmt: skip
    order = data_order(len(train), steps=settings["steps"], batch_size=settings["batch_size"],
                       seed=seed)  # fmt: skip
    scheduler = build_scheduler(optimizer, warmup_steps=settings["warmup_steps"],
                                total_steps=len(order), kind="cosine")  # fmt: skip
    started = time.perf_counter()
    model.train()
    for step, indices in enumerate(order):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        clips = digit_clips(
            train.images[indices], train.labels[indices], frames=config.frames,
            canvas_size=config.image_size, speed=settings["speed"], generator=generator,
        )  # fmt: skip
        loss = model(clips.videos, clips.labels(target)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model.eval(), time.perf_counter() - started


@torch.no_grad()
def _accuracy(model: VideoClassifier, clips: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of clips (M, T, C, H, W) whose argmax logit is their label (M,)."""
    correct = sum(
        int((model(videos).logits.argmax(-1) == truth).sum())
        for videos, truth in zip(clips.split(_EVAL_BATCH), labels.split(_EVAL_BATCH), strict=True)
    )
    return correct / len(labels)


def _layer_cost(config: VideoClassifierConfig, frames: int | None = None) -> VideoAttentionCost:
    return video_attention_cost(
        frames=config.frames if frames is None else frames, patches=config.num_patches,
        embed_dim=config.embed_dim, num_heads=config.num_heads,
    )  # fmt: skip


def _row(config: VideoClassifierConfig, model: VideoClassifier, splits: DigitVideoSplits,
         target: str, seconds: float) -> dict[str, Any]:  # fmt: skip
    """One table row: accuracies, time, and the attention cost of a clip over all layers."""
    cost, layers, heads = _layer_cost(config), config.num_layers, config.num_heads
    full = config.attention == "full"
    scores = cost.full_scores if full else cost.factorized_scores
    per_head = cost.full_flops_per_head if full else cost.factorized_flops_per_head
    with_projections = cost.full_flops if full else cost.factorized_flops
    return {
        "target": target, "attention": config.attention,
        "parameters": sum(p.numel() for p in model.parameters()),
        "valid accuracy": _accuracy(model, splits.valid.videos, splits.valid.labels(target)),
        "test accuracy": _accuracy(model, splits.test.videos, splits.test.labels(target)),
        "training s": seconds, "scores / clip": layers * heads * scores,
        "attention MFLOP / clip": layers * heads * per_head / 1e6,
        "with projections MFLOP / clip": layers * with_projections / 1e6,
    }  # fmt: skip


def _flops_curves(config: VideoClassifierConfig, frames: list[int]) -> dict[str, Any]:
    """One layer's attention FLOPs (with projections) and scores per head against T."""
    costs = [_layer_cost(config, T) for T in frames]
    return {
        "frames": frames, "patches": config.num_patches, "trained_frames": config.frames,
        "full": [c.full_flops for c in costs],
        "factorized": [c.factorized_flops for c in costs],
        "masked": [c.masked_flops for c in costs],
        "full_scores": [c.full_scores for c in costs],
        "factorized_scores": [c.factorized_scores for c in costs],
    }  # fmt: skip


def _findings(rows: list[dict], series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    by = {(row["target"], row["attention"]): row for row in rows}
    findings = []
    for target in settings["targets"]:
        if (target, "full") not in by or (target, "factorized") not in by:
            continue
        full, factorised = by[target, "full"], by[target, "factorized"]
        findings.append(
            f"{target}: joint attention {full['test accuracy']:.1%} test accuracy in "
            f"{full['training s']:.0f} s, factorised {factorised['test accuracy']:.1%} in "
            f"{factorised['training s']:.0f} s ({factorised['parameters']:,} parameters against "
            f"{full['parameters']:,}: two attentions per block), after {settings['steps']} steps."
        )
    findings += _cost_findings(series["flops_vs_frames"])
    return findings


def _cost_findings(curves: dict[str, Any]) -> list[str]:
    T, N = curves["trained_frames"], curves["patches"]
    at = curves["frames"].index(T) if T in curves["frames"] else None
    findings = []
    if at is not None:
        full, factorised = curves["full_scores"][at], curves["factorized_scores"][at]
        findings.append(
            f"At T = {T} frames of N = {N} patches, a head computes {full:,} scores jointly and "
            f"{factorised:,} factorised ({full / factorised:.1f}x fewer); with the projections "
            f"a factorised layer costs {curves['factorized'][at] / curves['full'][at]:.2f}x a "
            f"joint one, and as joint attention under block masks "
            f"{curves['masked'][at] / curves['full'][at]:.2f}x."
        )
    cheaper = [t for t, a, b in zip(curves["frames"], curves["factorized"], curves["full"],
                                    strict=True) if a < b]  # fmt: skip
    longest = curves["frames"][-1]
    findings.append(
        f"Per layer with projections, factorised attention is cheaper from T = {cheaper[0]} on "
        f"(of T in {curves['frames']}); at T = {longest} it costs "
        f"{curves['factorized'][-1] / curves['full'][-1]:.1%} of joint attention."
        if cheaper else
        f"Per layer with projections, factorised attention costs more than joint attention "
        f"at every T in {curves['frames']}: at N = {N} the projections dominate."
    )  # fmt: skip
    return findings


def figure(result: StudyResult):
    """A test clip, test accuracy per target and attention, and one layer's attention FLOPs
    against the number of frames."""
    from matplotlib.figure import Figure

    series = result.series
    clip = series["clip"]
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 2.2])
    top.suptitle(f"A test clip: digit {series['clip_digit']}, moving "
                 f"{series['clip_direction']}")  # fmt: skip
    side, patch = len(clip[0]), series["patch_size"]
    for t, ax in enumerate(top.subplots(1, len(clip), squeeze=False)[0]):
        ax.imshow(clip[t], cmap="gray_r", vmin=0, vmax=1)
        for edge in range(patch, side, patch):  # the patch grid
            ax.axhline(edge - 0.5, color="tab:blue", linewidth=0.5, alpha=0.5)
            ax.axvline(edge - 0.5, color="tab:blue", linewidth=0.5, alpha=0.5)
        ax.set_title(f"t = {t}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    bars, curve = bottom.subplots(1, 2)
    _accuracy_bars(bars, series["accuracy"])
    _flops_plot(curve, series["flops_vs_frames"])
    return fig


def _accuracy_bars(ax, accuracy: dict[str, float]) -> None:
    targets = list(dict.fromkeys(label.split("/")[0] for label in accuracy))
    kinds = list(dict.fromkeys(label.split("/")[1] for label in accuracy))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        values = [accuracy.get(f"{target}/{kind}", 0.0) for target in targets]
        positions = [i + (k - (len(kinds) - 1) / 2) * width for i in range(len(targets))]
        drawn = ax.bar(positions, values, width, label=kind)
        ax.bar_label(drawn, labels=[f"{v:.1%}" for v in values], fontsize=8)
    ax.set_xticks(range(len(targets)), targets)
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("test accuracy")
    ax.set_title("Held-out clips")
    ax.legend(fontsize=8, loc="upper center", ncol=len(kinds))


def _flops_plot(ax, curves: dict[str, Any]) -> None:
    for key, label, style in (("full", "joint space-time", "-"),
                              ("factorized", "factorised (reshaped)", "-"),
                              ("masked", "factorised as masked joint", "--")):  # fmt: skip
        ax.plot(curves["frames"], curves[key], style, marker="o", markersize=3, label=label)
    ax.axvline(curves["trained_frames"], color="grey", linestyle=":", label="frames trained")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("frames T")
    ax.set_ylabel("FLOPs of one attention layer, one clip")
    ax.set_title(f"Attention FLOPs with projections, N = {curves['patches']} patches")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)


ABOUT_AS_WELL = 0.02  # "about as well": test accuracy at most 2 points below joint attention's
WHY = "a 1200-step run on small synthetic videos of moving digits is one small sample."


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table: per target, the joint ("full") and factorised rows."""
    pairs = {row["target"]: {} for row in rows}
    for row in rows:
        pairs[row["target"]][row["attention"]] = row
    fewer = [t for t, pair in pairs.items()
             if pair["factorized"]["scores / clip"] < pair["full"]["scores / clip"]]  # fmt: skip
    close = [t for t, pair in pairs.items() if pair["factorized"]["test accuracy"]
             >= pair["full"]["test accuracy"] - ABOUT_AS_WELL]  # fmt: skip
    first = next(iter(pairs.values()))
    return [
        Verdict("factorised attention computes fewer scores", grade(len(fewer), len(pairs)),
                "Supported if, for every target, factorised attention computes fewer scores per "
                "clip than joint attention.",
                f"{first['factorized']['scores / clip']:,} against "
                f"{first['full']['scores / clip']:,}", WHY),
        Verdict("factorised attention classifies about as well as joint attention",
                grade(len(close), len(pairs)),
                f"Supported if, for every target, factorised test accuracy is at most "
                f"{100 * ABOUT_AS_WELL:g} points below joint attention's, mixed if for some.",
                ", ".join(f"{t}: {100 * p['factorized']['test accuracy']:.1f}% against "
                          f"{100 * p['full']['test accuracy']:.1f}%" for t, p in pairs.items()),
                WHY),
    ]  # fmt: skip
