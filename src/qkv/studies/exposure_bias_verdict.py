"""The verdict of the exposure-bias study, from its table (a module of its own: the study's
module has little room left under the house's 400 lines). It reads the per-seed rows alone;
the mean and paired rows are summaries of them."""

from __future__ import annotations

from typing import Any

from qkv.studies.record import Verdict, grade

__all__ = ["COMPOUNDS", "verdicts"]

COMPOUNDS = 2.0  # "mistakes compound": free-running token error at least 2x the teacher-forced
WHY = (
    "the GRUs here are 32 wide and train 500 steps on number words whose outputs are about 30 "
    "tokens long, so the last positions hold few tokens (the >=25 bin varies by 2.8 points "
    "over seeds), where Bengio et al. 2015 train larger models on captions, parsing and speech."
)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the per-seed rows (those whose seed is an int)."""
    runs = {(r["training"], r["seed"]): r for r in rows if isinstance(r["seed"], int)}
    seeds = sorted({seed for _, seed in runs})
    teacher = [runs["teacher forcing", s] for s in seeds]
    scheduled = [runs["scheduled sampling", s] for s in seeds]
    bins = [key for key in rows[0] if key.startswith("err pos")]
    compounding = [r for r in teacher if r["token err (free)"] >= COMPOUNDS * r["token err (TF)"]
                   and r[bins[1]] > r[bins[0]]]  # fmt: skip
    lower = [t for t, s in zip(teacher, scheduled, strict=True)
             if s["token err (free)"] < t["token err (free)"]]  # fmt: skip
    gain = {b: sum(t[b] - s[b] for t, s in zip(teacher, scheduled, strict=True)) / len(seeds)
            for b in bins}  # fmt: skip
    most = max(gain, key=gain.get)
    late = bins.index(most) >= len(bins) // 2
    return [
        Verdict("with teacher forcing, mistakes compound along the output",
                grade(len(compounding), len(seeds)),
                f"Supported if in every seed the teacher-forced model's free-running token error "
                f"is at least {COMPOUNDS:g}x its teacher-forced one and higher at positions "
                f"{bins[1][8:]} than {bins[0][8:]}, mixed if in some.",
                "free over teacher-forced error "
                + ", ".join(f"{r['token err (free)'] / r['token err (TF)']:.1f}x" for r in teacher)
                + f"; in {len(compounding)} of {len(seeds)} seeds", WHY),
        Verdict("scheduled sampling lowers the free-running error", grade(len(lower), len(seeds)),
                "Supported if scheduled sampling's free-running token error is below teacher "
                "forcing's in every seed, mixed if in some.",
                f"lower in {len(lower)} of {len(seeds)} seeds", WHY),
        Verdict("most at late positions",
                "supported" if late else "not supported" if most == bins[0] else "mixed",
                "Supported if the largest mean reduction of the error (over seeds) falls in the "
                "later half of the position bins, not supported if in the first bin, mixed "
                "otherwise.",
                ", ".join(f"{b[8:]} {100 * -g:+.2f}" for b, g in gain.items())
                + f" points; largest at {most[8:]}", WHY),
    ]  # fmt: skip
