"""Cross-layer parameter sharing: one block applied N times, against N blocks and against one.

ALBERT (Lan et al. 2020, s3.1 and Table 4) shares all parameters across a Transformer's layers:
the parameters of the blocks fall N-fold at the same compute per token, for some loss of
accuracy against the unshared model; the Universal Transformer (Dehghani et al. 2019) applies
one block recurrently in depth. The study trains the small GPT of the heads study
(`qkv.studies.heads`: the CPython documentation blocks, the same optimiser, schedule and paired
seeds) three ways: N blocks (the plain model); N layers that are one block (`share_layers`:
every entry of `model.blocks` is blocks[0], so the forward applies it N times and its
gradient sums the N uses); and one block (the shared model's parameters, 1/N of its compute).
The encoder-decoder `Transformer` of `qkv train translate` (German -> English number words) is
trained the same three ways, sharing within the encoder and within the decoder
(`share_stack_layers`), and scored by its teacher-forced validation loss and greedy exact match.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
from typing import Any

from torch import nn

from qkv.analysis.cost.layout import layout_of
from qkv.models import Transformer
from qkv.studies.ablation_training import base_config
from qkv.studies.cfg_digits import train_quietly
from qkv.studies.heads import _data, _train, _validation_loss
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult, Verdict, beyond_noise
from qkv.training.tasks.translate import TranslateOptions, TranslateTask

__all__ = [
    "CLAIM", "COLUMNS", "MODELS", "SIZES", "TITLE", "figure", "run", "share_layers",
    "share_stack_layers", "verdicts",
]  # fmt: skip

TITLE = "Cross-layer sharing: one block applied N times, against N blocks and one"
CLAIM = (
    "Sharing one block across all N layers (Lan et al. 2020, ALBERT; Dehghani et al. 2019) "
    "costs some loss against N separate blocks at the same compute, and the depth still "
    "helps: the shared model's loss is below that of one block with the same parameters; in "
    "a decoder-only GPT and in an encoder-decoder alike."
)
COLUMNS = [
    "model", "variant", "layers applied", "distinct blocks", "parameters", "FLOPs per token",
    "validation loss", "loss range over seeds", "exact match",
]  # fmt: skip
MODELS = ("GPT", "encoder-decoder")
SPREAD = "loss range over seeds"

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "block_size": 16, "embed_dim": 16, "num_layers": 2, "num_heads": 4,
        "ffn_dim": 32, "train_steps": 3, "batch_size": 4, "learning_rate": 3e-3,
        "warmup_steps": 1, "weight_decay": 0.1, "eval_tokens": 256, "validation_fraction": 0.1,
        "num_seeds": 2,
        "translate": {"num_train": 200, "num_valid": 20, "num_test": 20, "vocab_size": 48,
                      "embed_dim": 16, "num_heads": 2, "num_layers": 2, "ffn_dim": 32,
                      "dropout": 0.0, "max_length": 48},
        "translate_training": {"steps": 3, "batch_size": 8, "learning_rate": 3e-3},
        "translate_seeds": 2,
    },
    "default": {
        "vocab_size": 1024, "block_size": 64, "embed_dim": 64, "num_layers": 4, "num_heads": 4,
        "ffn_dim": 128, "train_steps": 1200, "batch_size": 16, "learning_rate": 3e-3,
        "warmup_steps": 60, "weight_decay": 0.1, "eval_tokens": 16384,
        "validation_fraction": 0.1, "num_seeds": 4,
        "translate": {"num_train": 10000, "num_valid": 500, "num_test": 500, "vocab_size": 64,
                      "embed_dim": 64, "num_heads": 4, "num_layers": 4, "ffn_dim": 256,
                      "dropout": 0.0, "max_length": 48},
        "translate_training": {"steps": 600, "batch_size": 64, "learning_rate": 2e-3,
                               "warmup_steps": 40},
        "translate_seeds": 2,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def share_layers(model: nn.Module) -> nn.Module:
    """Every entry of model.blocks (a GPT's, or a stack's) made blocks[0]: one block applied
    len(blocks) times (its parameters listed once by model.parameters(), its gradient summed
    over the uses)."""
    for index in range(1, len(model.blocks)):
        model.blocks[index] = model.blocks[0]
    return model


def share_stack_layers(model: Transformer) -> Transformer:
    """`share_layers` within the encoder and within the decoder of an encoder-decoder (each
    keeps its own block; the per-layer decoding caches stay per layer)."""
    for stack in (model.encoder, model.decoder):
        share_layers(stack)
    return model


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the three variants of each model on each seed and score them."""
    seeds = list(range(seed, seed + settings["num_seeds"]))
    gpt_rows, gpt_losses = _gpt(settings, seeds)
    pair_rows, pair_losses = _encoder_decoder(settings, seeds[: settings["translate_seeds"]])
    rows, losses = gpt_rows + pair_rows, {**gpt_losses, **pair_losses}
    return StudyResult(
        name="layer-sharing", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, losses), series={"seeds": seeds, "losses": losses},
    )  # fmt: skip


def _gpt(settings: dict[str, Any], seeds: list[int]) -> tuple[list[dict], dict]:
    """The GPT's rows and per-seed validation losses (keys "GPT: <variant>")."""
    blocks, valid, vocab_size = _data(settings)
    N = settings["num_layers"]
    deep = base_config(settings, vocab_size, ffn_dim=settings["ffn_dim"])
    variants = {  # label -> (config, prepare, layers applied, distinct blocks)
        f"{N} blocks": (deep, None, N, N),
        f"{N} layers, one shared block": (deep, share_layers, N, 1),
        "1 block": (base_config({**settings, "num_layers": 1}, vocab_size,
                                ffn_dim=settings["ffn_dim"]), None, 1, 1),
    }  # fmt: skip
    losses: dict[str, list[float]] = {label: [] for label in variants}
    parameters: dict[str, int] = {}
    for run_seed in seeds:
        order = data_order(len(blocks), steps=settings["train_steps"],
                           batch_size=settings["batch_size"], seed=run_seed)  # fmt: skip
        for label, (config, prepare, _, _) in variants.items():
            model = _train(config, "separate", blocks, order, settings, seed=run_seed,
                           prepare=prepare)  # fmt: skip
            losses[label].append(_validation_loss(model, valid, settings["block_size"]))
            parameters[label] = sum(p.numel() for p in model.parameters())
            logger.info("%s (seed %d): validation loss %.3f", label, run_seed, losses[label][-1])
    L = settings["block_size"]
    rows = [{
        "model": "GPT", "variant": label, "layers applied": applied,
        "distinct blocks": distinct, "parameters": parameters[label],
        "FLOPs per token": layout_of(config).forward_flops(L) // L,
        "validation loss": statistics.fmean(losses[label]),
        "loss range over seeds": max(losses[label]) - min(losses[label]), "exact match": None,
    } for label, (config, _, applied, distinct) in variants.items()]  # fmt: skip
    return rows, {f"GPT: {label}": values for label, values in losses.items()}


def _encoder_decoder(settings: dict[str, Any], seeds: list[int]) -> tuple[list[dict], dict]:
    """The translate task's Transformer, each variant trained by `qkv.training.train` on the
    same pairs: its rows and per-seed validation losses (keys "encoder-decoder: <variant>")."""
    options = TranslateOptions(**settings["translate"])
    task, N = TranslateTask(options), options.num_layers
    shared, one = copy.copy(task), copy.copy(task)  # the pairs and tokenizer of `task`
    shared.build_model = lambda: share_stack_layers(task.build_model())
    one.options = dataclasses.replace(options, num_layers=1)
    variants = {f"{N}+{N} blocks": (task, N, N), f"{N}+{N} layers, one shared block each":
                (shared, N, 1), "1+1 blocks": (one, 1, 1)}  # fmt: skip
    rows, losses = [], {}
    for label, (variant, applied, distinct) in variants.items():
        scores = []
        for run_seed in seeds:
            _, model, _ = train_quietly(variant, settings["translate_training"], run_seed)
            scores.append(variant.evaluate(model))
            logger.info("%s (seed %d): %s", label, run_seed, scores[-1])
        loss = [score["valid_loss"] for score in scores]
        losses[f"encoder-decoder: {label}"] = loss
        rows.append({
            "model": "encoder-decoder", "variant": label, "layers applied": applied,
            "distinct blocks": distinct, "parameters": sum(p.numel() for p in model.parameters()),
            "FLOPs per token": None, "validation loss": statistics.fmean(loss),
            "loss range over seeds": max(loss) - min(loss),
            "exact match": statistics.fmean(score["valid_exact_match"] for score in scores),
        })  # fmt: skip
    return rows, losses


def _findings(rows: list[dict[str, Any]], losses: dict[str, list[float]]) -> list[str]:
    findings = []
    for model in MODELS:
        deep, shared, one = [row for row in rows if row["model"] == model]
        pairs = zip(losses[f"{model}: {shared['variant']}"], losses[f"{model}: {one['variant']}"],
                    strict=True)  # fmt: skip
        findings.append(
            f"{model}, validation loss (range over seeds in brackets): " + ", ".join(
                f"{row['variant']} {row['validation loss']:.3f} ({row[SPREAD]:.3f}, "
                f"{row['parameters']:,} parameters)" for row in rows if row["model"] == model)
            + f". Shared - separate: {shared['validation loss'] - deep['validation loss']:+.3f}; "
            f"shared - one block: {shared['validation loss'] - one['validation loss']:+.3f}, seed "
            "by seed " + ", ".join(f"{s - o:+.3f}" for s, o in pairs) + "."
        )  # fmt: skip
    pair = [row for row in rows if row["model"] == "encoder-decoder"]
    findings.append("Encoder-decoder greedy exact match on the validation pairs: " + ", ".join(
        f"{row['variant']} {row['exact match']:.1%}" for row in pair) + ".")  # fmt: skip
    return findings


WHY = (
    "4-layer decoders of width 64 trained 1200 steps on the CPython documentation (about 8 "
    "passes over its 147k training tokens) over 4 seeds, and 4+4-layer encoder-decoders of "
    "width 64 trained 600 steps on 10,000 number pairs over 2 seeds, where ALBERT pre-trains "
    "12- and 24-layer models for 125k steps on 3.3 billion words: on data this small, seen this "
    "often, fewer parameters may generalise better, and the gaps are of the order of the seed "
    "ranges."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Both parts of CLAIM for each model, from the means and ranges over seeds."""
    rule = ("Supported if the difference exceeds the larger of the two loss ranges over seeds, "
            "not supported if it is below minus that range, mixed otherwise.")  # fmt: skip
    found = []
    for model in MODELS:
        deep, shared, one = [row for row in rows if row["model"] == model]
        noise_deep = max(deep[SPREAD], shared[SPREAD])
        noise_one = max(one[SPREAD], shared[SPREAD])
        cost = shared["validation loss"] - deep["validation loss"]
        depth = one["validation loss"] - shared["validation loss"]
        parts = (("sharing costs loss against separate blocks", "shared - separate", cost,
                  noise_deep),
                 ("the shared depth beats one block of the same parameters",
                  "one block - shared", depth, noise_one))  # fmt: skip
        for claim, difference, gap, noise in parts:
            verdict = beyond_noise(gap, noise)
            found.append(Verdict(f"{model}: {claim}", verdict, f"{difference}; {rule}",
                                 f"{gap:+.3f} (range {noise:.3f})",
                                 "" if verdict == "supported" else WHY))  # fmt: skip
    return found


def figure(result: StudyResult):
    """Validation loss per variant against its parameters, a panel per model: a point per seed
    and the mean."""
    from matplotlib.figure import Figure

    losses = result.series["losses"]
    fig = Figure(figsize=(12, 4.5))
    for ax, model in zip(fig.subplots(1, 2), MODELS, strict=True):
        for row in (row for row in result.rows if row["model"] == model):
            values = losses[f"{model}: {row['variant']}"]
            ax.plot([row["parameters"]] * len(values), values, "o", alpha=0.5)
            ax.plot([row["parameters"]], [row["validation loss"]], "s", markersize=9,
                    label=f"{row['variant']} (mean)")  # fmt: skip
        ax.set_xscale("log")
        ax.set(xlabel="parameters", ylabel="validation loss", title=model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig
