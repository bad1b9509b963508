"""What the FFN ablations share: small GPTs trained on the documentation blocks over paired
seeds, as the heads study trains them (`qkv.studies.heads`: the same data, optimiser, schedule
and validation loss), and each variant's row of sizes, cost and loss.

Paired seeds: for each seed every variant reads the same batches in the same order and starts
from the same random state, so a difference between two variants on one seed is not a
difference of data order or of the draw that starts the initialisation.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

from qkv.analysis.cost.layout import layout_of
from qkv.models import GPTConfig
from qkv.studies.heads import _data, _train, _validation_loss
from qkv.studies.inputs import data_order

__all__ = ["base_config", "seed_ranges", "train_variants", "variant_row"]

logger = logging.getLogger(__name__)


def base_config(settings: dict[str, Any], vocab_size: int, **fields: Any) -> GPTConfig:
    """The study's GPT (RoPE, RMSNorm, no biases) at the settings' sizes, `fields` replaced."""
    return GPTConfig(
        vocab_size=vocab_size, embed_dim=settings["embed_dim"], num_layers=settings["num_layers"],
        num_heads=settings["num_heads"], max_positions=settings["block_size"], **fields,
    )  # fmt: skip


def train_variants(
    make_configs: Callable[[int], dict[str, GPTConfig]], settings: dict[str, Any], *, seed: int
) -> tuple[dict[str, GPTConfig], dict[str, list[float]], dict[str, int], int]:
    """Train every variant of make_configs(vocab_size) once per seed in [seed, seed +
    num_seeds); return the configs, the validation losses per variant (one per seed, in seed
    order), the parameters as built, and the vocabulary size. Where the settings hold
    train_eval_tokens, each model is also scored on the first blocks of its training data
    (that many tokens), into losses["train " + label]."""
    blocks, valid, vocab_size = _data(settings)
    seen = blocks[: settings.get("train_eval_tokens", 0) // settings["block_size"]]  # (m, L)
    configs = make_configs(vocab_size)
    losses: dict[str, list[float]] = {label: [] for label in configs}
    losses.update({f"train {label}": [] for label in configs if len(seen)})
    parameters: dict[str, int] = {}
    for run_seed in range(seed, seed + settings["num_seeds"]):
        order = data_order(len(blocks), steps=settings["train_steps"],
                           batch_size=settings["batch_size"], seed=run_seed)  # fmt: skip
        for label, config in configs.items():
            model = _train(config, "separate", blocks, order, settings, seed=run_seed)
            losses[label].append(_validation_loss(model, valid, settings["block_size"]))
            if len(seen):
                losses[f"train {label}"].append(_validation_loss(model, seen, len(seen[0])))
            parameters[label] = sum(p.numel() for p in model.parameters())
            logger.info("%s (seed %d): validation loss %.3f", label, run_seed, losses[label][-1])
    return configs, losses, parameters, vocab_size


def variant_row(
    label: str, config: GPTConfig, losses: list[float], parameters: int, block_size: int
) -> dict[str, Any]:
    """A variant's sizes, parameters, forward FLOPs per token (`qkv.analysis.cost.layout_of`
    at the training length), and validation loss: mean and range over seeds."""
    return {
        "variant": label, "ffn": config.ffn, "ffn dim": config.ffn_dim,
        "ffn dim / d_model": round(config.ffn_dim / config.embed_dim, 3),
        "parameters": parameters,
        "FLOPs per token": layout_of(config).forward_flops(block_size) // block_size,
        "validation loss": statistics.fmean(losses),
        "loss range over seeds": max(losses) - min(losses),
    }  # fmt: skip


def seed_ranges(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each variant's loss range over seeds, by its label."""
    return {row["variant"]: row["loss range over seeds"] for row in rows}
