"""FFN activations at equal parameters: validation loss of small GPTs whose feed-forward layer
is GELU or SwiGLU, the gated one 2/3 as wide so that both hold the same parameters.

`GPTConfig.ffn` offers two kinds, so the study trains those: "gelu_tanh", the two-matrix FFN
W_2 GELU(W_1 x) (GPT-2's tanh approximation of GELU), d_ff = ffn_multiple x d_model wide; and
"swiglu", W_2 (Swish(W_1 x) * W_3 x) (Shazeer 2020), whose three matrices are round(2/3 d_ff)
wide, as Shazeer 2020 (Table 1: d_ff 3072 against 2048) keeps the parameters and FLOPs equal.
ReLU, the FFN of Vaswani et al. 2017 and the third of the claim's order, is no FFN kind of the
GPT (qkv's `FeedForward` layer has it; the GPT does not select it), so no ReLU model is trained
and that part of the claim is left unjudged.

The models are trained as the heads study trains them (`qkv.studies.ablation_training`: the
documentation blocks, the same steps, data order and initial draws per seed), and scored by
their mean next-token loss on the held-out documents; the seeds are paired, so the difference
SwiGLU - GELU is also read seed by seed.
"""

from __future__ import annotations

import statistics
from typing import Any

from qkv.models import GPTConfig
from qkv.studies.ablation_training import base_config, train_variants, variant_row
from qkv.studies.record import StudyResult, Verdict, beyond_noise
from qkv.studies.statistics import paired_t_p_value

__all__ = ["CLAIM", "SIZES", "TITLE", "UNJUDGED", "figure", "run", "verdicts"]

TITLE = "FFN activations: GELU against SwiGLU at equal parameters"
CLAIM = (
    "At equal parameters and FLOPs (SwiGLU's hidden width 2/3 of the others'), the gated "
    "SwiGLU FFN reaches a validation loss no higher than GELU's, and GELU no higher than "
    "ReLU's: SwiGLU <= GELU <= ReLU (Shazeer 2020, Table 1)."
)
UNJUDGED = [
    "GELU <= ReLU: GPTConfig's FFN kinds are 'gelu_tanh' and 'swiglu', so no ReLU GPT is "
    "trained (qkv's FeedForward layer has ReLU, the GPT does not select it)."
]
COLUMNS = [
    "variant", "ffn", "ffn dim", "ffn dim / d_model", "parameters", "FLOPs per token",
    "validation loss", "loss range over seeds",
]  # fmt: skip

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 300, "block_size": 16, "embed_dim": 16, "num_layers": 1, "num_heads": 4,
        "ffn_multiple": 4, "train_steps": 3, "batch_size": 4, "learning_rate": 3e-3,
        "warmup_steps": 1, "weight_decay": 0.1, "eval_tokens": 256, "validation_fraction": 0.1,
        "num_seeds": 2,
    },
    "default": {
        "vocab_size": 1024, "block_size": 64, "embed_dim": 64, "num_layers": 2, "num_heads": 4,
        "ffn_multiple": 4, "train_steps": 400, "batch_size": 16, "learning_rate": 3e-3,
        "warmup_steps": 30, "weight_decay": 0.1, "eval_tokens": 16384,
        "validation_fraction": 0.1, "num_seeds": 4,
    },
}  # fmt: skip


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train GELU and SwiGLU once per seed; score each on the validation blocks."""
    width = settings["ffn_multiple"] * settings["embed_dim"]

    def configs(vocab_size: int) -> dict[str, GPTConfig]:
        return {
            "GELU": base_config(settings, vocab_size, ffn="gelu_tanh", ffn_dim=width),
            "SwiGLU": base_config(
                settings, vocab_size, ffn="swiglu", ffn_dim=round(2 * width / 3)
            ),  # fmt: skip
        }

    built, losses, parameters, vocab_size = train_variants(configs, settings, seed=seed)
    rows = [
        variant_row(label, config, losses[label], parameters[label], settings["block_size"])
        for label, config in built.items()
    ]
    series = {"losses": losses, "seeds": list(range(seed, seed + settings["num_seeds"])),
              "vocab_size": vocab_size}  # fmt: skip
    return StudyResult(
        name="activations", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, losses), series=series,
    )  # fmt: skip


def _findings(rows: list[dict[str, Any]], losses: dict[str, list[float]]) -> list[str]:
    """Sentences read off the table and the per-seed losses: the two losses, their sizes, and
    the paired differences with their t-test."""
    gelu, swiglu = rows
    spread = "loss range over seeds"
    findings = [
        f"Validation loss: GELU {gelu['validation loss']:.3f} (d_ff {gelu['ffn dim']}, "
        f"{gelu['parameters']:,} parameters, {gelu['FLOPs per token']:,} FLOPs per token), "
        f"SwiGLU {swiglu['validation loss']:.3f} (d_ff {swiglu['ffn dim']}, "
        f"{swiglu['parameters']:,} parameters, {swiglu['FLOPs per token']:,} FLOPs per token): "
        f"SwiGLU - GELU {swiglu['validation loss'] - gelu['validation loss']:+.3f}, against "
        f"seed ranges of {gelu[spread]:.3f} (GELU) and {swiglu[spread]:.3f} (SwiGLU)."
    ]
    differences = [s - g for s, g in zip(losses["SwiGLU"], losses["GELU"], strict=True)]
    if len(differences) > 1:
        below = sum(d < 0 for d in differences)
        findings.append(
            "Seed by seed, SwiGLU - GELU: " + ", ".join(f"{d:+.3f}" for d in differences)
            + f" (SwiGLU lower on {below} of {len(differences)} seeds; mean "
            f"{statistics.fmean(differences):+.3f} ± {statistics.stdev(differences):.3f}, "
            f"paired t-test p = {paired_t_p_value(differences):.2g})."
        )  # fmt: skip
    return findings


WHY = (
    "the models here are 2-layer decoders of d_model 64 trained 400 steps (about 0.4M tokens, "
    "2.8 passes over the 147k training tokens of the CPython documentation) over 4 seeds, "
    "where Shazeer 2020 "
    "pre-trains T5-base (about 220M parameters) for 524k steps on C4: at this size and length "
    "of training the FFN holds a small part of the parameters, and a gap between activations "
    "of the order Shazeer reports (about 0.04 in log-perplexity) is near the seed range here."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """SwiGLU <= GELU from the table's validation losses (means over seeds) and their ranges
    over seeds; GELU <= ReLU is UNJUDGED."""
    loss = {row["variant"]: row["validation loss"] for row in rows}
    spread = {row["variant"]: row["loss range over seeds"] for row in rows}
    gap, noise = loss["SwiGLU"] - loss["GELU"], max(spread["SwiGLU"], spread["GELU"])
    verdict = beyond_noise(-gap, noise)  # SwiGLU expected below GELU
    return [Verdict(
        "SwiGLU's loss <= GELU's", verdict,
        "Supported if SwiGLU's mean loss is below GELU's by more than the larger of their loss "
        "ranges over seeds, not supported if above it by more, mixed if the gap lies within "
        "that range (not separated from the seeds, either way).",
        f"SwiGLU - GELU {gap:+.3f}, larger seed range {noise:.3f}",
        "" if verdict == "supported" else WHY)]  # fmt: skip


def figure(result: StudyResult):
    """Two panels: the validation loss of GELU and SwiGLU per seed (a line per seed joins its
    pair; the means with the range over seeds), and the paired differences SwiGLU - GELU per
    seed against the larger seed range."""
    from matplotlib.figure import Figure

    losses, seeds = result.series["losses"], result.series["seeds"]
    labels = list(losses)
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    for index in range(len(seeds)):  # one line per seed joins its pair
        left.plot(range(len(labels)), [losses[label][index] for label in labels], "o-",
                  color="grey", alpha=0.5, linewidth=0.8,
                  label="one seed" if index == 0 else None)  # fmt: skip
    means = [row["validation loss"] for row in result.rows]
    errors = [row["loss range over seeds"] / 2 for row in result.rows]
    left.errorbar(range(len(labels)), means, yerr=errors, fmt="s", color="tab:blue", capsize=4,
                  label="mean (bar: range over seeds)")  # fmt: skip
    left.set_xticks(range(len(labels)), [
        f"{row['variant']}\nd_ff {row['ffn dim']}, {row['parameters']:,} params"
        for row in result.rows
    ])  # fmt: skip
    left.set_xlim(-0.5, len(labels) - 0.5)
    left.set(ylabel="validation loss", title="Loss per seed at equal parameters")
    left.legend(fontsize=8)
    differences = [s - g for s, g in zip(losses["SwiGLU"], losses["GELU"], strict=True)]
    noise = max(row["loss range over seeds"] for row in result.rows)
    right.bar([str(seed) for seed in seeds], differences, color="tab:orange")
    right.axhspan(-noise, noise, color="grey", alpha=0.2, label=f"± larger seed range {noise:.3f}")
    right.axhline(0.0, color="black", linewidth=0.8)
    right.set(xlabel="seed", ylabel="SwiGLU - GELU validation loss",
              title="Paired differences (below 0: SwiGLU better)")  # fmt: skip
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout()
    return fig
