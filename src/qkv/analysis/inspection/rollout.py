"""Attention rollout: how much of each input token reaches each output token through the layers.

One layer's attention weights say where a token reads from in that layer's input, which is
already a mix of the tokens below. Abnar & Zuidema 2020 ("Quantifying Attention Flow in
Transformers", s3, attention rollout) follow the mixing down the stack:

    A_l = 0.5 * W_l + 0.5 * I             W_l: layer l's weights averaged over heads; I: the
                                          residual connection, which carries each token as is
    rollout_l = A_l rollout_{l-1},  rollout_1 = A_1

rollout[i, j] is then the share of output token i that comes from input token j (each row sums
to 1). Here A_l = (W_l + I) / rowsum(W_l + I), which is 0.5 W_l + 0.5 I when the rows of W_l sum
to 1, and stays a distribution when heads are fused by their maximum or minimum (each row
renormalised). Dosovitskiy et al. 2021 (Appendix D.8, Figure 6) draw the rollout of the [class]
token over the input image: `vit_rollout_map` does that for a `qkv.models.ViT`, for each of its
poolings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qkv.models.vit import ViT
from qkv.validation import check_choice

__all__ = ["HEAD_FUSIONS", "attention_rollout", "vit_rollout_map"]

HEAD_FUSIONS = ("mean", "max", "min")


def attention_rollout(
    attentions: Sequence[torch.Tensor], *, head_fusion: str = "mean", residual: bool = True
) -> torch.Tensor:
    """The rollout of a stack's self-attention weights, first layer first.

    attentions: one (B, H, L, L) or (H, L, L) tensor per layer, rows summing to 1 (e.g.
    `ViT(..., return_attention=True).attentions`). head_fusion: how the heads are combined
    ("mean" in the paper; "max" and "min" are common variants). residual: add the identity
    for the residual connection (the paper's rollout); False multiplies the raw fused weights.
    Returns (B, L, L) (or (L, L)) float32, computed in float64: entry [i, j] is the share of
    the last layer's output token i that comes from input token j.
    """
    check_choice("head_fusion", head_fusion, HEAD_FUSIONS)
    if isinstance(attentions, torch.Tensor) or not attentions:
        raise TypeError("attentions: expected a non-empty sequence of per-layer tensors")
    shape = attentions[0].shape
    rollout = None
    for index, weights in enumerate(attentions):
        if weights.shape != shape or weights.dim() not in (3, 4) or shape[-1] != shape[-2]:
            raise ValueError(
                f"attentions: layer {index} has shape {tuple(weights.shape)}; expected every "
                f"layer (B, H, L, L) or (H, L, L) with the shape of layer 0, {tuple(shape)}"
            )
        mixing = _layer_mixing(weights.double(), head_fusion, residual)  # (..., L, L)
        rollout = mixing if rollout is None else mixing @ rollout  # A_l rollout_{l-1}
    return rollout.float()


def _layer_mixing(weights: torch.Tensor, head_fusion: str, residual: bool) -> torch.Tensor:
    """(..., H, L, L) -> A_l (..., L, L): heads fused, the identity added, rows renormalised."""
    if head_fusion == "mean":
        fused = weights.mean(dim=-3)
    elif head_fusion == "max":
        fused = weights.amax(dim=-3)
    else:
        fused = weights.amin(dim=-3)
    if residual:
        fused = fused + torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    total = fused.sum(dim=-1, keepdim=True)
    return fused / total.clamp_min(torch.finfo(fused.dtype).tiny)  # an empty row stays 0


@torch.no_grad()
def vit_rollout_map(model: ViT, images: torch.Tensor, *, head_fusion: str = "mean") -> torch.Tensor:
    """Attention rollout of what `model`'s head reads, over the patch grid: (B, rows, columns).

    The readout is a distribution over the last layer's tokens: the [class] token's row of the
    rollout (pooling "cls"), the mean of every row ("mean"), or the latent queries'
    cross-attention weights, averaged over heads and latents, times the rollout ("latent").
    Each patch gets its share of that readout; with a [class] token, the share that comes from
    the token's own learned input is left out, so the map sums to at most 1. Run the model in
    eval mode (`model.eval()`): the weights are those of this forward pass.
    """
    if not isinstance(model, ViT):
        raise TypeError(f"model: expected a qkv.models.ViT, got {type(model).__name__}")
    output = model(images, return_attention=True)
    rollout = attention_rollout(output.attentions, head_fusion=head_fusion)  # (B, L, L)
    pooling = model.config.pooling
    if pooling == "cls":
        readout = rollout[:, 0]  # (B, L): the [class] token's row
    elif pooling == "mean":
        readout = rollout.mean(dim=1)  # (B, L): every token's row, averaged
    else:
        reads = output.pool_attention.double().mean(dim=(1, 2))  # (B, L): heads, latents
        readout = (reads[:, None, :] @ rollout.double()).squeeze(1).float()  # (B, L)
    patches = readout[:, 1:] if pooling == "cls" else readout  # (B, N)
    return patches.reshape(-1, *model.config.grid)  # (B, rows, columns)
