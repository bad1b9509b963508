"""The verdict of the extrapolation study, from its table (a module of its own: the study's
module has little room left under the house's 400 lines).

The table has a row per model and encoding: the decoders trained by the study, and SmolLM2
where it is installed (`qkv.studies.extrapolation_real`). Its columns are relative to each
model's training length L: "ppl@L", "ppl@2L", ..., PAST (perplexity on the positions >= L of
the longest windows) and RATIO (perplexity at the longest window over that at L).
"""

from __future__ import annotations

from typing import Any

from qkv.studies.record import Verdict, grade
from qkv.studies.sinks_real import SMOLLM2

__all__ = ["KEPT_WITHIN", "PAST", "RATIO", "verdicts"]

PAST = "ppl past L, longest window"
RATIO = "ppl longest / ppl@L"
KEPT_WITHIN = 1.1  # "keeps its perplexity": at the longest window, at most 1.1x that at L
WHY = (
    "the decoders here have 2 layers of width 64 and train 700 steps on 64-token windows of a "
    "1024-token vocabulary, where Press et al. 2022 train models of 247M parameters and more on "
    "WikiText-103: T5's buckets past the longest trained distance and RoPE's low frequencies "
    "are learned from far less text."
)
WHY_REAL = (
    "the scalings are applied at inference only, to a 135M-parameter model scored on one "
    "documentation text, where Chen et al. 2023 and Peng et al. 2023 fine-tune on the longer "
    "windows after scaling."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table: the trained decoders' rows, then SmolLM2's (its
    parts judged only where it was measured)."""
    trained = [row for row in rows if row.get("model") != SMOLLM2 and "encoding" in row]
    real = [row for row in rows if row.get("model") == SMOLLM2 and "encoding" in row]
    return _trained_verdicts(trained) + (_real_verdicts(real) if real else [])


def _trained_verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    ratio = {row["encoding"]: row[RATIO] for row in rows}
    longest_key = [key for key in rows[0] if key.startswith("ppl@") and rows[0][key]][-1]
    longest = {row["encoding"]: row[longest_key] for row in rows}
    kept = f"within {KEPT_WITHIN}x its perplexity at L ({longest_key} / ppl@L)"
    found = []
    for name, label in (("alibi", "ALiBi keeps"), ("t5", "T5's bias keeps")):
        found.append(Verdict(
            f"{label} its perplexity past L", grade(ratio[name] <= KEPT_WITHIN, 1),
            f"Supported if {name}'s perplexity at the longest window is {kept}.",
            f"{name} {ratio[name]:.2f}x", WHY))  # fmt: skip
    degrading, worst = ("learned", "sinusoidal", "rope"), max(longest, key=longest.get)
    found.append(Verdict(
        "learned, sinusoidal and plain RoPE positions degrade",
        grade(sum(ratio[name] > KEPT_WITHIN for name in degrading), len(degrading)),
        f"Supported if each of {', '.join(degrading)} ends above {KEPT_WITHIN}x its perplexity "
        "at L, mixed if some do.",
        ", ".join(f"{name} {ratio[name]:.2f}x" for name in degrading) + f"; worst at the "
        f"longest window: {worst} ({longest[worst]:.3g}; Vaswani et al. 2017 hoped sinusoidal "
        "positions would extrapolate, Press et al. 2022 found they do not)", WHY))  # fmt: skip
    lowest = min(ratio[name] for name in degrading)
    found.append(Verdict(
        "no positions sit between", grade(KEPT_WITHIN < ratio["none"] < lowest, 1),
        f"Supported if no positions' ratio is above {KEPT_WITHIN}x (it does not keep) and below "
        "the lowest of learned, sinusoidal and plain RoPE.",
        f"none {ratio['none']:.2f}x, lowest of the three {lowest:.2f}x", WHY))  # fmt: skip
    scaled = [name for name in ratio if name.startswith("rope + ")]
    found.append(Verdict(
        "RoPE scalings at inference recover part of RoPE's loss",
        grade(sum(longest[name] < longest["rope"] for name in scaled), len(scaled)),
        "Supported if every scaling lowers plain RoPE's perplexity at the longest window, mixed "
        "if some do.",
        ", ".join(f"{name} {longest[name]:.3g}" for name in scaled)
        + f" against rope {longest['rope']:.3g}", WHY))  # fmt: skip
    return found


def _real_verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """SmolLM2 past its training length: plain RoPE degrades there, the scalings recover part
    of it (on the positions >= L of windows of 2L)."""
    past = {row["encoding"]: row[PAST] for row in rows}
    within, L = rows[0]["ppl@L"], rows[0]["L"]
    scaled = [name for name in past if name != "rope"]
    return [
        Verdict(
            f"{SMOLLM2}'s plain RoPE degrades past its training length",
            grade(past["rope"] > KEPT_WITHIN * within, 1),
            f"Supported if its perplexity on positions {L} to {2 * L - 1} is above "
            f"{KEPT_WITHIN}x that within its first {L}.",
            f"{past['rope']:.3g} against {within:.3g} ({past['rope'] / within:.2f}x)", WHY_REAL,
        ),
        Verdict(
            f"RoPE scalings at inference recover part of {SMOLLM2}'s loss past L",
            grade(sum(past[name] < past["rope"] for name in scaled), len(scaled)),
            f"Supported if every scaling lowers plain RoPE's perplexity on positions {L} to "
            f"{2 * L - 1}, mixed if some do.",
            ", ".join(f"{name} {past[name]:.3g}" for name in scaled)
            + f" against rope {past['rope']:.3g}", WHY_REAL,
        ),
    ]  # fmt: skip
