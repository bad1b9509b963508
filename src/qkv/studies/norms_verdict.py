"""The verdict of the norms study, from its table (a module of its own: the study's module has
little room left under the house's 400 lines)."""

from __future__ import annotations

from typing import Any

from qkv.studies.record import Verdict, grade

__all__ = ["verdicts"]

WHY = "small models trained for a few hundred steps on one text, 3 runs per warm-up setting."
PADDING, MATES = "max output change, more padding", "max output change, other batchmates"


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the rows of its three parts: padding, residuals, warm-up."""
    row = {r["variant"]: r for r in rows}
    tied = [key for key in (PADDING, MATES) if row["BatchNorm, all positions"][key] > 0]
    alone = [name for name in ("LayerNorm", "RMSNorm")
             if row[name][PADDING] == 0 and row[name][MATES] == 0]  # fmt: skip
    depths = [r["variant"].split(", ")[1] for r in rows if r["variant"].startswith("pre-norm, ")
              and r["part"] == "residuals"]  # fmt: skip
    loss = {name: r.get("final train loss") for name, r in row.items()}
    better = [d for d in depths if loss[f"pre-norm, {d}"] < loss[f"no residual, {d}"]]
    diverged = {name: int(r["diverged runs"].split()[0]) for name, r in row.items()
                if r["part"] == "warm-up"}  # fmt: skip
    warmed = {
        n: next(name for name in diverged if name.startswith(f"{n}, warm-up "))
        for n in ("post-norm", "pre-norm")
    }  # fmt: skip  (its steps: the size's)
    post, pre = (
        diverged[f"{n}, no warm-up"] - diverged[warmed[n]] for n in ("post-norm", "pre-norm")
    )
    return [
        Verdict("padding pulls BatchNorm and ties outputs to the batch; LayerNorm and RMSNorm "
                "normalise each token alone", grade(len(tied) + len(alone), 4),
                "Supported if BatchNorm over all positions changes a real token's output both "
                "when the batch is padded further and when its batchmates change, and LayerNorm "
                "and RMSNorm change it in neither case; mixed if in part.",
                f"BatchNorm {row['BatchNorm, all positions'][PADDING]:.3g} and "
                f"{row['BatchNorm, all positions'][MATES]:.3g}; LayerNorm and RMSNorm at most "
                f"{max(row[n][k] for n in ('LayerNorm', 'RMSNorm') for k in (PADDING, MATES)):.3g}",
                WHY),
        Verdict("residual connections keep deep stacks trainable", grade(len(better), len(depths)),
                "Supported if at every depth the pre-norm stack with residuals ends at a lower "
                "training loss than the stack without, mixed if at some depths.",
                ", ".join(f"{d}: {loss[f'pre-norm, {d}']:.2f} against "
                          f"{loss[f'no residual, {d}']:.2f}" for d in depths), WHY),
        Verdict("post-norm needs warm-up, pre-norm does not", grade((post > 0) + (pre <= 0), 2),
                "Supported if post-norm diverges in more runs without warm-up than with it and "
                "pre-norm in no more; mixed if one holds.",
                ", ".join(f"{name} {r['diverged runs']} diverged" for name, r in row.items()
                          if r["part"] == "warm-up"), WHY),
    ]  # fmt: skip
