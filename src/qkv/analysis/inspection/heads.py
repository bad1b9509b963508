"""Which heads matter: head importance and pruning (Michel et al. 2019), and how much attention
changes its input (the cosine similarity of its input and output at each position).

Michel, Levy and Neubig, "Are Sixteen Heads Really Better than One?" (NeurIPS 2019) put a gate
xi_h in front of every head's contribution to the output projection,

    MHAtt(x) = sum_h xi_h Att_h(x),        Att_h(x) = softmax(q_h k_h^T / sqrt(D)) v_h W_o^(h),

(section 3, eq. 1; xi_h = 1 is the trained model, xi_h = 0 removes head h), and score each head
by how much the loss moves with its gate (section 4.1, eq. 2, a first-order Taylor estimate of
the effect of removing it, after Molchanov et al. 2017):

    I_h = E_x | dL(x) / d xi_h |,

normalised by the L2 norm over the heads of each layer. Pruning removes heads in increasing
order of I_h (section 4.2, Figure 3): near-identical heads are the first to go. Voita et al.
2019 rank heads by relevance and confidence, this module by Michel et al.'s gradient, the score
transformers' bertology uses.

The gates need no change to `MultiHeadAttention`: `out_proj` receives the concatenated heads
(B, L, H * D) with each head's D values contiguous, and a forward pre-hook scales each slice.
Setting xi_h = 0 equals zeroing the columns h * D .. (h + 1) * D of `out_proj.weight`.

    with head_gates(model) as gates:      # gates["blocks.0.self"]: (H,) ones
        ...
    scores = head_importance(model, batches, loss_fn)     # {"blocks.0.self": (H,), ...}
    curve = pruning_curve(model, scores, evaluate, fractions=[0.0, 0.25, 0.5])

Module names are those of `qkv.analysis.record_attention`: "layers.0.self" (BERT), "blocks.2.self"
(GPT), "encoder.3.self", "decoder.1.self", "decoder.1.cross" (encoder-decoder). A module applied
several times (BERT with shared layers) has one gate, applied at every depth.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from qkv.analysis.inspection.attention_maps import chosen_attention_modules, display_name
from qkv.layers.attention import MultiHeadAttention

__all__ = [
    "HeadGates",
    "PruningStep",
    "attention_modules",
    "head_gates",
    "head_importance",
    "position_cosine_similarity",
    "prune_heads",
    "pruning_curve",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, object], torch.Tensor]


def attention_modules(model: nn.Module) -> dict[str, MultiHeadAttention]:
    """Every `MultiHeadAttention` of `model` (or `model` itself), by its record_attention name."""
    modules: dict[str, MultiHeadAttention] = {}
    for path, module in chosen_attention_modules(model, None):
        name = display_name(path)
        if name in modules:
            raise ValueError(
                f"model: two attention modules share the name {name!r}; expected unique "
                f"names (see qkv.analysis.AttentionMap.name)"
            )
        modules[name] = module
    return modules


class HeadGates:
    """Gates xi_h (Michel et al. 2019, section 3) on every query head of a model, live until
    `remove()` (or the end of a `with` block). `gates[name]` is an (H,) tensor of the out_proj
    weight's dtype (at least float32), ones at first; change it in place (under `torch.no_grad()`)
    to scale or remove heads, or read its `.grad` after a backward pass when built with
    requires_grad. Several HeadGates on one model multiply.
    """

    def __init__(self, model: nn.Module, *, requires_grad: bool = False) -> None:
        if not isinstance(requires_grad, bool):
            raise TypeError(f"requires_grad: expected a bool, got {requires_grad!r}")
        self.gates: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module in attention_modules(model).items():
            weight = module.out_proj.weight
            dtype = torch.promote_types(weight.dtype, torch.float32)
            gate = torch.ones(module.num_heads, device=weight.device, dtype=dtype)
            self.gates[name] = gate.requires_grad_(requires_grad)
            hook = module.out_proj.register_forward_pre_hook(partial(_apply_gate, gate))
            self._handles.append(hook)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.gates:
            raise KeyError(
                f"name: {name!r} is not an attention module; expected one of {self.names()}"
            )
        return self.gates[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.gates)

    def __len__(self) -> int:
        return len(self.gates)

    def names(self) -> list[str]:
        return list(self.gates)

    def remove(self) -> None:
        """Take the gates out: the model computes exactly as before they were put in."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> HeadGates:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def _apply_gate(gate: torch.Tensor, module: nn.Linear, args: tuple) -> tuple:
    """out_proj pre-hook: scale head h's slice of the concatenated heads by gate[h]."""
    concatenated = args[0]  # (B, L, H * D)
    heads = concatenated.unflatten(-1, (gate.shape[0], -1))  # (B, L, H, D)
    gated = heads * gate.to(concatenated.dtype)[:, None]  # x * 1.0 == x exactly
    return (gated.flatten(-2), *args[1:])  # (B, L, H * D)


def head_gates(model: nn.Module, *, requires_grad: bool = False) -> HeadGates:
    """Put a gate of 1.0 on every head of `model`; see `HeadGates`. Use as a context manager:
    `with head_gates(model) as gates: ...` removes them on exit."""
    return HeadGates(model, requires_grad=requires_grad)


def prune_heads(model: nn.Module, heads_to_prune: Mapping[str, Iterable[int]]) -> HeadGates:
    """Remove heads by setting their gates to 0: {"layers.0.self": [1, 3], ...}.

    Reversible: the returned `HeadGates` restores the model on `remove()` or at the end of a
    `with` block. Equivalent to zeroing the head's columns of out_proj.weight (the out_proj bias
    stays), and to transformers' physical `prune_heads` of the same heads.
    """
    gates = HeadGates(model)
    try:
        chosen = _check_heads_to_prune(heads_to_prune, gates)
    except (TypeError, ValueError):
        gates.remove()
        raise
    with torch.no_grad():
        for name, heads in chosen.items():
            gates[name][list(heads)] = 0.0
    return gates


def head_importance(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn,
    *,
    normalize: bool = True,
) -> dict[str, torch.Tensor]:
    """I_h = E |dL/d xi_h| for every head: {name: (H,) float tensor} (Michel et al. 2019, 4.1).

    loss_fn(model, batch) -> the scalar loss of one batch. The mean runs over batches of the
    absolute gradient of each batch's loss, as in Michel et al.'s code and transformers'
    bertology example (batches of one example give the per-example expectation). normalize:
    divide each layer's scores by their L2 norm (section 4.1: "normalizing the importance scores
    by layer"). The model runs in its current mode: call `model.eval()` first for scores without
    dropout. Only the gates get gradients; the parameters' `.grad` are left untouched.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (model, batch) -> loss, got {loss_fn!r}")
    with HeadGates(model, requires_grad=True) as gates:
        names = gates.names()
        totals = {name: torch.zeros_like(gates[name]).detach() for name in names}
        num_batches = 0
        for batch in batches:
            loss = _check_loss(loss_fn(model, batch))
            grads = torch.autograd.grad(loss, [gates[name] for name in names], allow_unused=True)
            for name, grad in zip(names, grads, strict=True):
                if grad is not None:  # None: the module did not run on this batch
                    totals[name] += grad.abs()
            num_batches += 1
    if num_batches == 0:
        raise ValueError("batches: got no batch; expected at least one")
    scores = {name: total / num_batches for name, total in totals.items()}
    return _normalize_per_layer(scores) if normalize else scores


def _normalize_per_layer(scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's scores over their L2 norm (a layer with all scores 0 stays 0)."""
    tiny = torch.finfo(torch.float32).tiny
    return {name: score / score.norm().clamp_min(tiny) for name, score in scores.items()}


def _check_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(
            f"loss_fn: expected it to return a scalar float tensor, got {_describe(loss)}"
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn: its loss does not depend on the model (no gradient); expected a loss "
            "computed from model(...) outside torch.no_grad()"
        )
    return loss.reshape(())


@dataclass(frozen=True)
class PruningStep:
    """One point of a pruning curve: `num_pruned` heads (`fraction` of all) removed, which ones
    ({name: heads}), and the metric `evaluate` returned with them removed."""

    fraction: float
    num_pruned: int
    pruned: dict[str, tuple[int, ...]]
    metric: float


def pruning_curve(
    model: nn.Module,
    importance: Mapping[str, torch.Tensor],
    evaluate: Callable[[nn.Module], float],
    fractions: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
) -> list[PruningStep]:
    """The metric as ever more of the least important heads are removed (Michel et al. 2019,
    section 4.2, Figure 3: heads pruned in increasing order of I_h, across all layers).

    importance: {name: (H,)} scores, e.g. from `head_importance`; ties keep the model's order.
    evaluate(model) -> the metric (any float: accuracy, loss, BLEU). For each fraction f, the
    round(f * total) heads of lowest importance are removed (so each step's heads include the
    previous step's), evaluate runs, and the model is restored. Returns one step per fraction.
    """
    if not callable(evaluate):
        raise TypeError(f"evaluate: expected a callable model -> float, got {evaluate!r}")
    order = _heads_by_importance(attention_modules(model), importance)
    steps = []
    for fraction in _check_fractions(fractions):
        count = round(fraction * len(order))
        pruned: dict[str, list[int]] = {}
        for name, head in order[:count]:
            pruned.setdefault(name, []).append(head)
        with prune_heads(model, pruned):
            metric = float(evaluate(model))
        logger.info("pruned %d of %d heads (%.0f%%): metric %.6g", count, len(order),
                    100 * fraction, metric)  # fmt: skip
        kept = {name: tuple(sorted(heads)) for name, heads in pruned.items()}
        steps.append(PruningStep(fraction=fraction, num_pruned=count, pruned=kept, metric=metric))
    return steps


def _heads_by_importance(
    modules: dict[str, MultiHeadAttention], importance: Mapping[str, torch.Tensor]
) -> list[tuple[str, int]]:
    """Every (name, head), least important first; ties in the model's order (a stable sort)."""
    if not isinstance(importance, Mapping) or set(importance) != set(modules):
        got = sorted(importance) if isinstance(importance, Mapping) else _describe(importance)
        raise ValueError(
            f"importance: expected scores for exactly the attention modules {list(modules)}, "
            f"got {got}"
        )
    heads, scores = [], []
    for name, module in modules.items():
        score = torch.as_tensor(importance[name]).detach().reshape(-1)
        if score.numel() != module.num_heads:
            raise ValueError(
                f"importance: {name!r} has {score.numel()} scores, expected one per head "
                f"({module.num_heads})"
            )
        heads += [(name, head) for head in range(module.num_heads)]
        scores.append(score.double().cpu())
    order = torch.cat(scores).argsort(stable=True)
    return [heads[index] for index in order.tolist()]


def _check_fractions(fractions: Sequence[float]) -> list[float]:
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Sequence) or not fractions:
        raise ValueError(f"fractions: expected a non-empty list of floats, got {fractions!r}")
    for fraction in fractions:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"fractions: expected floats in [0, 1], got {fraction!r}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fractions: expected floats in [0, 1], got {fraction!r}")
    return [float(fraction) for fraction in fractions]


def _check_heads_to_prune(
    heads_to_prune: Mapping[str, Iterable[int]], gates: HeadGates
) -> dict[str, list[int]]:
    if not isinstance(heads_to_prune, Mapping):
        raise TypeError(
            "heads_to_prune: expected a dict {name: [head, ...]}, got " + _describe(heads_to_prune)
        )
    chosen = {}
    for name, heads in heads_to_prune.items():
        if name not in gates.gates:
            raise ValueError(
                f"heads_to_prune: {name!r} is not an attention module; expected names among "
                f"{gates.names()}"
            )
        heads = list(heads)
        size = gates[name].shape[0]
        for head in heads:
            if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < size:
                raise ValueError(
                    f"heads_to_prune: {name!r} has head {head!r}; expected ints in [0, {size})"
                )
        chosen[name] = heads
    return chosen


@torch.no_grad()
def position_cosine_similarity(
    module: nn.Module, inputs: torch.Tensor, **forward_kwargs: object
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Cosine similarity between the input and the output of attention, at every position.

    `cosine_similarity(x[0], output[0], dim=-1)`: a low similarity between input and output
    says that attention does substantial work, a high one that its output stays close to its
    input. module: a `MultiHeadAttention`, called as module(inputs, **forward_kwargs) with inputs
    x (B, L, E) -> (B, L). Or a model, called as model(inputs, **forward_kwargs) (e.g. input_ids
    and attention_mask=...) -> {name: (B, L_q)} for each attention module, between the x it
    reads its queries from and its output (before the residual). A module that runs several
    times (shared layers) gives "name", "name#1", ...; `torch.stack(list(result.values()))` is
    (layers, B, L) for BERT and GPT.
    """
    if isinstance(module, MultiHeadAttention):
        output = module(inputs, **forward_kwargs)
        return _cosine(inputs, output)
    similarities: dict[str, torch.Tensor] = {}
    handles = [
        attention.register_forward_hook(
            partial(_record_cosine, name, similarities), with_kwargs=True
        )
        for name, attention in attention_modules(module).items()
    ]
    try:
        module(inputs, **forward_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return similarities


def _record_cosine(
    name: str, similarities: dict, module: nn.Module, args: tuple, kwargs: dict, output: object
) -> None:
    x = args[0] if args else kwargs["x"]
    key, call = name, 0
    while key in similarities:
        call += 1
        key = f"{name}#{call}"
    similarities[key] = _cosine(x, output)


def _cosine(x: torch.Tensor, output: torch.Tensor | tuple) -> torch.Tensor:
    """(B, L, E), (B, L, E) -> (B, L), in float32 at least."""
    output = output[0] if isinstance(output, tuple) else output  # (output, weights)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return F.cosine_similarity(x.to(dtype), output.to(dtype), dim=-1)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
