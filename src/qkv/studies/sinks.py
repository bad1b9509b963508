"""Attention sinks, measured: where trained heads put their attention, and what a cache that
keeps the first tokens buys past the training length (Xiao et al. 2024, "Efficient Streaming
Language Models with Attention Sinks").

Xiao et al. observe that trained language models put a large share of every query's attention
on the first few tokens whatever they say (a softmax must put its mass somewhere, and the first
tokens are visible to every query), and that a window cache that evicts them breaks the model
as soon as they leave, while keeping 4 of them beside the window ("sinks + window", StreamingLLM)
stays close to recomputing each token over its window (their Figure 3). For BERT, Clark et al.
2019 ("What Does BERT Look At?") found heads that attend heavily to [CLS] and [SEP].

Two measurements:

1. Attention mass on the first k tokens (k = 1 and 4), per layer and head, from the exact
   weights `record_attention` reads whatever the backend: the real all-MiniLM-L6-v2 (a 6-layer
   BERT, bidirectional: every query sees all L keys, uniform mass k / L) on documentation texts
   cut to a fixed number of tokens, with the mass on the final [SEP] beside it; and a small GPT
   (RoPE) trained here on the same texts, for the queries at positions i >= first_query (a
   causal query sees i + 1 keys, uniform mass k / (i + 1): early queries are excluded, for
   which any head puts much of its mass on token 0).
2. The GPT, trained on sequences of L tokens, reads held-out streams many times longer, each
   token's next-token loss computed under four cache policies: dense, window, sinks and
   recompute (described in `qkv.studies.sinks_caches`).

Both are also made on a real LLM, SmolLM2-135M-Instruct (Allal et al. 2025), on real English
text (`qkv.studies.sinks_real`): where the small GPT forms no sinks, which disagrees with Xiao
et al. 2024, the page says so and gives SmolLM2's figure beside it.
"""

from __future__ import annotations

import logging
import math
import tempfile
from typing import Any

import torch
from torch import nn

from qkv.analysis.inspection.sinks import attention_masses, uniform_mass
from qkv.data import minilm_wordpiece, pydoc_texts
from qkv.models.bert import BertModel
from qkv.models.checkpoints.bundled import default_model_path
from qkv.studies import sinks_real
from qkv.studies.record import StudyResult, Verdict, grade
from qkv.studies.sinks_caches import (
    POLICIES,
    POLICY_NAMES,
    cached_losses,
    dense_losses,
    recomputed_losses,
    stream_losses,
    validation_streams,
)
from qkv.studies.sinks_real import FIRST_KS, SMOLLM2_SIZES
from qkv.training import TrainingConfig, train
from qkv.training.tasks.gpt import GPTOptions, GPTTask

__all__ = [
    "CLAIM",
    "SIZES",
    "TITLE",
    "cached_losses",
    "dense_losses",
    "figure",
    "recomputed_losses",
    "run",
    "verdicts",
]

logger = logging.getLogger(__name__)

TITLE = "Attention sinks: mass on the first tokens, and caches past the training length"
CLAIM = (
    "Trained attention heads put far more than a uniform share of their attention on the first "
    "tokens (Xiao et al. 2024; for BERT's [CLS] and [SEP], Clark et al. 2019), and a cache that "
    "keeps a few of them beside a window of recent tokens stays close to recomputing each token "
    "over its window, where a window-only cache does not (Xiao et al. 2024, Figure 3)."
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "train_length": 16, "embed_dim": 32, "num_layers": 2, "num_heads": 2,
        "ffn_dim": 64, "train_steps": 10, "batch_size": 8, "learning_rate": 2e-3,
        "mass_blocks": 4, "first_query": 4, "stream_length": 64, "num_streams": 1,
        "window": 16, "num_sinks": 4, "loss_bin": 8, "minilm_texts": 1, "minilm_length": 16,
        **SMOLLM2_SIZES["tiny"],
    },
    "default": {
        "vocab_size": 1000, "train_length": 64, "embed_dim": 128, "num_layers": 4,
        "num_heads": 4, "ffn_dim": 384, "train_steps": 600, "batch_size": 16,
        "learning_rate": 2e-3, "mass_blocks": 64, "first_query": 16, "stream_length": 1024,
        "num_streams": 4, "window": 64, "num_sinks": 4, "loss_bin": 16, "minilm_texts": 8,
        "minilm_length": 128, **SMOLLM2_SIZES["default"],
    },
}  # fmt: skip


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Both measurements at `settings` (see SIZES) on MiniLM, the GPT and SmolLM2; seed: the
    data split, initialisation and data order of the GPT."""
    if settings["window"] <= settings["num_sinks"]:
        raise ValueError(
            f"window: expected more than num_sinks={settings['num_sinks']} (sinks + window "
            f"keeps num_sinks + (window - num_sinks) tokens), got {settings['window']}"
        )
    sinks_real.check_smollm2_settings(settings)  # before the training, not after it
    minilm = measure_minilm(settings)
    task, model, metrics = train_gpt(settings, seed=seed)
    gpt = measure_gpt(task, model, settings)
    streams = validation_streams(task, settings)
    losses = stream_losses(model, streams, window=settings["window"],
                           num_sinks=settings["num_sinks"])  # fmt: skip
    smollm2 = sinks_real.measure_smollm2(settings)
    return _result(settings, (minilm, gpt, smollm2), losses, metrics, task.unigram_entropy)


# --- 1. attention mass on the first tokens -----------------------------------------------------


def measure_minilm(settings: dict[str, Any]) -> dict[str, Any]:
    """Masses of all-MiniLM-L6-v2 on `minilm_texts` documentation texts of `minilm_length`
    tokens each: [CLS] ... [SEP], every query counted."""
    length, count = settings["minilm_length"], settings["minilm_texts"]
    logger.info("MiniLM: attention on the first tokens of %d texts of %d tokens", count, length)
    tokenizer = minilm_wordpiece()
    tokenizer.enable_truncation(max_length=length)
    encodings = [tokenizer.encode(text) for text in pydoc_texts()]
    full = [e.ids for e in encodings if len(e.ids) == length]  # truncated: no padding needed
    if len(full) < count:
        raise ValueError(f"minilm_texts: only {len(full)} texts reach {length} tokens, got {count}")
    chosen = [full[i * len(full) // count] for i in range(count)]  # spread over the topics
    model = BertModel.from_pretrained(default_model_path()).eval()
    keys = {f"first_{k}": list(range(k)) for k in FIRST_KS} | {"sep": [-1]}
    masses = attention_masses(model, torch.tensor(chosen), keys)
    masses = {name: value.tolist() for name, value in masses.items()}
    uniform = {f"first_{k}": uniform_mass(k, length, causal=False) for k in FIRST_KS}
    return {"masses": masses, "uniform": uniform | {"sep": 1 / length}}


def train_gpt(settings: dict[str, Any], *, seed: int) -> tuple[GPTTask, nn.Module, dict]:
    """The gpt task's data (byte-level BPE, blocks of train_length tokens) and a RoPE GPT
    trained on it (`qkv.training.train`), in eval mode, with its last evaluation."""
    options = GPTOptions(
        family="llama", vocab_size=settings["vocab_size"], block_size=settings["train_length"],
        embed_dim=settings["embed_dim"], num_layers=settings["num_layers"],
        num_heads=settings["num_heads"], ffn_dim=settings["ffn_dim"], dropout=0.0,
        data_seed=seed,
    )  # fmt: skip
    task = GPTTask(options)
    config = TrainingConfig(
        steps=settings["train_steps"], batch_size=settings["batch_size"],
        learning_rate=settings["learning_rate"], checkpoint_every=0, log_every=0, seed=seed,
        schedule="cosine",
    )  # fmt: skip
    logger.info("training a %d-layer GPT for %d steps on blocks of %d tokens",
                options.num_layers, config.steps, options.block_size)  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:  # the checkpoint is not kept
        result = train(task, config, out_dir=folder)
    return task, result.model.eval(), result.metrics


def measure_gpt(task: GPTTask, model: nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """Masses of the trained GPT on `mass_blocks` validation blocks (queries >= first_query)."""
    blocks = task.valid_blocks.blocks[: settings["mass_blocks"]]  # (B, L)
    first_query, length = settings["first_query"], blocks.shape[1]
    logger.info("GPT: attention on the first tokens of %d validation blocks", len(blocks))
    keys = {f"first_{k}": list(range(k)) for k in FIRST_KS}
    masses = attention_masses(model, blocks, keys, first_query=first_query)
    uniform = {
        f"first_{k}": uniform_mass(k, length, first_query=first_query, causal=True)
        for k in FIRST_KS
    }
    return {"masses": {name: value.tolist() for name, value in masses.items()}, "uniform": uniform}


# --- the result --------------------------------------------------------------------------------


def _result(settings, measured, losses, metrics, unigram_entropy) -> StudyResult:
    """The table, series and findings; measured: (MiniLM's, the GPT's, SmolLM2's)."""
    minilm, gpt, smollm2 = measured
    window, bin_size = settings["window"], settings["loss_bin"]
    past = {name: _perplexity(value[:, window - 1 :]) for name, value in losses.items()}
    binned = {name: _binned(value.mean(dim=0), bin_size) for name, value in losses.items()}
    first_query = settings["first_query"]
    rows = _mass_rows("MiniLM", minilm, "all queries")
    rows += _mass_rows("GPT", gpt, f"queries at positions >= {first_query}")
    for name in POLICIES:
        rows.append({
            "measurement": f"GPT perplexity past token {window}, {POLICY_NAMES[name]} (max: "
            f"worst {bin_size} tokens; baseline: unigram)",
            "mean": past[name],
            "max": math.exp(max(binned[name][window // bin_size :], default=float("nan"))),
            "baseline": math.exp(unigram_entropy),
        })  # fmt: skip
    rows += sinks_real.smollm2_rows(smollm2)
    series = {
        "minilm": minilm, "gpt": gpt, "train_length": settings["train_length"],
        "window": window, "num_sinks": settings["num_sinks"], "loss_bin": bin_size,
        "loss_positions": [i * bin_size for i in range(len(binned["dense"]))],
        "loss": binned, "perplexity_past_window": past,
        "valid_perplexity": metrics.get("valid_perplexity"),
        "unigram_perplexity": math.exp(unigram_entropy), "smollm2": smollm2,
    }  # fmt: skip
    return StudyResult(
        name="sinks", title=TITLE, claim=CLAIM,
        columns=["measurement", "mean", "max", "baseline"], rows=rows,
        findings=_findings(series, settings), series=series,
    )  # fmt: skip


def _mass_rows(model: str, measured: dict[str, Any], where: str) -> list[dict[str, Any]]:
    labels = {"first_1": "token 0", "first_4": "tokens 0-3", "sep": "the final [SEP]"}
    if model == "MiniLM":
        labels["first_1"] = "token 0 ([CLS])"
    rows = []
    for name, value in measured["masses"].items():
        heads = torch.tensor(value)
        rows.append({
            "measurement": f"{model} attention mass on {labels[name]}, {where} (over heads; "
            "baseline: uniform)",
            "mean": float(heads.mean()), "max": float(heads.max()),
            "baseline": measured["uniform"][name],
        })  # fmt: skip
    return rows


def _perplexity(losses: torch.Tensor) -> float:
    return math.exp(min(float(losses.mean()), 700.0)) if losses.numel() else float("nan")


def _binned(losses: torch.Tensor, bin_size: int) -> list[float]:
    """Mean loss over consecutive bins of bin_size positions (the last one may be shorter)."""
    return [
        round(float(losses[i : i + bin_size].mean()), 4) for i in range(0, len(losses), bin_size)
    ]


def _findings(series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    smollm2 = sinks_real.smollm2_findings(series["smollm2"])
    return [*_mass_findings(series), _cache_finding(series, settings), *smollm2]


def _has_sink(gpt: dict[str, Any]) -> bool:
    """Whether some head of the GPT puts more than twice the uniform share on token 0."""
    return max(map(max, gpt["masses"]["first_1"])) > 2 * gpt["uniform"]["first_1"]


def _mass_findings(series: dict[str, Any]) -> list[str]:
    findings = []
    for label, key in (("all-MiniLM-L6-v2", "minilm"), ("The trained GPT", "gpt")):
        measured = series[key]
        heads = torch.tensor(measured["masses"]["first_1"])  # (layers, H)
        uniform = measured["uniform"]["first_1"]
        ratio = float(heads.mean()) / uniform
        half = int((heads > 0.5).sum())
        findings.append(
            f"{label} puts {heads.mean():.2f} of its attention on the first token on average "
            f"over its {heads.numel()} heads, {ratio:.1f} times the uniform {uniform:.3f}; "
            f"{half} heads put more than half of it there (most: {heads.max():.2f})."
        )
    if not _has_sink(series["gpt"]):  # the small model's result against the paper's
        findings[-1] += (
            " The GPT forms no attention sink: this disagrees with Xiao et al. 2024, who find "
            f"sinks in every LLM they measure; {sinks_real.sink_figure(series['smollm2'])}."
        )
    sep = torch.tensor(series["minilm"]["masses"]["sep"])  # (layers, H)
    by_layer = sep.mean(dim=1)
    findings.append(
        f"MiniLM's final [SEP] gets {sep.mean():.2f} on average (uniform "
        f"{series['minilm']['uniform']['sep']:.3f}), most in layer {int(by_layer.argmax())} "
        f"({by_layer.max():.2f} over its heads)."
    )
    return findings


def _cache_finding(series: dict[str, Any], settings: dict[str, Any]) -> str:
    past = series["perplexity_past_window"]
    window, sinks = settings["window"], settings["num_sinks"]
    text = (
        f"Trained on {settings['train_length']}-token blocks (validation perplexity "
        f"{series['valid_perplexity']:.1f}), the GPT reads {settings['stream_length']}-token "
        f"streams; past token {window}, perplexity is {past['dense']:.1f} dense (RoPE "
        f"positions past the training length), {past['window']:.1f} window only, "
        f"{past['sinks']:.1f} with {sinks} sinks + window, {past['recompute']:.1f} recomputed"
    )
    gain = past["window"] / past["sinks"]
    if gain > 1.05:
        return f"{text}: keeping {sinks} sinks divides the window-only perplexity by {gain:.2f}."
    if _has_sink(series["gpt"]):
        text += ": despite heads that favour token 0, evicting it costs little here"
    else:
        text += (": with no head favouring token 0 there is no sink to evict, and window only "
                 f"does as well as sinks + window (ratio {gain:.2f})")  # fmt: skip
    return (
        f"{text}. This disagrees with Xiao et al. 2024 (Figure 3), where evicting the first "
        f"tokens breaks the model: {sinks_real.cache_figure(series['smollm2'])}."
    )


def figure(result: StudyResult):
    """Heat maps (layer x head) of the mass on the first token, MiniLM and the GPT, and the
    loss of each cache policy against the position in the stream; below them, SmolLM2's."""
    from matplotlib.figure import Figure

    series = result.series
    real = "masses" in series.get("smollm2", {})  # measured: the package is installed
    fig = Figure(figsize=(15, 9.6 if real else 4.2))
    grid = fig.add_gridspec(2 if real else 1, 3, width_ratios=[1.4, 0.8, 1.6])
    axes = [fig.add_subplot(grid[0, column]) for column in range(3)]
    for ax, key, name in ((axes[0], "minilm", "all-MiniLM-L6-v2"), (axes[1], "gpt", "GPT")):
        masses = series[key]["masses"]["first_1"]
        image = ax.imshow(masses, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        uniform = series[key]["uniform"]["first_1"]
        ax.set(
            xlabel="head", ylabel="layer", title=f"{name}: mass on token 0 (uniform {uniform:.3f})"
        )
        ax.set_xticks(range(len(masses[0])))
        ax.set_yticks(range(len(masses)))
        fig.colorbar(image, ax=ax, fraction=0.05)
    ax = axes[2]
    positions = series["loss_positions"]
    for name, values in series["loss"].items():
        ax.plot(positions, values, label=POLICY_NAMES.get(name, name), drawstyle="steps-post")
    ax.axvline(series["train_length"], color="gray", linestyle="--", label="training length")
    ax.set(xlabel="position in the stream", ylabel=f"loss (mean over {series['loss_bin']} tokens)",
           title="next-token loss by cache policy")  # fmt: skip
    ax.legend(fontsize=8)
    if real:
        sinks_real.draw_smollm2(
            fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1:]), series["smollm2"],
            lambda image, ax: fig.colorbar(image, ax=ax, fraction=0.05),
        )  # fmt: skip
    fig.tight_layout()
    return fig


FAR_MORE = 5.0  # "far more than a uniform share": at least 5 times it
CLOSE = 1.1  # "stays close to recomputing": at most 1.1 times its perplexity
WHY = (
    "the GPT trained here has 4 layers of width 128 and trains 600 steps on 64-token blocks, "
    "where Xiao et al. 2024 measure LLMs of 7B parameters and more trained on trillions of "
    "tokens: it forms no sink, so evicting the first tokens costs it nothing; MiniLM and "
    "SmolLM2 behave as the paper finds."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table: the rows of attention mass on token 0 (mean over
    heads against the uniform share) and of perplexity per cache (mean)."""
    mass = {row["measurement"].split()[0]: row["mean"] / row["baseline"] for row in rows
            if " attention mass on token 0" in row["measurement"]}  # fmt: skip
    sinks = [name for name, ratio in mass.items() if ratio >= FAR_MORE]
    found = [Verdict(
        "trained heads put far more than a uniform share on the first token",
        grade(len(sinks), len(mass)),
        f"Supported if every model's mean attention on token 0 is at least {FAR_MORE:g}x the "
        "uniform share, mixed if some models' is.",
        ", ".join(f"{name} {ratio:.1f}x" for name, ratio in mass.items()), WHY)]  # fmt: skip
    caches: dict[str, dict[str, float]] = {}
    for row in rows:
        if " perplexity past token " in row["measurement"]:
            kind = row["measurement"].split(", ", 1)[1].split(" (")[0]
            caches.setdefault(row["measurement"].split()[0], {})[kind] = row["mean"]
    ratios = {name: (ppl["sinks + window"] / ppl["window, recomputed"],
                     ppl["window only"] / ppl["window, recomputed"])
              for name, ppl in caches.items()}  # fmt: skip
    held = [name for name, (kept, evicted) in ratios.items() if kept <= CLOSE < evicted]
    found.append(Verdict(
        "sinks + window stay close to recomputing, a window alone does not",
        grade(len(held), len(ratios)),
        f"Supported if, for every model, sinks + window end within {CLOSE}x the recomputed "
        f"perplexity and window only above {CLOSE}x it, mixed if for some.",
        ", ".join(f"{name}: sinks + window {kept:.2f}x, window only {evicted:.2f}x"
                  for name, (kept, evicted) in ratios.items()), WHY))  # fmt: skip
    return found
