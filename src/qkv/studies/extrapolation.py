"""Train short, test long: validation perplexity past the training length, per position encoding.

The same small decoder (`qkv.models.GPT`) is trained once per position encoding on blocks of L
tokens of the documentation CPython ships (`qkv.data.pydoc_texts`, byte-level BPE), with the
same seed, the same data order and the same number of steps. Each model is then scored on the
validation documents cut into non-overlapping windows of L, 2L, 4L and 8L tokens: every
position's next-token loss, the same tokens at every length, so that only the window (and the
positions the model has to handle) changes. Encodings:

- none: no position information; causal masking alone orders the tokens (NoPE, Haviv et al.
  2022, "Transformer Language Models without Positional Encodings Still Learn Positional
  Information").
- learned: a trained table added to the token embeddings (GPT-2). The table has 8L rows so that
  longer inputs run at all, but rows L .. 8L - 1 are never trained: they keep their random
  initialisation, and what that does to the loss is the measurement.
- sinusoidal: the fixed sinusoids of Vaswani et al. 2017 (s3.5), defined at every position.
- rope: rotary embeddings (Su et al. 2021, "RoFormer", s3.4).
- alibi: a linear distance penalty per head (Press et al. 2022, "Train Short, Test Long:
  Attention with Linear Biases Enables Input Length Extrapolation").
- t5: T5's learned bucketed relative bias (Raffel et al. 2020, s2.1), its last bucket covering
  every distance from L on, so that longer distances reuse a trained bucket.

The RoPE model is also scored with each RoPE scaling applied at inference only, its trained
weights loaded into a config that differs in `rope_scaling` alone (original length L): position
interpolation, "linear" (Chen et al. 2023, "Extending Context Window of Large Language Models
via Positional Interpolation"), with factor n / L for windows of n tokens; "yarn" (Peng et al.
2023, "YaRN: Efficient Context Window Extension of Large Language Models") and "llama3" (Dubey
et al. 2024) with the same factor; and "dynamic" NTK, whose scale is the window's own n / L
(Peng et al. 2023, s3.3: factor 1 in the rule of `qkv.positional.RopeScaling`), one config for
every length. At n = L every scaling is plain RoPE.

The same measurement on a real LLM, SmolLM2-135M-Instruct past its trained context of 8192
tokens, comes beside the trained decoders (`qkv.studies.extrapolation_real`), where the package
that ships it is installed. The table's columns are relative to each model's own L.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from qkv.models import GPT, GPTConfig
from qkv.positional import RopeScaling
from qkv.studies import extrapolation_real
from qkv.studies.extrapolation_real import SMOLLM2_SIZES
from qkv.studies.extrapolation_verdict import PAST, RATIO, verdicts
from qkv.studies.inputs import data_order, documentation_lm
from qkv.studies.record import StudyResult
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler

__all__ = ["CLAIM", "ENCODINGS", "SCALINGS", "SIZES", "TITLE", "figure", "run", "verdicts"]

TITLE = "Perplexity past the training length, by position encoding"
CLAIM = (
    "A decoder trained on L tokens is scored on windows of up to 8L tokens: ALiBi's linear "
    "biases (Press et al. 2022) and T5's bucketed bias (Raffel et al. 2020) are expected to keep "
    "their perplexity past L, learned and sinusoidal absolute positions and plain RoPE (Su et "
    "al. 2021) to degrade, no positions at all (Haviv et al. 2022) to sit between, and RoPE "
    "scalings applied at inference (Chen et al. 2023; Peng et al. 2023) to recover part of "
    "RoPE's loss without retraining. A real LLM, SmolLM2-135M-Instruct, is expected to do the "
    "same past its trained context of 8192 tokens: plain RoPE to degrade, the scalings to "
    "recover part of it."
)
ENCODINGS = ("none", "learned", "sinusoidal", "rope", "alibi", "t5")
SCALINGS = ("linear", "dynamic", "yarn", "llama3")  # applied to the RoPE model at inference
_TABLE_KINDS = ("learned", "sinusoidal")  # encodings whose table needs a row per position
_EVAL_BATCH_TOKENS = 8192  # tokens per evaluation forward pass
_MAX_LOSS = 700.0  # exp(700) is near float's limit: a perplexity stays finite

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "train_length": 16, "length_multiples": [1, 2], "vocab_size": 300, "embed_dim": 32,
        "num_layers": 1, "num_heads": 2, "ffn_dim": 64, "t5_buckets": 8, "train_steps": 3,
        "batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 1, "weight_decay": 0.1,
        "eval_tokens": 256, "validation_fraction": 0.1, "llama3_low_freq_factor": 1.0,
        "llama3_high_freq_factor": 4.0, "stable_within": 0.1, "blow_up": 2.0,
        **SMOLLM2_SIZES["tiny"],
    },
    "default": {
        "train_length": 64, "length_multiples": [1, 2, 4, 8], "vocab_size": 1024,
        "embed_dim": 64, "num_layers": 2, "num_heads": 4, "ffn_dim": 192, "t5_buckets": 32,
        "train_steps": 700, "batch_size": 16, "learning_rate": 3e-3, "warmup_steps": 35,
        "weight_decay": 0.1, "eval_tokens": 16384, "validation_fraction": 0.1,
        "llama3_low_freq_factor": 1.0, "llama3_high_freq_factor": 4.0, "stable_within": 0.1,
        "blow_up": 2.0, **SMOLLM2_SIZES["default"],
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train one model per encoding, score each (and the RoPE scalings) at every length."""
    L = settings["train_length"]
    lengths = [L * multiple for multiple in settings["length_multiples"]]
    train_blocks, valid_stream, vocab_size = _data(settings, max(lengths))
    order = data_order(
        len(train_blocks),
        steps=settings["train_steps"],
        batch_size=settings["batch_size"],
        seed=seed,
    )  # shared by all models
    perplexity: dict[str, list[float]] = {}
    past_training: dict[str, list[float | None]] = {}
    for encoding in ENCODINGS:
        config = _config(encoding, settings, vocab_size, max(lengths))
        model = _train(config, train_blocks, order, settings, seed=seed)
        for label, build in _evaluated(encoding, config, lengths, settings):
            scores = [_score(build(n), model, valid_stream, n, L) for n in lengths]
            perplexity[label] = [score[0] for score in scores]
            past_training[label] = [score[1] for score in scores]
            logger.info("%s: ppl %s at lengths %s", label, _rounded(perplexity[label]), lengths)
    smollm2 = extrapolation_real.measure_smollm2(
        settings, SCALINGS, lambda kind, n, L: _scaling(kind, n, L, settings)
    )
    series = {
        "train_length": L, "lengths": lengths, "perplexity": perplexity,
        "perplexity_past_train_length": past_training, "smollm2": smollm2,
    }  # fmt: skip
    columns, rows = _table(series, settings)
    rows += extrapolation_real.smollm2_rows(
        smollm2, {"L": "L", "ppl@L": _column(1), "ppl@2L": _column(2), "past": PAST, "ratio": RATIO}
    )
    findings = _findings(series, settings) + extrapolation_real.smollm2_findings(smollm2)
    return StudyResult(
        name="extrapolation", title=TITLE, claim=CLAIM, columns=columns, rows=rows,
        findings=findings, series=series,
    )  # fmt: skip


def _data(settings: dict[str, Any], longest: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Training blocks (N, L), the validation stream (T,) cut to a multiple of the longest
    window (at most eval_tokens), and the BPE's vocabulary size."""
    data = documentation_lm(
        vocab_size=settings["vocab_size"], block_size=settings["train_length"],
        validation_fraction=settings["validation_fraction"],
    )  # fmt: skip
    blocks, stream = data.blocks, data.valid_stream  # (N, L), (T,)
    kept = min(len(stream), settings["eval_tokens"]) // longest * longest
    if kept == 0:
        raise ValueError(
            f"eval_tokens: the validation text makes {len(stream)} tokens and eval_tokens is "
            f"{settings['eval_tokens']}; expected room for one window of {longest} tokens"
        )
    logger.info(
        "%d training blocks of %d tokens, %d validation tokens scored at each length",
        len(blocks), settings["train_length"], kept,
    )  # fmt: skip
    return blocks, stream[:kept], data.vocab_size


def _config(encoding: str, settings: dict[str, Any], vocab_size: int, longest: int) -> GPTConfig:
    """The decoder for `encoding`: Llama-style blocks (RMSNorm, SwiGLU), no dropout. A learned
    or sinusoidal table gets a row for every evaluated position; RoPE's max_positions is the
    training length; T5's last bucket starts at distance L."""
    L = settings["train_length"]
    return GPTConfig(
        vocab_size=vocab_size, embed_dim=settings["embed_dim"],
        num_layers=settings["num_layers"], num_heads=settings["num_heads"],
        ffn_dim=settings["ffn_dim"], position=encoding,
        max_positions=longest if encoding in _TABLE_KINDS else L,
        relative_buckets=settings["t5_buckets"], relative_max_distance=L,
    )  # fmt: skip


def _train(
    config: GPTConfig, blocks: torch.Tensor, order: torch.Tensor, settings: dict, *, seed: int
) -> GPT:
    """AdamW with warm-up and cosine decay on blocks[order[step]], next-token loss; eval mode."""
    torch.manual_seed(seed)  # the same initial draws for every encoding
    model = GPT(config)
    optimizer = build_optimizer(
        model, learning_rate=settings["learning_rate"], weight_decay=settings["weight_decay"]
    )
    scheduler = build_scheduler(
        optimizer, warmup_steps=settings["warmup_steps"], total_steps=len(order), kind="cosine"
    )
    started, loss = time.perf_counter(), torch.tensor(float("nan"))
    model.train()
    for indices in order:
        batch = blocks[indices]  # (B, L)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    logger.info(
        "trained %s: %d steps, last loss %.3f, %.0f s", config.position, len(order),
        loss.item(), time.perf_counter() - started,
    )  # fmt: skip
    return model.eval()


def _evaluated(encoding: str, config: GPTConfig, lengths: list[int], settings: dict):
    """(label, length -> config to score with) pairs: the trained config itself, and for RoPE
    one per scaling at inference (the same weights, `rope_scaling` replaced)."""
    yield encoding, lambda n: config
    if encoding != "rope":
        return
    for kind in SCALINGS:
        yield (
            f"rope + {kind}",
            lambda n, kind=kind: dataclasses.replace(
                config, rope_scaling=_scaling(kind, n, settings["train_length"], settings)
            ),
        )


def _scaling(kind: str, length: int, L: int, settings: dict[str, Any]) -> RopeScaling:
    """The rule `kind` for windows of `length` tokens, original length L: factor n / L, or 1
    for dynamic NTK, whose scale follows each call's own length."""
    factor = 1.0 if kind == "dynamic" else length / L
    extra = {}
    if kind == "llama3":
        extra = {
            "low_freq_factor": settings["llama3_low_freq_factor"],
            "high_freq_factor": settings["llama3_high_freq_factor"],
        }
    original = None if kind == "linear" else L
    return RopeScaling(kind=kind, factor=factor, original_max_positions=original, **extra)


@torch.no_grad()
def _score(
    config: GPTConfig, trained: GPT, stream: torch.Tensor, length: int, train_length: int
) -> tuple[float, float | None]:
    """(perplexity over every position, perplexity over positions >= L alone or None when the
    window has none) of the trained weights under `config`, on windows of `length` tokens."""
    model = trained if config is trained.config else _with_weights(config, trained)
    losses = position_losses(model, stream, length)  # (length - 1,)
    past = losses[train_length:]  # queries at positions the training never reached
    return _perplexity(losses.mean()), _perplexity(past.mean()) if len(past) else None


def _with_weights(config: GPTConfig, trained: GPT) -> GPT:
    model = GPT(config)
    model.load_state_dict(trained.state_dict())
    return model.eval()


@torch.no_grad()
def position_losses(model: GPT, stream: torch.Tensor, length: int) -> torch.Tensor:
    """Mean next-token loss at each position of the non-overlapping windows of `length` tokens
    of `stream` (T,): (length - 1,), entry i the loss of predicting token i + 1 from 0 .. i."""
    windows = stream[: len(stream) // length * length].view(-1, length)  # (N, n)
    totals = torch.zeros(length - 1, dtype=torch.float64)
    for batch in windows.split(max(1, _EVAL_BATCH_TOKENS // length)):  # (b, n)
        logits = model(batch).logits[:, :-1]  # (b, n - 1, V)
        loss = F.cross_entropy(logits.transpose(1, 2).float(), batch[:, 1:], reduction="none")
        totals += loss.sum(dim=0).double()  # (n - 1,)
    return totals / len(windows)


def _perplexity(loss: torch.Tensor) -> float:
    return math.exp(min(float(loss), _MAX_LOSS))


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 2) for value in values]


def _column(multiple: int) -> str:
    """The column of perplexity on windows of multiple * L tokens: "ppl@L", "ppl@2L", ..."""
    return "ppl@L" if multiple == 1 else f"ppl@{multiple}L"


def _table(series: dict[str, Any], settings: dict[str, Any]):
    """(columns, one row per trained encoding and RoPE scaling): ppl at each multiple of L,
    ppl on the positions past L in the longest windows, and ppl at the longest over ppl@L."""
    L, multiples = series["train_length"], settings["length_multiples"]
    model = f"GPT, {settings['num_layers']} layers of width {settings['embed_dim']}, trained here"
    columns = ["model", "encoding", "L", *[_column(m) for m in multiples], PAST, RATIO]
    rows = []
    for label, values in series["perplexity"].items():
        row = {"model": model, "encoding": label, "L": L}
        row |= {_column(m): value for m, value in zip(multiples, values, strict=True)}
        row[PAST] = series["perplexity_past_train_length"][label][-1]
        row[RATIO] = values[-1] / values[0]
        rows.append(row)
    return columns, rows


def _findings(series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the numbers: which encodings hold, which blow up, the best at the
    longest length, and what the RoPE scalings change."""
    L, longest = series["train_length"], series["lengths"][-1]
    ratios = {label: values[-1] / values[0] for label, values in series["perplexity"].items()}
    within, blow_up = settings["stable_within"], settings["blow_up"]
    stable = [label for label, ratio in ratios.items() if ratio <= 1 + within]
    exploded = [label for label, ratio in ratios.items() if ratio >= blow_up]
    findings = [
        f"Within {within:.0%} of their ppl@{L} at {longest} tokens: "
        + (_listed(stable, ratios) if stable else "none of the models") + ".",
        f"At least {blow_up:g}x their ppl@{L} at {longest} tokens: "
        + (_listed(exploded, ratios) if exploded else "none of the models") + ".",
    ]  # fmt: skip
    findings.append(_extremes(series, longest))
    if "rope" in series["perplexity"]:
        findings.append(_scalings_finding(series, longest))
    return findings


def _listed(labels: list[str], ratios: dict[str, float]) -> str:
    return ", ".join(f"{label} ({ratios[label]:.2f}x)" for label in labels)


def _extremes(series: dict[str, Any], longest: int) -> str:
    at_longest = {label: values[-1] for label, values in series["perplexity"].items()}
    best = min(at_longest, key=at_longest.get)
    worst = max(at_longest, key=at_longest.get)
    past = series["perplexity_past_train_length"]
    text = (
        f"Lowest ppl@{longest}: {best} ({at_longest[best]:.3g}); highest: {worst} "
        f"({at_longest[worst]:.3g}, {at_longest[worst] / at_longest[best]:.3g}x the lowest)."
    )
    if past[best][-1] is not None:
        text += (
            f" On the positions past {series['train_length']} alone: {past[best][-1]:.3g} and "
            f"{past[worst][-1]:.3g}."
        )
    return text


def _scalings_finding(series: dict[str, Any], longest: int) -> str:
    """How each RoPE scaling at inference compares with plain RoPE at the longest length."""
    plain = series["perplexity"]["rope"][-1]
    scaled = {
        label: values[-1] for label, values in series["perplexity"].items()
        if label.startswith("rope + ")
    }  # fmt: skip
    best = min(scaled, key=scaled.get)
    parts = ", ".join(f"{label} {value:.3g}" for label, value in scaled.items())
    verdict = "lowers" if scaled[best] < plain else "does not lower"
    return (
        f"RoPE scalings at inference, ppl@{longest}: {parts}, against {plain:.3g} for plain "
        f"RoPE; the best, {best}, {verdict} it ({scaled[best] / plain:.2f}x)."
    )


def figure(result: StudyResult):
    """Perplexity against evaluation length (log-log), one line per encoding, RoPE scalings
    dashed, the training length marked; SmolLM2's perplexities beside it where measured."""
    from matplotlib.figure import Figure

    series = result.series
    real = "context" in series.get("smollm2", {})
    fig = Figure(figsize=(13.5 if real else 7.5, 4.8))
    ax = fig.add_subplot(1, 2 if real else 1, 1)
    for label, values in series["perplexity"].items():
        style = "--" if label.startswith("rope + ") else "-"
        ax.plot(series["lengths"], values, style, marker="o", markersize=4, label=label)
    ax.axvline(series["train_length"], color="grey", linestyle=":", label="training length")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(series["lengths"], [str(n) for n in series["lengths"]])
    ax.set_xlabel("evaluation window (tokens)")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Trained here: " + TITLE[0].lower() + TITLE[1:], fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    if real:
        extrapolation_real.draw_smollm2(fig.add_subplot(1, 2, 2), series["smollm2"])
    fig.tight_layout()
    return fig
