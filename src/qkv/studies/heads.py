"""Heads and K/V sharing: validation loss against KV-cache bytes (MHA, GQA, MQA), against the
number of heads at a fixed width, and with shared or separate Q/K/V projections.

Every model is a small `qkv.models.GPT` (RoPE, RMSNorm, SwiGLU) trained on byte-level BPE
blocks of the documentation CPython ships (`qkv.data.pydoc_texts`), with the same steps, the
same data order and the same initial draws per seed, and scored on the held-out documents by
its mean next-token loss. Three comparisons:

1. K/V heads at a fixed width E and H query heads: H_kv = H (MHA; Vaswani et al. 2017), GQA
   groups (Ainslie et al. 2023) and H_kv = 1 (MQA; Shazeer 2019). The KV cache of one token is
   2 (K and V) * layers * H_kv * D * bytes (`qkv.analysis.cost.kv_cache_bytes_per_sample` at a
   context of one token). Fewer K/V heads also mean fewer parameters (k_proj and v_proj are
   E x H_kv * D); as Shazeer and Ainslie et al. do, the FFN is widened to give them back:
   SwiGLU has three E x ffn_dim matrices, so ffn_dim grows by round(2 (H - H_kv) D / 3). The
   table reports the parameters and forward FLOPs per token (`qkv.analysis.cost.layout_of`)
   that result, so what is left of the difference is on show.
2. Heads at a fixed width (Vaswani et al. 2017, Table 3 rows (A); Michel et al. 2019): H in
   `head_counts` with D = E / H; parameters, FLOPs and KV-cache bytes do not depend on H.
3. Shared vs separate projections, at H query and K/V heads: "shared q/k/v" is the model whose
   k_proj and v_proj are its q_proj (one E x E matrix per layer computes queries, keys and
   values: the same `MultiHeadAttention`, its submodules tied); "shared q/k" ties k_proj to
   q_proj only, as the Reformer does (Kitaev et al. 2020, s2). Their parameters are reported
   as they are, not given back.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from qkv import inspect
from qkv.analysis.cost.estimate import kv_cache_bytes_per_sample
from qkv.analysis.cost.layout import layout_of
from qkv.models import GPT, GPTConfig
from qkv.studies.inputs import data_order, documentation_lm
from qkv.studies.record import StudyResult, Verdict, grade
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler
from qkv.validation import check_choice

__all__ = ["CLAIM", "SHARINGS", "SIZES", "TITLE", "figure", "run", "share_projections", "verdicts"]

TITLE = "Heads and K/V sharing: loss against KV-cache bytes, head count and shared projections"
CLAIM = (
    "At equal parameters and compute, grouped-query attention (Ainslie et al. 2023) keeps "
    "close to multi-head attention's quality with a fraction of its KV cache, multi-query "
    "attention (Shazeer 2019) gives up a little more; at a fixed width, a single head or very "
    "small heads do worse than a few heads of moderate size (Vaswani et al. 2017, Table 3 (A); "
    "Michel et al. 2019); and one projection shared by queries, keys and values costs quality."
)
SHARINGS = ("separate", "shared q/k", "shared q/k/v")
COLUMNS = [
    "part", "variant", "H", "H_kv", "head dim", "ffn dim", "parameters", "FLOPs per token",
    "KV-cache bytes per token", "validation loss", "loss range over seeds",
]  # fmt: skip

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "block_size": 16, "embed_dim": 16, "num_layers": 1, "num_heads": 4,
        "kv_heads": [4, 2, 1], "head_counts": [1, 4], "ffn_dim": 32, "train_steps": 3,
        "batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 1, "weight_decay": 0.1,
        "eval_tokens": 256, "validation_fraction": 0.1, "kv_bytes_per_element": 2, "num_seeds": 1,
    },
    "default": {
        "vocab_size": 1024, "block_size": 64, "embed_dim": 64, "num_layers": 2, "num_heads": 8,
        "kv_heads": [8, 4, 2, 1], "head_counts": [1, 2, 4, 8, 16], "ffn_dim": 160,
        "train_steps": 600, "batch_size": 16, "learning_rate": 3e-3, "warmup_steps": 30,
        "weight_decay": 0.1, "eval_tokens": 16384, "validation_fraction": 0.1,
        "kv_bytes_per_element": 2, "num_seeds": 2,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train every variant of the three comparisons once per seed; score each on validation."""
    blocks, valid, vocab_size = _data(settings)
    base = GPTConfig(
        vocab_size=vocab_size, embed_dim=settings["embed_dim"], num_layers=settings["num_layers"],
        num_heads=settings["num_heads"], ffn_dim=settings["ffn_dim"],
        max_positions=settings["block_size"],
    )  # fmt: skip
    variants = _variants(base, settings)
    losses: dict[str, list[float]] = {}
    parameters: dict[str, int] = {}  # counted on the built model: tied projections once
    for run_seed in range(seed, seed + settings["num_seeds"]):
        order = data_order(
            len(blocks),
            steps=settings["train_steps"],
            batch_size=settings["batch_size"],
            seed=run_seed,
        )  # all variants
        trained: dict[tuple, tuple[float, int]] = {}  # a model in two comparisons: trained once
        for variant in variants:
            key = (variant["config"], variant["sharing"])
            if key not in trained:
                model = _train(variant["config"], variant["sharing"], blocks, order, settings,
                               seed=run_seed)  # fmt: skip
                loss = _validation_loss(model, valid, settings["block_size"])
                trained[key] = loss, sum(p.numel() for p in model.parameters())
                logger.info("%s (seed %d): validation loss %.3f", variant["label"], run_seed,
                            loss)  # fmt: skip
            losses.setdefault(variant["label"], []).append(trained[key][0])
            parameters[variant["label"]] = trained[key][1]
    rows = [
        _row(variant, losses[variant["label"]], parameters[variant["label"]], settings)
        for variant in variants
    ]
    series = {"rows": rows, "losses": losses, "vocab_size": vocab_size}
    return StudyResult(
        name="heads", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, settings), series=series,
    )  # fmt: skip


def _variants(base: GPTConfig, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Every model of the three comparisons: {part, label, config, sharing}."""
    H, D = base.num_heads, base.head_dim
    variants = []
    for H_kv in settings["kv_heads"]:
        widened = base.ffn_dim + round(2 * (H - H_kv) * D / 3)  # k_proj, v_proj given back
        config = dataclasses.replace(base, num_kv_heads=H_kv, ffn_dim=widened)
        name = "MHA" if H_kv == H else "MQA" if H_kv == 1 else f"GQA-{H_kv}"
        variants.append({"part": "K/V heads", "label": name, "config": config,
                         "sharing": "separate"})  # fmt: skip
    for heads in settings["head_counts"]:
        config = dataclasses.replace(base, num_heads=heads, num_kv_heads=heads)
        variants.append({"part": "heads at fixed width", "label": f"H={heads}",
                         "config": config, "sharing": "separate"})  # fmt: skip
    for sharing in SHARINGS:
        variants.append({"part": "projections", "label": sharing, "config": base,
                         "sharing": sharing})  # fmt: skip
    return variants


def share_projections(model: GPT, sharing: str) -> GPT:
    """Tie the attention projections of every block: "shared q/k" makes k_proj the q_proj
    module, "shared q/k/v" makes both k_proj and v_proj the q_proj module (needs H_kv = H);
    "separate" leaves the model as it is. The parameters of the dropped projections are gone
    (`model.parameters()` lists each tied one once)."""
    check_choice("sharing", sharing, SHARINGS)
    if sharing != "separate" and model.config.num_kv_heads != model.config.num_heads:
        raise ValueError(
            f"sharing: {sharing!r} needs as many K/V heads as query heads, got num_kv_heads="
            f"{model.config.num_kv_heads} and num_heads={model.config.num_heads}"
        )
    for block in model.blocks:
        attention = block.self_attn
        if sharing in ("shared q/k", "shared q/k/v"):
            attention.k_proj = attention.q_proj
        if sharing == "shared q/k/v":
            attention.v_proj = attention.q_proj
    return model


def _data(settings: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Training blocks (N, L), validation blocks (M, L) of at most eval_tokens tokens, and the
    vocabulary size of the byte-level BPE trained on the training documents."""
    L = settings["block_size"]
    data = documentation_lm(vocab_size=settings["vocab_size"], block_size=L,
                            validation_fraction=settings["validation_fraction"])  # fmt: skip
    blocks, stream = data.blocks, data.valid_stream  # (N, L), (T,)
    kept = min(len(stream), settings["eval_tokens"]) // L * L
    if kept == 0:
        raise ValueError(
            f"eval_tokens: {settings['eval_tokens']} (of {len(stream)} validation tokens) hold "
            f"no block of {L}; expected at least block_size"
        )
    return blocks, stream[:kept].view(-1, L), data.vocab_size


def _train(
    config: GPTConfig, sharing: str, blocks: torch.Tensor, order: torch.Tensor,
    settings: dict[str, Any], *, seed: int,
    prepare: Callable[[GPT], GPT] | None = None,
    hook_fns: dict[str, Callable] | None = None,
) -> GPT:  # fmt: skip
    """AdamW with linear warm-up and cosine decay, gradients clipped at norm 1, on
    blocks[order[step]]; the model in eval mode. prepare(model) changes the initialised model
    before training; hook_fns (`qkv.inspect.hooks`) act on its activations in training."""
    torch.manual_seed(seed)  # the same initial draws for every variant
    model = share_projections(GPT(config), sharing)
    if prepare is not None:
        model = prepare(model)
    optimizer = build_optimizer(
        model, learning_rate=settings["learning_rate"], weight_decay=settings["weight_decay"]
    )
    scheduler = build_scheduler(
        optimizer, warmup_steps=settings["warmup_steps"], total_steps=len(order), kind="cosine"
    )
    model.train()
    with inspect.hooks(model, hook_fns) if hook_fns else nullcontext():  # once, for every step
        for indices in order:
            batch = blocks[indices]  # (B, L)
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
    return model.eval()


@torch.no_grad()
def _validation_loss(model: GPT, blocks: torch.Tensor, block_size: int) -> float:
    """Mean next-token loss over every prediction of the validation blocks (M, L)."""
    total = 0.0
    for batch in blocks.split(max(1, 8192 // block_size)):  # (b, L)
        total += float(model(batch, labels=batch).loss) * len(batch)  # equal counts per block
    return total / len(blocks)


def _row(variant: dict[str, Any], losses: list[float], parameters: int, settings: dict) -> dict:
    """The table row of a variant: its sizes, FLOPs per token and KV-cache bytes per token from
    its config, its parameters as built, its validation loss (mean and range over seeds)."""
    config = variant["config"]
    L = settings["block_size"]
    kv_bytes = kv_cache_bytes_per_sample(
        context=1, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, bytes_per_element=settings["kv_bytes_per_element"],
    )  # fmt: skip
    return {
        "part": variant["part"], "variant": variant["label"], "H": config.num_heads,
        "H_kv": config.num_kv_heads, "head dim": config.head_dim, "ffn dim": config.ffn_dim,
        "parameters": parameters, "FLOPs per token": layout_of(config).forward_flops(L) // L,
        "KV-cache bytes per token": kv_bytes, "validation loss": statistics.fmean(losses),
        "loss range over seeds": max(losses) - min(losses),
    }  # fmt: skip


def _findings(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the table: loss against KV bytes, against heads, with sharing, and
    how the differences compare with the spread over seeds."""
    parts: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        parts.setdefault(row["part"], []).append(row)
    kv, heads, sharing = parts["K/V heads"], parts["heads at fixed width"], parts["projections"]
    mha, mqa = kv[0], kv[-1]
    bytes_key, loss_key = "KV-cache bytes per token", "validation loss"
    drift = max(abs(row["parameters"] / mha["parameters"] - 1) for row in kv)
    findings = [
        f"KV-cache bytes per token ({settings['kv_bytes_per_element']}-byte elements): "
        + ", ".join(f"{r['variant']} {r[bytes_key]:,}" for r in kv)
        + "; validation loss: "
        + ", ".join(f"{r['variant']} {r[loss_key]:.3f}" for r in kv)
        + f". {mqa['variant']} caches {mha[bytes_key] / mqa[bytes_key]:.0f}x less than MHA at "
        f"{mqa[loss_key] - mha[loss_key]:+.3f} loss; with the FFN widened, parameters stay "
        f"within {drift:.2%} of MHA's."
    ]
    best = min(heads, key=lambda r: r["validation loss"])
    worst = max(heads, key=lambda r: r["validation loss"])
    findings.append(
        f"At width {settings['embed_dim']}, validation loss by head count: "
        + ", ".join(f"H={r['H']} (D={r['head dim']}) {r['validation loss']:.3f}" for r in heads)
        + f"; best {best['variant']}, worst {worst['variant']} "
        f"({worst['validation loss'] - best['validation loss']:+.3f})."
    )
    separate = sharing[0]
    findings.append(
        "Projections: " + ", ".join(
            f"{r['variant']} {r['validation loss']:.3f} ({r['parameters']:,} parameters)"
            for r in sharing
        ) + f"; sharing all three changes the loss by "
        f"{sharing[-1]['validation loss'] - separate['validation loss']:+.3f}."
    )  # fmt: skip
    if settings["num_seeds"] > 1:
        spread = max(row["loss range over seeds"] for row in rows)
        gap = max(r["validation loss"] for r in kv) - min(r["validation loss"] for r in kv)
        findings.append(
            f"Over {settings['num_seeds']} seeds a variant's loss varies by up to {spread:.3f}; "
            f"the K/V-head variants lie within {gap:.3f} of each other."
        )
    return findings


def figure(result: StudyResult):
    """Two panels: validation loss against KV-cache bytes per token (MHA, GQA, MQA, and the
    shared projections, whose cache is MHA's), and against the number of heads at a fixed
    width; bars: the range over seeds."""
    from matplotlib.figure import Figure

    rows = result.series["rows"]
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    for part, marker in (("K/V heads", "o"), ("projections", "s")):  # "separate" is MHA
        chosen = [row for row in rows if row["part"] == part and row["variant"] != "separate"]
        _points(left, chosen, "KV-cache bytes per token", marker, part)
    left.set_xscale("log", base=2)
    left.set(xlabel="KV-cache bytes per token", ylabel="validation loss",
             title="Quality against KV-cache size")  # fmt: skip
    heads = [row for row in rows if row["part"] == "heads at fixed width"]
    _points(right, heads, "H", "o", "heads at fixed width")
    right.plot([row["H"] for row in heads], [row["validation loss"] for row in heads], alpha=0.5)
    right.set_xscale("log", base=2)
    right.set(xlabel="query heads H (head dim = width / H)", ylabel="validation loss",
              title=f"Heads at width {result.settings['embed_dim']}")  # fmt: skip
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig


def _points(ax, rows: list[dict[str, Any]], x_key: str, marker: str, label: str) -> None:
    xs = [row[x_key] for row in rows]
    ys = [row["validation loss"] for row in rows]
    errors = [row["loss range over seeds"] / 2 for row in rows]
    ax.errorbar(xs, ys, yerr=errors, fmt=marker, capsize=3, label=label)
    for x, y, row in zip(xs, ys, rows, strict=True):
        ax.annotate(row["variant"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)


WHY = (
    "the models here are 2-layer decoders of width 64 trained 600 steps over 2 seeds, where "
    "Ainslie et al. 2023 uptrain T5-XXL and Vaswani et al. 2017 (Table 3 (A)) vary heads in a "
    "512-wide translation model: at width 64, 8 heads are 8 wide and may be too narrow to gain "
    "from being many, and the loss differences here are near the seed range."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table's validation losses (means over seeds) and their
    ranges over seeds."""
    loss = {row["variant"]: row["validation loss"] for row in rows}
    spread = {row["variant"]: row["loss range over seeds"] for row in rows}
    gqa = [row["variant"] for row in rows if row["variant"].startswith("GQA")]
    mqa_gap = loss["MQA"] - loss["MHA"]
    found = [Verdict(
        "GQA keeps close to MHA's quality, MQA gives up a little more",
        grade(sum(loss[name] - loss["MHA"] < mqa_gap / 2 for name in gqa), len(gqa)),
        "Supported if every GQA variant's loss is nearer MHA's than MQA's is (above MHA's by "
        "less than half MQA's excess), mixed if some are.",
        ", ".join(f"{name} {loss[name] - loss['MHA']:+.3f}" for name in [*gqa, "MQA"])
        + " against MHA", WHY)]  # fmt: skip
    counts = [row for row in rows if row["part"] == "heads at fixed width"]
    between = counts[1:-1] or counts  # the tiny size has two head counts, no middle
    moderate = min(between, key=lambda row: row["validation loss"])["variant"]
    worse = [
        row["variant"] for row in (counts[0], counts[-1])
        if loss[row["variant"]] - loss[moderate] > max(spread[row["variant"]], spread[moderate])
    ]  # fmt: skip
    found.append(Verdict(
        "a single head and very small heads do worse than a few moderate heads",
        grade(len(worse), 2),
        f"Supported if both {counts[0]['variant']} and {counts[-1]['variant']} lose more than the "
        "larger seed range to the best of the head counts between them, mixed if one does.",
        ", ".join(f"{row['variant']} {row['validation loss']:.3f}" for row in counts)
        + f"; best between: {moderate}; worse past the seed range: {', '.join(worse) or 'none'}",
        WHY))  # fmt: skip
    shared = [row["variant"] for row in rows if row["variant"].startswith("shared")]
    costly = [name for name in shared
              if loss[name] - loss["separate"] > max(spread[name], spread["separate"])]  # fmt: skip
    found.append(Verdict(
        "shared projections cost quality", grade(len(costly), len(shared)),
        "Supported if every sharing loses more than the larger seed range to separate "
        "projections, mixed if some do.",
        ", ".join(f"{name} {loss[name] - loss['separate']:+.3f}" for name in shared)
        + " against separate", WHY))  # fmt: skip
    return found
