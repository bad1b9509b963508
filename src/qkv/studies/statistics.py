"""Statistics over a study's seeds: mean +- standard deviation, and the paired t-test.

A study that trains two variants on the same seeds (the same initial weights, data order and
random draws for both) compares them seed by seed: the differences, their mean and spread, and
the two-sided paired t-test of a zero mean difference (Student 1908).
"""

from __future__ import annotations

import math
import statistics

import torch

__all__ = ["mean_std", "mean_std_text", "paired_t_p_value"]


def mean_std(values: list[float | None], *, sign: str = "") -> str | None:
    """'mean ± sample standard deviation', 3 significant digits; None where any is missing.
    sign="+" writes the mean's sign (for differences)."""
    if any(value is None for value in values):
        return None
    mean, deviation = statistics.mean(values), statistics.stdev(values)
    return f"{mean:{sign}.3g} ± {deviation:.2g}"


def mean_std_text(values: list[float], scale: float, unit: str = "", sign: str = "") -> str:
    """'mean ± standard deviation' of the values times scale, two decimals, then unit."""
    mean, deviation = scale * statistics.mean(values), scale * statistics.stdev(values)
    return f"{mean:{sign}.2f} ± {deviation:.2f}{unit}"


def paired_t_p_value(differences: list[float]) -> float:
    """Two-sided p-value of the paired t-test of mean(differences) = 0 (Student 1908): t =
    mean / (s / sqrt(n)) against Student's t with n - 1 degrees of freedom, whose density is
    integrated from 0 to |t| by the trapezoidal rule."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"differences: expected at least 2 values, got {n}")
    mean, deviation = statistics.mean(differences), statistics.stdev(differences)
    if deviation == 0:
        return 1.0 if mean == 0 else 0.0
    t, dof = abs(mean) / (deviation / math.sqrt(n)), n - 1
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    x = torch.linspace(0.0, t, 20_001, dtype=torch.float64)
    density = torch.exp(log_norm - (dof + 1) / 2 * torch.log1p(x.square() / dof))
    return max(0.0, 1.0 - 2.0 * float(torch.trapezoid(density, x)))
