"""Softmax, exactly: its Jacobian, the naive and the max-subtracted forms, and log-sum-exp.

softmax(x)_i = exp(x_i) / sum_j exp(x_j) turns scores into probabilities (the name is Bridle's,
1990, "Probabilistic Interpretation of Feedforward Classification Network Outputs"); attention
applies it to every row of QK^T / sqrt(d_k) (Vaswani et al. 2017, s3.2.1). Two facts about it
are worth having as functions:

- Its derivative is the matrix dy_i/dx_j = y_i (delta_ij - y_j), i.e. J = diag(y) - y y^T. When
  the scores grow, y approaches a one-hot vector and every entry of J, on and off the diagonal,
  approaches 0: the vanishing gradients that the 1/sqrt(d_k) scale keeps away (Vaswani et al.
  2017, s3.2.1 and its footnote 4).
- exp overflows (past x = 88.7 in float32, 11.09 in float16) and underflows to 0, so the
  formula as written fails on large or very negative scores. Subtracting the row's maximum
  first changes nothing mathematically and keeps every exponent <= 0 with at least one term
  equal to 1 (Goodfellow et al. 2016, "Deep Learning", s4.1 "Overflow and Underflow");
  log sum_j exp(x_j) = m + log sum_j exp(x_j - m), m = max_j x_j, is the same trick.

Every function works on the last dimension and is batched over the leading ones. The naive and
stable forms compute in the dtype they are given (float16 stays float16), so that the two can
be compared at one precision.
"""

from __future__ import annotations

import torch

__all__ = ["logsumexp", "naive_softmax", "softmax_jacobian", "stable_softmax"]


def softmax_jacobian(y: torch.Tensor) -> torch.Tensor:
    """The Jacobian dy/dx of y = softmax(x), from y: diag(y) - y y^T.

    y: (..., n), softmax outputs (each row on the simplex). Returns (..., n, n) with entry
    [..., i, j] = dy_i/dx_j = y_i (delta_ij - y_j): the diagonal y_i (1 - y_i), the off-diagonal
    terms -y_i y_j. Each row and column sums to 0 (adding a constant to every score changes
    nothing). Both vanish as y becomes one-hot, the saturation of Vaswani et al. 2017, s3.2.1.
    """
    _check_scores("y", y)
    jacobian = (y.unsqueeze(-1) * y.unsqueeze(-2)).neg_()  # (..., n, n): -y_i y_j
    jacobian.diagonal(dim1=-2, dim2=-1).add_(y)  # + y_i on the diagonal, in place
    return jacobian


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """exp(x) / sum(exp(x)) as written, in x's dtype: what goes wrong without the trick.

    x: (..., n). exp overflows to inf for x_i above log(finfo.max) (11.09 in float16, 88.7 in
    float32), and inf / inf is NaN; a row whose scores all lie far below 0 underflows to 0 / 0,
    NaN again (Goodfellow et al. 2016, s4.1). Returns (..., n).
    """
    _check_scores("x", x)
    exponentials = torch.exp(x)  # (..., n): may hold inf or 0
    return exponentials / exponentials.sum(dim=-1, keepdim=True)


def stable_softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x) with the row maximum subtracted first, in x's dtype.

    x: (..., n), may hold -inf (a masked score). exp(x - max) lies in [0, 1] with at least one
    term equal to 1, so neither the exponentials nor their sum (at most n) overflow, and the
    sum is never 0 (Goodfellow et al. 2016, s4.1). A row of only -inf (nothing visible) gives
    zeros, not NaN: qkv's rule for a fully masked query. Returns (..., n).
    """
    _check_scores("x", x)
    shift = _finite_row_max(x)  # (..., 1)
    exponentials = torch.exp(x - shift)  # (..., n), each in [0, 1]
    total = exponentials.sum(dim=-1, keepdim=True)  # (..., 1): >= 1 unless the row is all -inf
    return exponentials / torch.where(total > 0, total, torch.ones_like(total))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log sum_j exp(x_j) over the last dimension, by the log-sum-exp trick.

    x: (..., n). Computes m + log sum_j exp(x_j - m) with m the row maximum (Goodfellow et al.
    2016, s4.1), so it is finite wherever the answer is. A row of only -inf gives -inf (the log
    of an empty sum), not NaN; a row holding +inf gives +inf. Returns (...,).
    """
    _check_scores("x", x)
    shift = _finite_row_max(x)  # (..., 1)
    total = torch.exp(x - shift).sum(dim=-1, keepdim=True)  # (..., 1); 0 on an all -inf row
    return (shift + torch.log(total)).squeeze(-1)  # (...,): log(0) = -inf


def _finite_row_max(x: torch.Tensor) -> torch.Tensor:
    """The row maximum (..., 1), replaced by 0 where it is not finite: subtracting -inf from an
    all -inf row (or +inf from a row holding +inf) would make NaN out of nothing."""
    row_max = x.amax(dim=-1, keepdim=True)  # (..., 1)
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


def _check_scores(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.ndim == 0 or value.shape[-1] == 0 or not value.is_floating_point():
        raise ValueError(
            f"{name}: expected a floating tensor of shape (..., n) with n >= 1, got shape "
            f"{tuple(value.shape)} and dtype {value.dtype}"
        )
