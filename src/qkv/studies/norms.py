"""Norms and residuals: what padding does to BatchNorm, what residuals do for depth, and when
post-norm needs warm-up.

1. Padding and BatchNorm. Documentation sentences (`qkv.data.pydoc_documents`), tokenised by
   MiniLM's WordPiece and embedded by the token table of the real all-MiniLM-L6-v2, make a
   padded batch (B, L, 384) whose padded positions hold the [PAD] row, as the model sees them.
   Per-channel mean and standard deviation over the real tokens are set against those over
   every position (what BatchNorm computes when nobody tells it where the padding is; Ioffe &
   Szegedy 2015, s3). Then BatchNorm over all positions, BatchNorm over the real tokens
   (`qkv.layers.BatchNorm` with a mask), LayerNorm (Ba et al. 2016) and RMSNorm (Zhang &
   Sennrich 2019) normalise the batch, and the largest change of a real token's output is
   measured when only the padding changes (the batch padded to its longest sentence, then to
   `pad_to` tokens, as MiniLM's own tokenizer file pads) and when the first sentence's
   batchmates are replaced by other sentences.
2. Residual connections (He et al. 2016). A small causal language model (`CausalLM`: 2, 6 and
   12 pre-norm `qkv.layers.EncoderBlock`s run causally) is trained on byte-level BPE blocks of
   the same text with and without the "Add" of each sub-layer (`without_residual` in place of
   the block's residual function): the final training loss, and the gradient norm of the first
   and last blocks' parameters at the first step.
3. Post-norm vs pre-norm (Xiong et al. 2020). The same model at one depth, post-norm (Vaswani
   et al. 2017, s3.1) and pre-norm, with and without linear warm-up, at a learning rate high
   enough for the difference to show, over several seeds (one data order per seed): the loss
   curves, and the runs that diverge: a loss that is not finite, or a final loss that does not
   come `learned_margin` nats below the unigram entropy of the training tokens (the loss of a
   model that reads no context, where a post-norm stack that fails to train stays).

The first measurement is `qkv.studies.norms_padding`'s; this module holds the other two and the
report.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import torch
from torch import nn
from torch.nn import Linear
from torch.nn.utils import get_total_norm

from qkv.layers import EncoderBlock, LayerNorm
from qkv.models.gpt import next_token_loss
from qkv.positional import LearnedPositionalEmbedding
from qkv.studies.inputs import data_order, documentation_lm
from qkv.studies.norms_padding import NORMS, padding_effects
from qkv.studies.norms_verdict import verdicts  # noqa: F401
from qkv.studies.record import StudyResult
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler
from qkv.validation import check_choice

__all__ = ["ARRANGEMENTS", "CLAIM", "NORMS", "SIZES", "TITLE", "CausalLM", "figure",
           "padding_effects", "run", "without_residual"]  # fmt: skip

TITLE = "Norms and residuals: BatchNorm on padded text, depth without residuals, post- vs pre-norm"
CLAIM = (
    "BatchNorm's statistics (Ioffe & Szegedy 2015) are pulled by the padding of a text batch and "
    "tie each sequence's output to the rest of the batch, where LayerNorm (Ba et al. 2016) and "
    "RMSNorm (Zhang & Sennrich 2019) normalise each token alone; residual connections (He et "
    "al. 2016) keep deep stacks trainable; and post-norm Transformers need learning-rate "
    "warm-up where pre-norm ones do not (Xiong et al. 2020)."
)
ARRANGEMENTS = ("post-norm", "pre-norm", "no residual")
COLUMNS = [
    "part", "variant", "max output change, more padding", "max output change, other batchmates",
    "final train loss", "grad norm first block, step 0", "grad norm last block, step 0",
    "diverged runs",
]  # fmt: skip

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "text_batch": 4, "min_tokens": 6, "max_tokens": 24, "pad_to": 32, "vocab_size": 300,
        "block_size": 16, "embed_dim": 16, "num_heads": 2, "batch_size": 4,
        "validation_fraction": 0.1, "depths": [1, 2], "residual_steps": 3,
        "residual_learning_rate": 1e-3, "residual_warmup": 1, "stability_layers": 2,
        "stability_steps": 4, "stability_learning_rate": 1e-2, "stability_warmup": 2,
        "num_seeds": 2, "tail": 2, "curve_every": 2, "learned_margin": 0.5,
    },
    "default": {
        "text_batch": 16, "min_tokens": 6, "max_tokens": 64, "pad_to": 128, "vocab_size": 512,
        "block_size": 32, "embed_dim": 64, "num_heads": 4, "batch_size": 16,
        "validation_fraction": 0.1, "depths": [2, 6, 12], "residual_steps": 200,
        "residual_learning_rate": 1e-3, "residual_warmup": 10, "stability_layers": 6,
        "stability_steps": 150, "stability_learning_rate": 1e-2, "stability_warmup": 40,
        "num_seeds": 3, "tail": 20, "curve_every": 5, "learned_margin": 0.5,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """The three measurements, their table rows, findings and figure series."""
    series = {"padding": padding_effects(settings, seed=seed)}
    blocks, vocab_size = _lm_data(settings)
    series["unigram_loss"] = _unigram_loss(blocks, vocab_size)
    series["residuals"] = _residuals(settings, blocks, vocab_size, seed)
    threshold = series["unigram_loss"] - settings["learned_margin"]
    series["stability"] = _stability(settings, blocks, vocab_size, seed, threshold)
    return StudyResult(
        name="norms", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=_rows(series),
        findings=_findings(series, settings), series=series,
    )  # fmt: skip


# 2 and 3. A small causal language model, with or without residuals, post- or pre-norm -------


def without_residual(x: torch.Tensor, sublayer, norm: nn.Module, dropout: nn.Module):
    """A sub-layer with no "Add": dropout(sublayer(norm(x))), the signature of
    `qkv.layers.pre_norm`, for a plain (non-residual) stack in the sense of He et al. 2016."""
    return dropout(sublayer(norm(x)))


class CausalLM(nn.Module):
    """Token and learned position embeddings, num_layers `qkv.layers.EncoderBlock`s (GELU FFN of
    4 * E) run with a causal mask, a final LayerNorm (none after post-norm blocks, which end
    with one), an output projection. arrangement: one of ARRANGEMENTS; "no residual" is the
    pre-norm block with its residual function replaced by `without_residual`.
    input_ids (B, L) -> logits (B, L, V)."""

    def __init__(
        self, *, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int,
        block_size: int, arrangement: str,
    ) -> None:  # fmt: skip
        super().__init__()
        check_choice("arrangement", arrangement, ARRANGEMENTS)
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = LearnedPositionalEmbedding(block_size, embed_dim)
        norm_first = arrangement != "post-norm"
        self.blocks = nn.ModuleList(
            EncoderBlock(
                embed_dim, num_heads, 4 * embed_dim, activation="gelu", norm_first=norm_first
            )
            for _ in range(num_layers)
        )
        if arrangement == "no residual":
            for block in self.blocks:
                block.residual = without_residual
        self.final_norm = nn.Identity() if arrangement == "post-norm" else LayerNorm(embed_dim)
        self.lm_head = Linear(embed_dim, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (L,)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)  # (B, L, E)
        for block in self.blocks:
            x = block(x, causal=True)
        return self.lm_head(self.final_norm(x))  # (B, L, V)


def _lm_data(settings: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Training blocks (N, block_size) of byte-level BPE tokens, and the vocabulary size."""
    data = documentation_lm(
        vocab_size=settings["vocab_size"], block_size=settings["block_size"],
        validation_fraction=settings["validation_fraction"],
    )  # fmt: skip
    return data.blocks, data.vocab_size


def _unigram_loss(blocks: torch.Tensor, vocab_size: int) -> float:
    """The entropy (nats) of the training tokens' frequencies: the loss of a model that
    predicts every token from no context at all."""
    counts = torch.bincount(blocks.flatten(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def _train(
    model: CausalLM, blocks: torch.Tensor, order: torch.Tensor, *, learning_rate: float,
    warmup_steps: int,
) -> tuple[list[float | None], list[float]]:  # fmt: skip
    """AdamW (no weight decay, no clipping) at a constant learning rate after linear warm-up
    on blocks[order[step]]: the loss at each step (None after a non-finite one, where training
    stops) and each block's parameter-gradient norm at the first step."""
    optimizer = build_optimizer(model, learning_rate=learning_rate, weight_decay=0.0)
    scheduler = build_scheduler(
        optimizer, warmup_steps=warmup_steps, total_steps=len(order), kind="constant"
    )
    losses: list[float | None] = []
    first_gradients: list[float] = []
    for step, indices in enumerate(order):
        batch = blocks[indices]  # (B, L)
        loss = next_token_loss(model(batch), batch)
        if not torch.isfinite(loss):
            return losses + [None] * (len(order) - step), first_gradients
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            first_gradients = [
                float(get_total_norm([p.grad for p in block.parameters()]))
                for block in model.blocks
            ]
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, first_gradients


def _model(settings: dict[str, Any], vocab_size: int, layers: int, arrangement: str, seed: int):
    torch.manual_seed(seed)  # the same initial draws for every variant of one seed
    return CausalLM(
        vocab_size=vocab_size, embed_dim=settings["embed_dim"], num_heads=settings["num_heads"],
        num_layers=layers, block_size=settings["block_size"], arrangement=arrangement,
    )  # fmt: skip


def _final(losses: list[float | None], tail: int) -> float:
    """The mean of the last `tail` losses; inf when any loss was not finite."""
    if any(loss is None for loss in losses):
        return math.inf
    return statistics.fmean(losses[-tail:])


def _residuals(settings, blocks, vocab_size, seed) -> dict[str, list[dict[str, float]]]:
    """Pre-norm with and without residuals at each depth: final loss, step-0 gradient norms."""
    order = data_order(len(blocks), steps=settings["residual_steps"],
                       batch_size=settings["batch_size"], seed=seed)  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {}
    for arrangement in ("pre-norm", "no residual"):
        results[arrangement] = []
        for layers in settings["depths"]:
            model = _model(settings, vocab_size, layers, arrangement, seed)
            losses, gradients = _train(
                model, blocks, order, learning_rate=settings["residual_learning_rate"],
                warmup_steps=settings["residual_warmup"],
            )  # fmt: skip
            final = _final(losses, settings["tail"])
            first, last = (gradients[0], gradients[-1]) if gradients else (None, None)
            results[arrangement].append(
                {"layers": layers, "final_loss": final, "grad_first": first, "grad_last": last}
            )
            logger.info("%s, %d layers: final loss %.3f", arrangement, layers, final)
    return results


def _stability(settings, blocks, vocab_size, seed, threshold) -> dict[str, dict[str, Any]]:
    """Post-norm and pre-norm, with and without warm-up, over seeds: loss curves (means over
    curve_every steps), final losses, and the runs that diverge (final loss above `threshold`
    or not finite)."""
    results: dict[str, dict[str, Any]] = {}
    for arrangement in ("post-norm", "pre-norm"):
        for warmup in (0, settings["stability_warmup"]):
            label = f"{arrangement}, " + (f"warm-up {warmup}" if warmup else "no warm-up")
            curves, finals = [], []
            for run_seed in range(seed, seed + settings["num_seeds"]):
                order = data_order(len(blocks), steps=settings["stability_steps"],
                                   batch_size=settings["batch_size"], seed=run_seed)  # fmt: skip
                model = _model(settings, vocab_size, settings["stability_layers"], arrangement,
                               run_seed)  # fmt: skip
                losses, _ = _train(
                    model, blocks, order, learning_rate=settings["stability_learning_rate"],
                    warmup_steps=warmup,
                )  # fmt: skip
                curves.append(_binned(losses, settings["curve_every"]))
                finals.append(_final(losses, settings["tail"]))
            diverged = sum(not final <= threshold for final in finals)
            results[label] = {"curves": curves, "final_losses": finals, "diverged": diverged}
            logger.info("%s: final losses %s, %d diverged", label, finals, diverged)
    return results


def _binned(losses: list[float | None], every: int) -> list[float | None]:
    """Means over consecutive bins of `every` steps (None for a bin past a non-finite loss)."""
    bins = [losses[start : start + every] for start in range(0, len(losses), every)]
    return [None if None in part else statistics.fmean(part) for part in bins]


# The table, the findings, the figure ----------------------------------------------------------


def _rows(series: dict[str, Any]) -> list[dict[str, Any]]:
    padding, residuals, stability = (series[key] for key in ("padding", "residuals", "stability"))
    rows = [
        {"part": "padding", "variant": name, COLUMNS[2]: change["more_padding"],
         COLUMNS[3]: change["other_batchmates"]}
        for name, change in padding["changes"].items()
    ]  # fmt: skip
    rows += [
        {"part": "residuals", "variant": f"{arrangement}, {r['layers']} layers",
         COLUMNS[4]: r["final_loss"], COLUMNS[5]: r["grad_first"], COLUMNS[6]: r["grad_last"]}
        for arrangement, results in residuals.items() for r in results
    ]  # fmt: skip
    rows += [
        {"part": "warm-up", "variant": label, COLUMNS[4]: statistics.median(r["final_losses"]),
         COLUMNS[7]: f"{r['diverged']} of {len(r['final_losses'])}"}
        for label, r in stability.items()
    ]  # fmt: skip
    return rows


def _findings(series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the numbers of the three measurements."""
    padding, residuals, stability = (series[key] for key in ("padding", "residuals", "stability"))
    mean_real, mean_all = torch.tensor(padding["mean_real"]), torch.tensor(padding["mean_all"])
    std_real, std_all = torch.tensor(padding["std_real"]), torch.tensor(padding["std_all"])
    shift = (mean_all - mean_real).abs() / std_real  # (E,): in real-token standard deviations
    ratio = std_all / std_real  # (E,)
    changes = padding["changes"]
    lengths = padding["lengths"]
    depths = ", ".join(str(r["layers"]) for r in next(iter(residuals.values())))
    trained = "; ".join(
        f"{arrangement}: final loss " + ", ".join(f"{r['final_loss']:.2f}" for r in results)
        + ", first/last block gradient " + ", ".join(f"{r['grad_first'] / r['grad_last']:.2g}"
                                                     for r in results)
        for arrangement, results in residuals.items()
    )  # fmt: skip
    unigram, margin = series["unigram_loss"], settings["learned_margin"]
    return [
        f"Padding is {padding['pad_fraction']:.0%} of a batch of {len(lengths)} sentences "
        f"({min(lengths)} to {max(lengths)} tokens): over all positions BatchNorm's per-channel "
        f"mean moves by {shift.mean():.2f} real-token standard deviations on average (at most "
        f"{shift.max():.2f}), and its standard deviation is {ratio.median():.2f}x the real "
        f"tokens' (median over {len(ratio)} channels; {ratio.min():.2f}x to {ratio.max():.2f}x).",
        "Largest change of a real token's normalised output when the batch is padded further: "
        + ", ".join(f"{name} {change['more_padding']:.2g}" for name, change in changes.items())
        + "; when the first sentence's batchmates are replaced: "
        + ", ".join(f"{name} {change['other_batchmates']:.2g}" for name, change in changes.items())
        + ".",
        f"At {depths} layers, {trained}.",
        f"At learning rate {settings['stability_learning_rate']:g} with "
        f"{settings['stability_layers']} layers, runs that diverged (loss not finite, or final "
        f"loss not {margin:g} below the unigram loss {unigram:.2f}): "
        + ", ".join(f"{label} {r['diverged']} of {len(r['final_losses'])}"
                    for label, r in stability.items())
        + "; median final loss: "
        + ", ".join(f"{label} {statistics.median(r['final_losses']):.2f}"
                    for label, r in stability.items())
        + ".",
    ]  # fmt: skip


def figure(result: StudyResult):
    """Four panels: per-channel mean and std over real tokens vs over all positions; final loss
    and first-block gradient norm against depth, with and without residuals; loss curves of
    post- and pre-norm with and without warm-up (one line per seed)."""
    from matplotlib.figure import Figure

    series, settings = result.series, result.settings
    fig = Figure(figsize=(11, 8))
    axes = fig.subplots(2, 2)
    padding, ax = series["padding"], axes[0, 0]
    for key, label in (("mean", "channel mean"), ("std", "channel std")):
        ax.scatter(padding[f"{key}_real"], padding[f"{key}_all"], s=6, label=label)
    ends = [min(padding["mean_real"]), max(padding["std_real"])]
    ax.plot(ends, ends, color="grey", linestyle=":", label="unchanged")
    ax.set(xlabel="over real tokens", ylabel="over all positions (padding included)",
           title=f"BatchNorm statistics, {padding['pad_fraction']:.0%} padding")  # fmt: skip
    for ax, key, label in (
        (axes[0, 1], "final_loss", "final training loss"),
        (axes[1, 0], "grad_first", "first block's gradient norm, step 0"),
    ):
        for arrangement, results in series["residuals"].items():
            xs, ys = [r["layers"] for r in results], [r[key] for r in results]
            ax.plot(xs, ys, marker="o", label=arrangement)
        ax.set(xlabel="layers", ylabel=label, title=f"Residual connections: {label}",
               xticks=settings["depths"])  # fmt: skip
    axes[1, 0].set_yscale("log")
    ax = axes[1, 1]
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green")
    for color, (label, outcome) in zip(colors, series["stability"].items(), strict=False):
        for index, curve in enumerate(outcome["curves"]):
            steps = [settings["curve_every"] * (i + 0.5) for i in range(len(curve))]
            values = [math.nan if value is None else value for value in curve]
            ax.plot(steps, values, color=color, linewidth=1, label=None if index else label)
    ax.axhline(series["unigram_loss"], color="grey", linestyle=":", label="unigram loss")
    threshold = series["unigram_loss"] - settings["learned_margin"]
    ax.axhline(threshold, color="black", linestyle="--", linewidth=0.8, label="diverged above")
    ax.set(xlabel="step", ylabel="training loss", title=f"Warm-up, {settings['stability_layers']} "
           f"layers, learning rate {settings['stability_learning_rate']:g}")  # fmt: skip
    for ax in axes.flat:
        ax.legend(fontsize=8)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig
