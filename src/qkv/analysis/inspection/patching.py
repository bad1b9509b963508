"""Head ablation and activation patching sweeps over a qkv `GPT`, built on `hooks`.

`ablate_heads` removes heads by zero or mean ablation (Michel et al. 2019, "Are Sixteen Heads
Really Better than One?", for zeroing; mean ablation replaces a head by its average output).
`patch_sweep` is activation patching (Vig et al. 2020, "Causal Mediation Analysis"; Meng et al.
2022, "Locating and Editing Factual Associations in GPT", s2.1): run a corrupted input with one
activation of the clean run put back, for each layer and position or head, and read a metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from qkv.analysis.inspection.hooks import _check_model, hooks, run_with_cache
from qkv.models.gpt import GPT

__all__ = ["PatchSweep", "ablate_heads", "patch_sweep"]

ABLATION_MODES = ("zero", "mean")
PATCH_POINTS = ("resid_pre", "head_out", "resid_post")
Heads = Mapping[int, Sequence[int]] | Sequence[tuple[int, int]]


@dataclass(frozen=True)
class PatchSweep:
    """effects (N, L) for resid points or (N, H) for head_out: metric(logits) of the corrupt
    run with that one activation patched from the clean run; clean and corrupt: the metric of
    the unpatched runs."""

    effects: torch.Tensor
    clean: float
    corrupt: float


@contextmanager
def ablate_heads(
    model: GPT, heads: Heads, *, mode: str = "zero", mean_over: torch.Tensor | None = None
) -> Iterator[None]:
    """Inside, every forward of `model` has the chosen heads' head_out replaced.

    heads: {layer: [head, ...]} or [(layer, head), ...]. mode "zero": head_out[:, :, h] = 0,
    the head's term of out_proj vanishes (its bias stays). mode "mean": head_out[:, :, h] is
    replaced by its mean over the batch and positions, a (D,) vector at every position: with
    mean_over None the mean of the head_out that reaches the hook in each forward (after any
    ablation of earlier layers), else of a clean, unablated run of the ids `mean_over` (B', L'),
    computed once on entering. Padding positions are counted like any other.
    """
    chosen = _check_heads(model, heads)
    if mode not in ABLATION_MODES:
        raise ValueError(f"mode: expected one of {ABLATION_MODES}, got {mode!r}")
    if mean_over is not None and mode != "mean":
        raise ValueError(f"mean_over: only used with mode='mean', got mode={mode!r}")
    means: dict[str, torch.Tensor] = {}
    if mean_over is not None:
        names = [f"blocks.{layer}.attn.head_out" for layer in chosen]
        _, cache = run_with_cache(model, mean_over, names)
        means = {name: cache[name].mean((0, 1)) for name in names}  # (H, D)

    def edit(layer_heads: list[int]):
        def hook(tensor: torch.Tensor, name: str) -> torch.Tensor:
            new = tensor.clone()  # (B, L, H, D)
            if mode == "zero":
                new[:, :, layer_heads] = 0
            else:
                mean = means[name] if name in means else tensor.mean((0, 1))  # (H, D)
                new[:, :, layer_heads] = mean[layer_heads].to(tensor)
            return new

        return hook

    edits = {f"blocks.{layer}.attn.head_out": edit(hs) for layer, hs in chosen.items()}
    with hooks(model, edits):
        yield


def patch_sweep(
    model: GPT,
    clean_ids: torch.Tensor,
    corrupt_ids: torch.Tensor,
    metric: Callable[[torch.Tensor], float],
    *,
    point: str = "resid_pre",
) -> PatchSweep:
    """Activation patching: for each layer and each position (point "resid_pre" or
    "resid_post") or each head ("head_out", every position of that head at once), run
    corrupt_ids with that one activation taken from the clean run, and record metric(logits)
    (logits (B, L, V) -> a float, e.g. a logit difference). Returns `PatchSweep`; a patched
    value near `clean` marks an activation that carries what separates the two inputs
    (Meng et al. 2022, s2.1; Vig et al. 2020). One forward per entry, under torch.no_grad.
    """
    _check_model(model)
    if point not in PATCH_POINTS:
        raise ValueError(f"point: expected one of {PATCH_POINTS}, got {point!r}")
    if not isinstance(clean_ids, torch.Tensor) or clean_ids.ndim != 2:
        raise ValueError(f"clean_ids: expected token ids (B, L), got {clean_ids!r}")
    if not isinstance(corrupt_ids, torch.Tensor) or corrupt_ids.shape != clean_ids.shape:
        seen = tuple(corrupt_ids.shape) if isinstance(corrupt_ids, torch.Tensor) else corrupt_ids
        raise ValueError(
            f"corrupt_ids: expected the shape of clean_ids {tuple(clean_ids.shape)}, got {seen!r}"
        )
    if not callable(metric):
        raise TypeError(f"metric: expected a callable logits -> float, got {metric!r}")
    point_name = "attn.head_out" if point == "head_out" else point
    names = [f"blocks.{i}.{point_name}" for i in range(len(model.blocks))]
    output, cache = run_with_cache(model, clean_ids, names)
    clean = _score(metric, output.logits)
    with torch.no_grad():
        corrupt = _score(metric, model(corrupt_ids).logits)
    width = model.blocks[0].self_attn.num_heads if point == "head_out" else clean_ids.shape[1]
    effects = torch.empty(len(names), width)  # (N, L) or (N, H)
    for layer, name in enumerate(names):
        for index in range(width):
            edit = _patch(cache[name], index, heads=point == "head_out")
            with hooks(model, {name: edit}), torch.no_grad():
                effects[layer, index] = _score(metric, model(corrupt_ids).logits)
    return PatchSweep(effects=effects, clean=clean, corrupt=corrupt)


def _patch(source: torch.Tensor, index: int, *, heads: bool):
    """A hook putting source's position `index` (B, L, E), or head `index` (B, L, H, D), back."""

    def hook(tensor: torch.Tensor, name: str) -> torch.Tensor:
        new = tensor.clone()
        if heads:
            new[:, :, index] = source[:, :, index]  # (B, L, D)
        else:
            new[:, index] = source[:, index]  # (B, E)
        return new

    return hook


def _score(metric: Callable[[torch.Tensor], float], logits: torch.Tensor) -> float:
    value = metric(logits)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric: expected a float, got a tensor of shape {value.shape}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric: expected a float, got {type(value).__name__}")
    return float(value)


def _check_heads(model: GPT, heads: Heads) -> dict[int, list[int]]:
    """{layer: sorted heads}, every index checked against the model."""
    pairs = (
        [(layer, h) for layer, hs in heads.items() for h in hs]
        if isinstance(heads, Mapping)
        else list(heads)
    )
    layers, count = len(model.blocks), model.blocks[0].self_attn.num_heads
    chosen: dict[int, list[int]] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"heads: expected (layer, head) pairs, got {pair!r}")
        layer, head = pair
        if not (isinstance(layer, int) and 0 <= layer < layers):
            raise ValueError(f"heads: layer {layer!r} out of range; expected [0, {layers})")
        if not (isinstance(head, int) and 0 <= head < count):
            raise ValueError(
                f"heads: head {head!r} of layer {layer} out of range; expected [0, {count})"
            )
        chosen.setdefault(layer, []).append(head)
    if not chosen:
        raise ValueError("heads: expected at least one (layer, head), got none")
    return {layer: sorted(set(hs)) for layer, hs in sorted(chosen.items())}
