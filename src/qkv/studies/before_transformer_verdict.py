"""The verdict of the before-transformer study, from its table (a module of its own: the study's
module has no room left under the house's 400 lines).

The claim's last part, that the additive model's alignments and the Transformer's
cross-attention follow the reordering of the words, is left out of the verdict rather than
called "mixed": the study draws both maps and compares the two models' most-weighted source
tokens, but scores neither against a reference alignment, so no figure could decide it.
"""

from __future__ import annotations

from typing import Any

from qkv.studies.record import Verdict, grade

__all__ = ["FALLS", "HOLDS", "UNJUDGED", "verdicts"]

FALLS = 0.10  # "loses exact matches as the source grows": 10 points or more, shortest to longest
HOLDS = 0.05  # "holds them": loses at most 5 points
UNJUDGED = [
    "that the additive model's alignments and the Transformer's cross-attention follow the "
    "reordering of the words: the study draws both maps and compares the two models' "
    "most-weighted source tokens, but scores neither against a reference alignment."
]
WHY = "800 steps of 64 pairs on number words, with 64-wide GRU states, is a small setting."


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Exact match on the shortest and longest sources (the first and last EM columns)."""
    bins = [key for key in rows[0] if key.startswith("EM src")]
    change = {row["model"]: row[bins[-1]] - row[bins[0]] for row in rows}
    fixed = next(name for name in change if "fixed" in name)
    attending = [name for name in change if name != fixed]
    held = [name for name in attending if change[name] >= -HOLDS]
    points = ", ".join(f"{name} {100 * value:+.0f} points" for name, value in change.items())
    span = f"from {bins[0][3:]} to {bins[-1][3:]}"
    return [
        Verdict("the fixed context vector loses exact matches as the source grows",
                grade(change[fixed] <= -FALLS, 1),
                f"Supported if its exact match falls by {100 * FALLS:g} points or more {span}.",
                points, WHY),
        Verdict("attention and the Transformer hold them", grade(len(held), len(attending)),
                f"Supported if every attending model's exact match falls by at most "
                f"{100 * HOLDS:g} points {span}, mixed if some models' does.", points, WHY),
    ]  # fmt: skip
