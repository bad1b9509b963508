"""Why self-attention: Vaswani et al. 2017, s4 and Table 1, for concrete sizes.

Table 1 compares four layer types mapping a sequence of n vectors of width d to another: the
operations of one layer, the operations that must run one after the other, and the longest
path a signal travels between two positions. Here n = `length`, d = `width`, k = `kernel`
(a convolution's width) and r = `neighbourhood` (the keys a restricted self-attention query
sees, centred on it: r // 2 before it, r - 1 - r // 2 after it).

Operations per layer, as multiply-adds (FLOPs: 2 per multiply-add, as in
`qkv.analysis.cost.layout`), matrix products only:
  self-attention              2 n^2 d   Q K^T and weights @ V (n^2 d each); the projections
                                        (n d^2 each) are left out, as the table leaves them out
  recurrent                   2 n d^2   W_ih x_t and W_hh h_(t-1) at each of the n steps
  convolutional               k n d^2   k taps of a d x d matrix at each position
  self-attention (restricted) 2 r n d   the r keys of each query, the ends padded as a
                                        convolution's are

Sequential operations: 1 for every layer but the recurrent one, whose n steps wait on each
other. Maximum path length: the fewest layers after which the last output (position n - 1)
depends on the first input (position 0), the longest distance in the sequence:
  self-attention              1
  recurrent                   n                   the sequential steps on the path (one layer)
  convolutional (contiguous)  ceil((n-1)/(k-1))   causal: each layer reaches k - 1 back
  convolutional (dilated)     ceil(log_k n)       dilations 1, k, k^2, ... (Kalchbrenner et
                                                  al. 2017, ByteNet): k^L positions
  self-attention (restricted) ceil((n-1)/(r//2))  each layer reaches r // 2 back
(1 at least: a layer is needed whatever n). `qkv.analysis.cost.layer_paths` measures them
on real layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.validation import check_int

__all__ = [
    "DEFAULT_NEIGHBOURHOOD",
    "KERNEL",
    "LAYER_NAMES",
    "LayerType",
    "LayerTypes",
    "check_sizes",
    "dilated_depth",
    "layer_types",
]

KERNEL = 3  # the smallest odd width, the usual one
DEFAULT_NEIGHBOURHOOD = 256  # capped at the length: a wider window is full self-attention
LAYER_NAMES = (
    "self-attention",
    "recurrent",
    "convolutional (contiguous)",
    "convolutional (dilated)",
    "self-attention (restricted)",
)


@dataclass(frozen=True)
class LayerType:
    """One row of Table 1 at concrete sizes. complexity, sequential and path: the table's
    orders, in n, d, k, r; multiply_adds, flops, sequential_operations and max_path_length:
    their values."""

    name: str
    complexity: str
    multiply_adds: int
    flops: int
    sequential: str
    sequential_operations: int
    path: str
    max_path_length: int


@dataclass(frozen=True)
class LayerTypes:
    """Table 1 for one model's length and width: a row per name in LAYER_NAMES."""

    name: str
    length: int
    width: int
    kernel: int
    neighbourhood: int
    rows: tuple[LayerType, ...]


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def dilated_depth(length: int, kernel: int) -> int:
    """The fewest causal convolutions of width k, dilated 1, k, k^2, ..., whose receptive
    field (k^L positions) reaches back over all n: the smallest L >= 1 with k^L >= n, exactly
    (no floating-point logarithm)."""
    depth = 1
    while kernel**depth < length:
        depth += 1
    return depth


def check_sizes(length: object, width: object, kernel: object, neighbourhood: object) -> None:
    """TypeError/ValueError naming the argument unless length >= 2, width >= 1, kernel >= 2
    and 2 <= neighbourhood <= length."""
    check_int("length", length, minimum=2)  # one position has no path to measure
    check_int("width", width, minimum=1)
    check_int("kernel", kernel, minimum=2)  # a width-1 kernel never mixes positions
    check_int("neighbourhood", neighbourhood, minimum=2, maximum=length)


def _row(name, complexity, multiply_adds, sequential, steps, path, depth) -> LayerType:
    return LayerType(
        name=name, complexity=complexity, multiply_adds=multiply_adds, flops=2 * multiply_adds,
        sequential=sequential, sequential_operations=steps, path=path, max_path_length=depth,
    )  # fmt: skip


def layer_types(
    *, length: int, width: int, kernel: int = KERNEL, neighbourhood: int | None = None,
    name: str = "",
) -> LayerTypes:  # fmt: skip
    """Table 1 at n = length, d = width, k = kernel, r = neighbourhood (default
    min(DEFAULT_NEIGHBOURHOOD, length)); `name` titles it. Errors as `check_sizes`."""
    if neighbourhood is None and isinstance(length, int):
        neighbourhood = min(DEFAULT_NEIGHBOURHOOD, length)
    check_sizes(length, width, kernel, neighbourhood)
    n, d, k, r = length, width, kernel, neighbourhood
    contiguous = max(1, _ceil_div(n - 1, k - 1))
    restricted = max(1, _ceil_div(n - 1, r // 2))
    rows = (
        _row(LAYER_NAMES[0], "O(n^2 d)", 2 * n * n * d, "O(1)", 1, "O(1)", 1),
        _row(LAYER_NAMES[1], "O(n d^2)", 2 * n * d * d, "O(n)", n, "O(n)", n),
        _row(LAYER_NAMES[2], "O(k n d^2)", k * n * d * d, "O(1)", 1, "O(n/k)", contiguous),
        _row(LAYER_NAMES[3], "O(k n d^2)", k * n * d * d, "O(1)", 1, "O(log_k n)",
             dilated_depth(n, k)),
        _row(LAYER_NAMES[4], "O(r n d)", 2 * r * n * d, "O(1)", 1, "O(n/r)", restricted),
    )  # fmt: skip
    return LayerTypes(name=name, length=n, width=d, kernel=k, neighbourhood=r, rows=rows)
