"""The NumPy lab, checked: attention and multi-head attention in plain NumPy against PyTorch.

`qkv.analysis.numpy_lab` writes scaled dot-product attention (Vaswani et al. 2017, s3.2.1) and
multi-head attention (s3.2.2) with NumPy alone, forward and a hand-written backward. For each
case (batch B, heads H, length L, head dimension D, and a mask: none, causal, or key padding
with a different length per sequence), in float64:

- attention: the output and dq, dk, dv against F.scaled_dot_product_attention and torch
  autograd, on random q, k, v (B, H, L, D) and a random upstream gradient;
- multi-head self-attention (E = H * D): the output and the gradients of the input and of the
  eight projection weights and biases against `torch.nn.MultiheadAttention` holding the same
  weights (its masks are True where blocked: the lab's are inverted for it);
- a finite-difference check of the hand-written gradients, on `fd_probes` entries of each
  input and weight: (f(x + h) - f(x - h)) / 2h of the loss sum(output * upstream gradient);
- the forward's time in float32, NumPy against PyTorch (the median of `timing_repeats` runs on
  the machine recorded with the result), both on one thread (`qkv.studies.numpy_lab_timing`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qkv.analysis.numpy_lab import (
    MultiHeadWeights,
    attention_backward,
    attention_forward,
    multi_head_backward,
    multi_head_forward,
)
from qkv.studies.numpy_lab_timing import blas_limited, median_times
from qkv.studies.record import StudyResult, Verdict, grade

__all__ = ["CLAIM", "SIZES", "TITLE", "figure", "run", "verdicts"]

logger = logging.getLogger(__name__)

TITLE = "The NumPy lab: attention by hand against PyTorch and autograd"
CLAIM = (
    "Scaled dot-product and multi-head attention (Vaswani et al. 2017, s3.2.1-3.2.2), written in "
    "plain NumPy with a hand-derived backward (dV = P^T dO, dS = P * (dP - rowsum(dP * P)), dQ "
    "= dS K / sqrt(d_k), dK = dS^T Q / sqrt(d_k)), give PyTorch's outputs and autograd's "
    "gradients to float64 rounding."
)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "cases": [[1, 2, 4, 8, "none"], [2, 2, 5, 4, "padding"]], "fd_probes": 2,
        "fd_step": 1e-6, "timing_repeats": 3,
    },
    "default": {
        "cases": [
            [1, 1, 8, 16, "none"], [2, 4, 32, 16, "causal"], [4, 8, 64, 32, "padding"],
            [2, 8, 256, 64, "causal"],
        ],
        "fd_probes": 4, "fd_step": 1e-6, "timing_repeats": 20,
    },
}  # fmt: skip
COLUMNS = [
    "case", "module", "output", "input gradients", "weight gradients",
    "finite differences (rel.)", "numpy forward (ms)", "torch forward (ms)",
    "numpy / torch",
]  # fmt: skip
ATTENTION_GRADIENTS = ("dq", "dk", "dv")
WEIGHT_NAMES = tuple(field.name for field in dataclasses.fields(MultiHeadWeights))
# how the figure and findings name each weight's gradient: q_weight -> dW_q, out_bias -> db_o
GRADIENT_NAMES = {
    name: f"d{'W' if name.endswith('weight') else 'b'}_{name.split('_')[0][0]}"
    for name in WEIGHT_NAMES
}


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Every case of settings["cases"] ([B, H, L, D, mask]), attention then multi-head."""
    rng = np.random.default_rng(seed)
    rows, errors = [], {}
    for B, H, L, D, mask_kind in settings["cases"]:
        case = f"B={B} H={H} L={L} D={D}, mask {mask_kind}"
        logger.info("numpy lab: %s", case)
        mask = _mask(mask_kind, B, L, rng)
        for module, check in (("attention", _check_attention), ("multi-head", _check_multi_head)):
            found, fd_error, times = check(rng, (B, H, L, D), mask, settings)
            errors.setdefault(case, {})[module] = found
            rows.append(_row(case, module, found, fd_error, times))
    series = {
        "errors": errors, "cases": [row["case"] for row in rows[::2]],
        "numpy_blas_limited": blas_limited(),
    }  # fmt: skip
    return StudyResult(
        name="numpy-lab", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(rows, errors, series["numpy_blas_limited"]), series=series,
    )  # fmt: skip


def _mask(kind: str, B: int, L: int, rng: np.random.Generator) -> np.ndarray | None:
    """None, causal (L, L), or key padding (B, 1, 1, L) with lengths drawn in [1, L]; True where
    a query may attend."""
    if kind == "none":
        return None
    if kind == "causal":
        return np.tril(np.ones((L, L), dtype=bool))
    if kind == "padding":
        lengths = rng.integers(1, L + 1, size=B)
        lengths[0] = L  # one sequence without padding, one at least with it when B > 1
        return (np.arange(L)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L)
    raise ValueError(f"cases: expected a mask of 'none', 'causal' or 'padding', got {kind!r}")


# --- scaled dot-product attention ---------------------------------------------------------------


def _check_attention(
    rng: np.random.Generator,
    shape: tuple[int, int, int, int],
    mask: np.ndarray | None,
    settings: dict[str, Any],
) -> tuple[dict[str, float], float, list[float]]:
    """Errors of the output and dq, dk, dv against autograd; finite differences; times."""
    q, k, v, d_out = (rng.standard_normal(shape) for _ in range(4))  # (B, H, L, D) each
    out, weights = attention_forward(q, k, v, mask=mask)
    grads = attention_backward(d_out, q, k, v, weights)
    tensors = [torch.tensor(array, requires_grad=True) for array in (q, k, v)]
    torch_mask = None if mask is None else torch.from_numpy(mask)
    expected = F.scaled_dot_product_attention(*tensors, attn_mask=torch_mask)
    expected.backward(torch.from_numpy(d_out))
    found = {"output": _max_error(out, expected)}
    for name, got, tensor in zip(ATTENTION_GRADIENTS, (grads.q, grads.k, grads.v), tensors,
                                 strict=True):  # fmt: skip
        found[name] = _max_error(got, tensor.grad)

    def loss(arrays: list[np.ndarray]) -> float:
        return float((attention_forward(*arrays, mask=mask)[0] * d_out).sum())

    analytic = [grads.q, grads.k, grads.v]
    fd_error = _finite_difference_error(loss, [q, k, v], analytic, rng, settings)
    low = [array.astype(np.float32) for array in (q, k, v)]
    low_torch = [torch.from_numpy(array) for array in low]
    times = median_times(
        lambda: attention_forward(*low, mask=mask),
        lambda: F.scaled_dot_product_attention(*low_torch, attn_mask=torch_mask),
        settings["timing_repeats"],
    )
    return found, fd_error, times


# --- multi-head attention -----------------------------------------------------------------------


def _check_multi_head(
    rng: np.random.Generator,
    shape: tuple[int, int, int, int],
    mask: np.ndarray | None,
    settings: dict[str, Any],
) -> tuple[dict[str, float], float, list[float]]:
    """Errors of the output and of every gradient against nn.MultiheadAttention and autograd;
    finite differences; times."""
    B, H, L, D = shape
    E = H * D
    weights = _random_weights(rng, E)
    x, d_out = rng.standard_normal((B, L, E)), rng.standard_normal((B, L, E))
    out, cache = multi_head_forward(x, weights=weights, num_heads=H, mask=mask)
    grads = multi_head_backward(d_out, cache)
    module = _torch_module(weights, H, torch.float64)
    x_torch = torch.tensor(x, requires_grad=True)
    expected = _torch_forward(module, x_torch, mask)
    expected.backward(torch.from_numpy(d_out))
    found = {
        "output": _max_error(out, expected),
        "dx": _max_error(grads.x + grads.context, x_torch.grad),
    }
    torch_grads = _torch_weight_gradients(module)
    for name in WEIGHT_NAMES:
        found[GRADIENT_NAMES[name]] = _max_error(getattr(grads.weights, name), torch_grads[name])

    def loss(arrays: list[np.ndarray]) -> float:
        probe = dataclasses.replace(weights, **dict(zip(WEIGHT_NAMES, arrays[1:], strict=True)))
        return float(
            (multi_head_forward(arrays[0], weights=probe, num_heads=H, mask=mask)[0] * d_out).sum()
        )

    inputs = [x, *(getattr(weights, name) for name in WEIGHT_NAMES)]
    analytic = [grads.x + grads.context, *(getattr(grads.weights, name) for name in WEIGHT_NAMES)]
    fd_error = _finite_difference_error(loss, inputs, analytic, rng, settings)
    return found, fd_error, _multi_head_times(x, weights, H, mask, settings["timing_repeats"])


def _multi_head_times(
    x: np.ndarray, weights: MultiHeadWeights, H: int, mask: np.ndarray | None, repeats: int
) -> list[float]:
    """The float32 forward's time: the lab's, then nn.MultiheadAttention's."""
    low = {name: getattr(weights, name).astype(np.float32) for name in WEIGHT_NAMES}
    low_weights, low_x = MultiHeadWeights(**low), x.astype(np.float32)
    low_module, low_x_torch = _torch_module(weights, H, torch.float32), torch.from_numpy(low_x)
    return median_times(
        lambda: multi_head_forward(low_x, weights=low_weights, num_heads=H, mask=mask),
        lambda: _torch_forward(low_module, low_x_torch, mask),
        repeats,
    )


def _random_weights(rng: np.random.Generator, E: int) -> MultiHeadWeights:
    """Weights N(0, 1/E) (unit-variance projections of unit-variance inputs), biases N(0, 0.1)."""
    arrays = {}
    for name in WEIGHT_NAMES:
        shape = (E, E) if name.endswith("weight") else (E,)
        scale = E**-0.5 if name.endswith("weight") else 0.1
        arrays[name] = rng.standard_normal(shape) * scale
    return MultiHeadWeights(**arrays)


def _torch_module(
    weights: MultiHeadWeights, num_heads: int, dtype: torch.dtype
) -> nn.MultiheadAttention:
    """nn.MultiheadAttention holding `weights`: in_proj stacks W_q, W_k, W_v (out, in) rows."""
    E = weights.q_weight.shape[0]
    module = nn.MultiheadAttention(E, num_heads, batch_first=True, dtype=dtype)
    stacked = np.concatenate([weights.q_weight, weights.k_weight, weights.v_weight])  # (3E, E)
    biases = np.concatenate([weights.q_bias, weights.k_bias, weights.v_bias])  # (3E,)
    with torch.no_grad():
        module.in_proj_weight.copy_(torch.from_numpy(stacked))
        module.in_proj_bias.copy_(torch.from_numpy(biases))
        module.out_proj.weight.copy_(torch.from_numpy(weights.out_weight))
        module.out_proj.bias.copy_(torch.from_numpy(weights.out_bias))
    return module


def _torch_forward(
    module: nn.MultiheadAttention, x: torch.Tensor, mask: np.ndarray | None
) -> torch.Tensor:
    """Self-attention through nn.MultiheadAttention, whose boolean masks are True where
    BLOCKED: a causal (L, L) mask goes in as attn_mask, key padding (B, 1, 1, L) as
    key_padding_mask (B, L), each inverted."""
    if mask is None:
        return module(x, x, x, need_weights=False)[0]
    blocked = torch.from_numpy(~mask)
    if mask.ndim == 2:
        return module(x, x, x, attn_mask=blocked, need_weights=False)[0]
    return module(x, x, x, key_padding_mask=blocked[:, 0, 0], need_weights=False)[0]


def _torch_weight_gradients(module: nn.MultiheadAttention) -> dict[str, torch.Tensor]:
    E = module.embed_dim
    weights = module.in_proj_weight.grad.reshape(3, E, E)
    biases = module.in_proj_bias.grad.reshape(3, E)
    return {
        "q_weight": weights[0], "q_bias": biases[0], "k_weight": weights[1],
        "k_bias": biases[1], "v_weight": weights[2], "v_bias": biases[2],
        "out_weight": module.out_proj.weight.grad, "out_bias": module.out_proj.bias.grad,
    }  # fmt: skip


# --- measurements -------------------------------------------------------------------------------


def _max_error(got: np.ndarray, expected: torch.Tensor) -> float:
    return float(np.abs(got - expected.detach().numpy()).max())


def _finite_difference_error(
    loss: Callable[[list[np.ndarray]], float],
    inputs: list[np.ndarray],
    analytic: list[np.ndarray],
    rng: np.random.Generator,
    settings: dict[str, Any],
) -> float:
    """The largest |central difference - analytic| over fd_probes random entries of every
    input, relative to the largest |analytic| entry probed."""
    step, worst, scale = settings["fd_step"], 0.0, 0.0
    for index, (array, gradient) in enumerate(zip(inputs, analytic, strict=True)):
        for flat in rng.choice(
            array.size, size=min(settings["fd_probes"], array.size), replace=False
        ):
            position = np.unravel_index(flat, array.shape)
            values = []
            for sign in (1.0, -1.0):
                moved = array.copy()
                moved[position] += sign * step
                values.append(loss([*inputs[:index], moved, *inputs[index + 1 :]]))
            numeric = (values[0] - values[1]) / (2 * step)
            worst = max(worst, abs(numeric - gradient[position]))
            scale = max(scale, abs(gradient[position]))
    return float(worst / max(scale, np.finfo(np.float64).tiny))


def _row(
    case: str, module: str, found: dict[str, float], fd_error: float, times: list[float]
) -> dict[str, Any]:
    inputs = [value for name, value in found.items() if name in ("dq", "dk", "dv", "dx")]
    weights = [value for name, value in found.items() if name in GRADIENT_NAMES.values()]
    return {
        "case": case, "module": module, "output": found["output"], "input gradients": max(inputs),
        "weight gradients": max(weights) if weights else None,
        "finite differences (rel.)": fd_error, "numpy forward (ms)": times[0],
        "torch forward (ms)": times[1], "numpy / torch": times[0] / times[1],
    }  # fmt: skip


def _findings(
    rows: list[dict[str, Any]], errors: dict[str, dict[str, dict[str, float]]], limited: bool
) -> list[str]:
    flat = [
        (value, case, module, name)
        for case, modules in errors.items()
        for module, found in modules.items()
        for name, value in found.items()
    ]
    worst = max(flat)
    fd = max(rows, key=lambda row: row["finite differences (rel.)"])
    slowest = max(rows, key=lambda row: row["numpy / torch"])
    fastest = min(rows, key=lambda row: row["numpy / torch"])
    return [
        f"Over {len(errors)} cases and {len(flat)} compared quantities (outputs and every "
        f"gradient), the largest absolute difference from PyTorch and autograd in float64 is "
        f"{worst[0]:.3g} ({worst[3]}, {worst[2]}, {worst[1]}).",
        f"Central finite differences agree with the hand-written gradients to a relative "
        f"{fd['finite differences (rel.)']:.3g} at worst ({fd['module']}, {fd['case']}).",
        f"Forward in float32 on this machine, PyTorch on one thread and NumPy's BLAS "
        f"{'on one thread' if limited else 'with its default threads'}: NumPy takes "
        f"{fastest['numpy / torch']:.2g}x ({fastest['module']}, {fastest['case']}) to "
        f"{slowest['numpy / torch']:.2g}x ({slowest['module']}, {slowest['case']}) PyTorch's "
        f"time.",
    ]


def figure(result: StudyResult):
    """The largest absolute error against PyTorch of every quantity (log axis), one marker per
    case, attention and multi-head side by side."""
    from matplotlib.figure import Figure

    errors = result.series["errors"]
    fig = Figure(figsize=(13, 4.6))
    axes = fig.subplots(1, 2, gridspec_kw={"width_ratios": [4, 10]}, sharey=True)
    floor = 1e-18  # an exact match (error 0) is drawn here
    for ax, module in zip(axes, ("attention", "multi-head"), strict=True):
        for index, (case, modules) in enumerate(errors.items()):
            names = list(modules[module])
            values = [max(modules[module][name], floor) for name in names]
            ax.plot(range(len(names)), values, "o", color=f"C{index}", label=case,
                    alpha=0.8)  # fmt: skip
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.axhline(np.finfo(np.float64).eps, color="grey", linestyle=":",
                   label="float64 epsilon")  # fmt: skip
        ax.set(yscale="log", title=module)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"max |NumPy - PyTorch|, float64 (0 drawn at {floor:g})")
    axes[1].legend(fontsize=7)
    fig.suptitle(TITLE)
    fig.tight_layout()
    return fig


ROUNDING, FINITE = 1e-10, 1e-5  # float64 rounding on these sizes; central differences' error
WHY = "the cases are a few small shapes."


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """The claim from the table: the largest differences from PyTorch per case and module."""
    compared = ("output", "input gradients", "weight gradients")
    worst = max(row[key] for row in rows for key in compared if row[key] is not None)
    finite = max(row["finite differences (rel.)"] for row in rows)
    return [Verdict(
        "NumPy attention gives PyTorch's outputs and autograd's gradients to float64 rounding",
        grade((worst <= ROUNDING) + (finite <= FINITE), 2),
        f"Supported if every output and gradient is within {ROUNDING:g} of PyTorch's (float64) "
        f"and central finite differences agree within {FINITE:g} relative; mixed if one holds.",
        f"largest difference {worst:.3g}, finite differences {finite:.3g}", WHY)]  # fmt: skip
