"""Train short, test long on a real LLM: the extrapolation study (`qkv.studies.extrapolation`)
on SmolLM2-135M-Instruct (Allal et al. 2025; RoPE with base 1e5, a context of L = 8192 tokens,
its GGUF file's `llama.context_length`).

The model is scored on windows of L and of 2L tokens of CPython's documentation (the pydoc
topics in sorted name order, joined by blank lines, through the model's own tokenizer): with
plain RoPE, and with each RoPE scaling of the study applied at inference, factor 2 over the
original L (dynamic NTK: its own n / L), the file's weights unchanged. On a window of L tokens
every scaling is plain RoPE (factor n / L = 1), so L is scored once. The figures: perplexity
over every position of the L-token windows, over every position of the 2L-token windows, and
over the positions >= L of those alone, which the model never reached in training.

A window's next-token losses come from its final hidden states through the output head a slice
of positions at a time: the (2L, V) logits of one window would take 3 GB.

The tiny size scores L = `smollm2_length` tokens in place of the file's context: it runs the
same code in seconds, and its figures say nothing about the claim.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pydoc_data.topics import topics
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from qkv.models import GPT
from qkv.models.gpt import make_rope
from qkv.positional import RopeScaling
from qkv.studies.sinks_real import SMOLLM2, load_smollm2

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "SMOLLM2_SIZES",
    "draw_smollm2",
    "measure_smollm2",
    "rope_scaled",
    "smollm2_findings",
    "smollm2_rows",
    "window_losses",
]

logger = logging.getLogger(__name__)

# smollm2_length: L, None for the file's context; smollm2_windows: windows of 2L scored
SMOLLM2_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"smollm2_length": 32, "smollm2_windows": 1},
    "default": {"smollm2_length": None, "smollm2_windows": 1},
}
_HEAD_SLICE = 1024  # positions through the output head at a time


def measure_smollm2(
    settings: dict[str, Any], scalings: tuple[str, ...],
    scaling: Callable[[str, int, int], RopeScaling],
) -> dict[str, Any]:  # fmt: skip
    """Perplexities at L and 2L (module docstring), plain RoPE and `scalings`, each built by
    scaling(kind, window, L); {"missing": how to install} without the package."""
    try:
        model, tokenizer = load_smollm2()
    except FileNotFoundError as error:
        logger.warning("%s is not measured: %s", SMOLLM2, error)
        return {"missing": str(error)}
    L = settings["smollm2_length"] or model.config.max_positions
    windows = settings["smollm2_windows"]
    stream = _documentation(tokenizer, 2 * L * windows)  # (2L * windows,)
    logger.info("%s: %d window(s) of %d and %d tokens", SMOLLM2, 2 * windows, L, 2 * L)
    at_context = _mean_losses(model, stream, L)  # (L - 1,)
    rules = {"rope": None} | {f"rope + {kind}": scaling(kind, 2 * L, L) for kind in scalings}
    perplexity, past = {}, {}
    for label, rule in rules.items():
        with rope_scaled(model, rule):
            losses = _mean_losses(model, stream, 2 * L)  # (2L - 1,)
        perplexity[label], past[label] = _perplexity(losses), _perplexity(losses[L:])
        logger.info("%s, %s: ppl@%d %.3g, past %d %.3g", SMOLLM2, label, 2 * L,
                    perplexity[label], L, past[label])  # fmt: skip
    return {
        "context": L, "file_context": model.config.max_positions, "windows": windows,
        "perplexity_at_context": _perplexity(at_context),
        "perplexity_double": perplexity, "perplexity_past_context": past,
    }  # fmt: skip


def _documentation(tokenizer: Tokenizer, count: int) -> torch.Tensor:
    """The first `count` tokens of the pydoc topics, sorted by name, joined by blank lines."""
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer.encode(text).ids
    if len(ids) < count:
        raise ValueError(f"smollm2_windows: the documentation makes {len(ids)} tokens, "
                         f"{count} asked")  # fmt: skip
    return torch.tensor(ids[:count])


@contextmanager
def rope_scaled(model: GPT, scaling: RopeScaling | None) -> Iterator[GPT]:
    """`model` with the rotary embedding of its config with `scaling` (None: the config's own)
    in every layer, the weights untouched; its own embedding back afterwards."""
    config = (
        model.config if scaling is None else dataclasses.replace(model.config, rope_scaling=scaling)
    )
    rope = make_rope(config)
    layers = [block.self_attn for block in model.blocks]
    saved = [layer.rope for layer in layers]
    for layer in layers:
        layer.rope = rope
    try:
        yield model
    finally:
        for layer, own in zip(layers, saved, strict=True):
            layer.rope = own


def _mean_losses(model: GPT, stream: torch.Tensor, length: int) -> torch.Tensor:
    """Mean next-token loss per position over the windows of `length` tokens: (length - 1,)."""
    windows = stream[: len(stream) // length * length].view(-1, length)
    return torch.stack([window_losses(model, window) for window in windows]).mean(dim=0)


@torch.no_grad()
def window_losses(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """Next-token losses of one window ids (n,): (n - 1,), entry i that of token i + 1 given
    0 .. i, fp32; the output head sees `_HEAD_SLICE` positions at a time."""
    hidden = model(ids[None], logits_to_keep=1).last_hidden_state[0, :-1]  # (n - 1, E)
    targets = ids[1:]
    losses = []
    for start in range(0, len(hidden), _HEAD_SLICE):
        logits = model.lm_head(hidden[start : start + _HEAD_SLICE]).float()  # (slice, V)
        target = targets[start : start + _HEAD_SLICE]
        losses.append(F.cross_entropy(logits, target, reduction="none"))
    return torch.cat(losses)


def _perplexity(losses: torch.Tensor) -> float:
    return math.exp(min(float(losses.double().mean()), 700.0))


# --- the page: rows, findings, figure ----------------------------------------------------------


def smollm2_rows(series: dict[str, Any], columns: dict[str, str]) -> list[dict[str, Any]]:
    """The study's table rows of SmolLM2, one per configuration; columns: the study's column
    names for "L", "ppl@L", "ppl@2L", "past" and "ratio" (ppl@2L / ppl@L)."""
    if "missing" in series:
        return [{"model": f"{SMOLLM2}: not measured ({series['missing']})"}]
    at_context = series["perplexity_at_context"]
    return [
        {
            "model": SMOLLM2,
            "encoding": label,
            columns["L"]: series["context"],
            columns["ppl@L"]: at_context,
            columns["ppl@2L"]: value,
            columns["past"]: series["perplexity_past_context"][label],
            columns["ratio"]: value / at_context,
        }  # fmt: skip
        for label, value in series["perplexity_double"].items()
    ]


def smollm2_findings(series: dict[str, Any]) -> list[str]:
    """What SmolLM2's figures say, computed from them."""
    if "missing" in series:
        return [f"{SMOLLM2} is not measured: {series['missing']}."]
    L, past = series["context"], series["perplexity_past_context"]
    plain, at_context = past["rope"], series["perplexity_at_context"]
    scaled = {label: value for label, value in past.items() if label != "rope"}
    best = min(scaled, key=scaled.get)
    trained = "its trained context" if series["file_context"] == L else f"L = {L} (tiny size)"
    return [
        f"{SMOLLM2}, past {trained}: plain RoPE's perplexity on positions {L} to {2 * L - 1} "
        f"is {plain:.3g}, {plain / at_context:.3g}x its {at_context:.3g} within the first {L}; "
        f"with scalings at inference: "
        + ", ".join(f"{label} {value:.3g}" for label, value in scaled.items())
        + f" (best: {best}, {scaled[best] / plain:.2f}x plain RoPE's)."
    ]


def draw_smollm2(ax: Axes, series: dict[str, Any]) -> None:
    """Bars: SmolLM2's perplexity within L (plain RoPE) and past L in windows of 2L, per
    configuration (log scale)."""
    L, past = series["context"], series["perplexity_past_context"]
    labels = ["within L", *past]
    values = [series["perplexity_at_context"], *past.values()]
    ax.bar(range(len(values)), values, color=["grey", *["C0"] * len(past)])
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set(ylabel="perplexity", title=f"{SMOLLM2}: positions < {L}, then {L} to {2 * L - 1}")
    ax.grid(True, axis="y", which="both", alpha=0.3)
