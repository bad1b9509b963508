"""Direct logit attribution, and attention weights set against gradient x input.

`direct_logit_attribution` splits one target logit into the direct terms of the residual
stream (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits", s2.3, the
"direct path"; as TransformerLens computes it): the embeddings, each head of each layer, each
MLP, and the biases, each read through the final norm frozen at the scale of the real stream.

`attention_vs_attribution` is the check of "Attention is not Explanation" (Jain & Wallace
2019; Wiegreffe & Pinter 2019, "Attention is not not Explanation"): per layer, the Spearman
rank correlation between the attention weights from one position, averaged over heads, and the
gradient x input attribution of a target logit to each source position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.analysis.inspection.hooks import _check_model, hooks, run_with_cache
from qkv.layers.norms import LayerNorm, RMSNorm
from qkv.models.bert_heads import BertForPreTraining
from qkv.models.gpt import GPT

__all__ = [
    "AttentionAttribution",
    "LogitAttribution",
    "attention_vs_attribution",
    "direct_logit_attribution",
    "spearman",
]


@dataclass(frozen=True)
class LogitAttribution:
    """The direct terms of a target logit. heads (B, N, H), mlps (B, N), embed (B,), rest (B,):
    their sum is the model's logit, up to floating-point rounding (`total`)."""

    heads: torch.Tensor
    mlps: torch.Tensor
    embed: torch.Tensor
    rest: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        """(B,) the sum of every term: the model's own target logit, up to rounding."""
        return self.heads.sum((1, 2)) + self.mlps.sum(1) + self.embed + self.rest


@dataclass(frozen=True)
class AttentionAttribution:
    """correlation (B, N): per row and layer, Spearman's rho over the source positions
    between attention (N, B, S), the weights from `position` averaged over heads, and
    attribution (B, S), gradient x input of the target logit; S = position + 1 for a GPT, L
    for BERT."""

    correlation: torch.Tensor
    attention: torch.Tensor
    attribution: torch.Tensor


def direct_logit_attribution(
    model: GPT, input_ids: torch.Tensor, target_ids: torch.Tensor, *, position: int = -1
) -> LogitAttribution:
    """Each component's direct contribution to logits[b, position, target_ids[b]].

    The last block's resid_post x is a sum of terms: the embeddings (resid_pre of block 0,
    token plus learned or sinusoidal positions), per layer each head's head_out through its
    D columns of out_proj (Elhage et al. 2021, s2.3), out_proj's bias, and the MLP's output
    (down_proj's bias included: the MLP is one term). The final norm is frozen at the scale s it
    computes on the real x: RMSNorm, s = sqrt(mean(x^2) + eps), and each term c becomes
    c / s * weight; LayerNorm, s = sqrt(var(x) + eps), and each term becomes
    (c - mean(c)) / s * weight, the means of the terms summing to mean(x). Each is then dotted
    with lm_head's row of the target. `rest` holds out_proj's biases and the final LayerNorm's
    bias (zero for a model with neither). Computed in float64 from the float activations; the
    sum of the parts (`total`) is the model's logit when its dropout is off (eval mode).
    """
    _check_direct_model(model)
    batch, length = _check_ids(input_ids)
    target_ids = _check_targets(model, target_ids, batch)
    position = _check_position(position, length)
    n = len(model.blocks)
    names = [f"blocks.{i}.{p}" for i in range(n) for p in ("attn.head_out", "mlp.out")]
    _, cache = run_with_cache(
        model, input_ids, ["blocks.0.resid_pre", f"blocks.{n - 1}.resid_post"] + names
    )
    at = _at(position)
    readout = _readout(model, cache[f"blocks.{n - 1}.resid_post"][:, position], target_ids)
    heads, mlps, biases = [], [], []
    for i, block in enumerate(model.blocks):
        terms = _head_terms(block.self_attn.out_proj, at(cache[f"blocks.{i}.attn.head_out"]))
        heads.append(readout(terms))  # (B, H)
        mlps.append(readout(at(cache[f"blocks.{i}.mlp.out"])))  # (B,)
        if block.self_attn.out_proj.bias is not None:
            biases.append(readout(block.self_attn.out_proj.bias.double().expand(batch, -1)))
    rest = sum(biases, _norm_bias(model, target_ids))  # (B,)
    return LogitAttribution(
        heads=torch.stack(heads, dim=1),  # (B, N, H)
        mlps=torch.stack(mlps, dim=1),  # (B, N)
        embed=readout(at(cache["blocks.0.resid_pre"])),  # (B,)
        rest=rest,
    )


def attention_vs_attribution(
    model: GPT | BertForPreTraining,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    position: int = -1,
) -> AttentionAttribution:
    """Attention from `position` against gradient x input of logits[b, position, target[b]].

    Attention: each layer's softmax weights (`attn.pattern`) from `position` to the sources,
    averaged over heads. Gradient x input: the embeddings that enter block 0 (resid_pre,
    positions included; BERT's after its embedding LayerNorm) are replaced by a leaf tensor
    requiring grad; per source position, sum over E of d logit / d x * x (Jain & Wallace 2019,
    s3; Wiegreffe & Pinter 2019). A GPT's sources are 0 .. position: later positions get no
    attention and no gradient (causal). A `BertForPreTraining` (its masked-LM logits, e.g. at a
    [MASK]) attends both ways: every position is a source, so rows are not padded (no
    attention_mask). Returns the Spearman correlation per row and layer with both pieces
    (`AttentionAttribution`).
    """
    if not isinstance(model, BertForPreTraining):
        _check_model(model)
    batch, length = _check_ids(input_ids)
    target_ids = _check_targets(model, target_ids, batch)
    position = _check_position(position, length)
    sources = length if isinstance(model, BertForPreTraining) else position + 1
    patterns: dict[str, torch.Tensor] = {}
    leaf: list[torch.Tensor] = []

    def make_leaf(tensor: torch.Tensor, name: str) -> torch.Tensor:
        leaf.append(tensor.detach().requires_grad_(True))
        return leaf[0]

    def keep(tensor: torch.Tensor, name: str) -> None:
        patterns[name] = tensor.detach()[:, :, position, :sources].mean(1)  # (B, S)

    edits = {"blocks.0.resid_pre": make_leaf, "blocks.*.attn.pattern": keep}
    with torch.enable_grad(), hooks(model, edits):
        logits = model(input_ids).logits  # (B, L, V)
        chosen = logits[torch.arange(batch), position, target_ids]  # (B,)
        (grad,) = torch.autograd.grad(chosen.sum(), leaf[0])  # (B, L, E)
    attribution = (grad * leaf[0].detach()).sum(-1)[:, :sources].float()  # (B, S)
    attention = torch.stack([patterns[f"blocks.{i}.attn.pattern"] for i in range(len(patterns))])
    correlation = spearman(attention.float(), attribution.expand_as(attention))  # (N, B)
    return AttentionAttribution(correlation.T, attention, attribution)


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation along the last axis: the Pearson correlation of the ranks,
    ties given their average rank (as scipy.stats.spearmanr). x, y (..., n) -> (...) float64; NaN
    where either is constant. O(n^2) memory per row: meant for sequence lengths."""
    if x.shape != y.shape or x.ndim == 0 or x.shape[-1] < 2:
        raise ValueError(
            f"x, y: expected two tensors of one shape (..., n), n >= 2; got {tuple(x.shape)} "
            f"and {tuple(y.shape)}"
        )
    rx, ry = _ranks(x.double()), _ranks(y.double())  # (..., n)
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
    return (rx * ry).sum(-1) / (rx.square().sum(-1) * ry.square().sum(-1)).sqrt()


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks along the last axis, ties averaged: #below + (#equal + 1) / 2."""
    below = (x.unsqueeze(-1) > x.unsqueeze(-2)).sum(-1)  # (..., n): count of x_j < x_i
    equal = (x.unsqueeze(-1) == x.unsqueeze(-2)).sum(-1)  # (..., n): itself included
    return below.double() + (equal.double() + 1) / 2


def _at(position: int):
    def at(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:, position].double()  # (B, E) or (B, H, D)

    return at


def _head_terms(out_proj: torch.nn.Linear, head_out: torch.Tensor) -> torch.Tensor:
    """head_out (B, H, D) -> each head's term of out_proj's output (B, H, E), no bias."""
    heads = head_out.shape[1]
    weight = out_proj.weight.double().unflatten(1, (heads, -1))  # (E, H, D)
    return torch.einsum("bhd,ehd->bhe", head_out, weight)  # (B, H, E)


def _readout(model: GPT, resid: torch.Tensor, target_ids: torch.Tensor):
    """term (B, ..., E) -> its logit (B, ...) through the frozen final norm and lm_head."""
    norm, x = model.final_norm, resid.double()  # (B, E)
    if isinstance(norm, RMSNorm):
        scale, centre = (x.square().mean(-1) + norm.eps).sqrt(), False  # (B,)
    elif isinstance(norm, LayerNorm):
        scale, centre = (x.var(-1, unbiased=False) + norm.eps).sqrt(), True
    else:
        raise TypeError(f"model: expected a final RMSNorm or LayerNorm, got {type(norm).__name__}")
    weight = norm.weight.double() if norm.weight is not None else 1.0
    rows = model.lm_head.weight[target_ids].double() * weight  # (B, E)

    def readout(term: torch.Tensor) -> torch.Tensor:
        if centre:
            term = term - term.mean(-1, keepdim=True)
        if term.ndim == 3:  # (B, H, E): one term per head
            return (term * rows[:, None]).sum(-1) / scale[:, None]  # (B, H)
        return (term * rows).sum(-1) / scale  # (B,)

    return readout


def _norm_bias(model: GPT, target_ids: torch.Tensor) -> torch.Tensor:
    """(B,) the final norm's bias read by lm_head's target rows (zero without a bias)."""
    rows = model.lm_head.weight[target_ids].double()  # (B, E)
    bias = getattr(model.final_norm, "bias", None)
    return rows @ bias.double() if bias is not None else rows.new_zeros(rows.shape[0])


def _check_ids(input_ids: torch.Tensor) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        seen = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"input_ids: expected token ids (B, L), got {seen!r}")
    return input_ids.shape[0], input_ids.shape[1]


def _check_direct_model(model: GPT) -> None:
    """Direct logit attribution is the GPT's alone: a BERT block ends in a LayerNorm over the
    residual sum, and its masked-LM head applies a GELU, so no sum of direct terms makes its
    logit."""
    if isinstance(model, BertForPreTraining):
        raise TypeError(
            "model: direct logit attribution needs a qkv.models.GPT (pre-norm: the residual "
            "stream is a sum); a BertForPreTraining's post-norm blocks and the GELU of its "
            "masked-LM head make its logits no sum of direct terms (its "
            "attention_vs_attribution, logit_lens and patching work)"
        )
    _check_model(model)


def _check_targets(model: GPT | BertForPreTraining, target_ids, batch: int) -> torch.Tensor:
    target_ids = torch.as_tensor(target_ids)
    table = (
        model.bert.embeddings.token_embedding.weight  # the masked-LM head's tied decoder
        if isinstance(model, BertForPreTraining)
        else model.lm_head.weight
    )
    vocab = table.shape[0]
    if target_ids.shape != (batch,) or target_ids.is_floating_point():
        raise ValueError(
            f"target_ids: expected one token id per row, shape ({batch},), got "
            f"{tuple(target_ids.shape)} {target_ids.dtype}"
        )
    if ((target_ids < 0) | (target_ids >= vocab)).any():
        raise ValueError(f"target_ids: expected token ids in [0, {vocab}), got {target_ids}")
    return target_ids.to(table.device)


def _check_position(position: int, length: int) -> int:
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(f"position: expected an int, got {position!r}")
    if not -length <= position < length:
        raise ValueError(f"position: expected an index in [-{length}, {length}), got {position}")
    return position % length
