"""Shared pieces of `qkv.analysis.plots`: the matplotlib import, figures, heat maps, checks.

matplotlib is optional: it is imported here, and only `qkv.analysis.plots*` import this module,
so `import qkv` never loads it. Figures are built with the object-oriented API
(`matplotlib.figure.Figure`), never through pyplot's global state: nothing is shown, no backend
has to be chosen, and figures are freed when the caller drops them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

try:
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "qkv.analysis.plots needs matplotlib, an optional dependency: pip install matplotlib"
    ) from error

__all__ = [
    "Figure",
    "MaxNLocator",
    "check_int",
    "check_int_sequence",
    "check_labels",
    "draw_heatmap",
    "grid_shape",
    "new_figure",
    "to_numpy",
]


def new_figure(*, figsize: tuple[float, float]) -> Figure:
    """A detached figure with constrained layout (titles, labels and colorbars do not overlap)."""
    return Figure(figsize=figsize, layout="constrained")


def draw_heatmap(
    ax,
    matrix: np.ndarray,
    *,
    title: str,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    annotate: bool = False,
    cmap: str = "Blues",
    vmin: float | None = None,
    vmax: float | None = None,
):
    """Draw a (L_q, L_k) matrix as an image: keys along x, queries along y.

    Returns the `AxesImage`, whose `get_array()` is `matrix`. With `annotate`, each cell also
    shows its value (readable for a few tokens).
    """
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set_title(title)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if key_labels is not None:
        ax.set_xticks(range(len(key_labels)), labels=list(key_labels), rotation=90)
    if query_labels is not None:
        ax.set_yticks(range(len(query_labels)), labels=list(query_labels))
    if annotate:
        low, high = image.get_clim()
        middle = (low + high) / 2
        for (row, column), value in np.ndenumerate(matrix):
            color = "white" if value > middle else "black"
            ax.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=8, color=color)
    return image


def to_numpy(name: str, values: object) -> np.ndarray:
    """A tensor or array-like of real numbers -> a float64 numpy array (detached, on the CPU)."""
    if isinstance(values, torch.Tensor):
        if values.is_complex():
            raise TypeError(f"{name}: expected real values, got dtype {values.dtype}")
        return values.detach().to("cpu", torch.float64).numpy()
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name}: expected a tensor or array of real numbers, got {type(values).__name__}"
        ) from error
    return array


def check_int(name: str, value: object, *, minimum: int) -> int:
    """An int (not a bool) that is at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_int_sequence(name: str, values: object, *, minimum: int) -> tuple[int, ...]:
    """A non-empty sequence of ints, each at least `minimum`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name}: expected a non-empty sequence of ints, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected ints >= {minimum}, got {list(values)!r}")
    return tuple(values)


def check_labels(name: str, labels: Sequence[str] | None, length: int) -> list[str] | None:
    """Tick labels: None, or one string per row/column."""
    if labels is None:
        return None
    if isinstance(labels, str) or len(labels) != length:
        raise ValueError(f"{name}: expected {length} labels (one per position), got {labels!r}")
    return [str(label) for label in labels]


def grid_shape(count: int, *, max_columns: int) -> tuple[int, int]:
    """(rows, columns) of the smallest grid with at most `max_columns` columns holding `count`."""
    columns = min(count, max_columns)
    return math.ceil(count / columns), columns
