"""`ViT`: the Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

    images                                                        (B, C, H, W)
    -> patches, flattened and projected (`PatchEmbedding`)        (B, N, E)      s3.1, eq. 1
    -> [class] token prepended, position embeddings added          (B, N + 1, E)  s3.1, eq. 1
    -> num_layers pre-norm encoder blocks: MSA, then a GELU MLP    (B, N + 1, E)  s3.1, eq. 2-3
    -> final LayerNorm, pooled: the [class] token's state          (B, E)         s3.1, eq. 4
    -> linear head                                                 (B, num_classes)

The encoder is that of Vaswani et al. 2017 with the LayerNorm before each sub-layer (the
paper's eq. 2-3; Xiong et al. 2020), built from qkv's `EncoderBlock(norm_first=True)`: an
image is a sequence of patch tokens, and nothing in the blocks knows it is an image. The
config chooses the pooling (the [class] token; the mean of the patch tokens, Appendix D.3; or
learned queries that cross-attend to the patch tokens, Jaegle et al. 2021's latent array,
`qkv.layers.LatentPooling`) and the position embeddings (learned, s3.1; or fixed 2-D
sinusoids, half the channels per axis, Appendix D.4). With learned positions the [class] token
has a position of its own; with 2-D sinusoids only the patches get positions.

`model(images, return_attention=True)` also returns every layer's attention weights (B, H, L,
L), the softmax(QK^T / sqrt(D)) of Vaswani et al. 2017 s3.2.1 before any dropout, from which
`qkv.analysis.inspection.attention_rollout` traces what the prediction reads (Appendix D.8).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qkv.attention import attention
from qkv.layers import EncoderBlock, LatentPooling, LayerNorm, PatchEmbedding
from qkv.layers._dropout import make_dropout
from qkv.layers.attention import MultiHeadAttention
from qkv.models._inputs import check_class_labels
from qkv.models.serialization import register_model_class
from qkv.models.sizes import check_model_fits
from qkv.models.vit_config import ViTConfig
from qkv.positional import LearnedPositionalEmbedding, Sinusoidal2DPositionalEncoding

__all__ = ["ImageClassificationOutput", "ViT", "ViTConfig"]


@dataclass(frozen=True)
class ImageClassificationOutput:
    """What `ViT` returns. logits (B, num_classes); loss: the mean cross-entropy when labels are
    given; attentions: with return_attention, each layer's weights (B, H, L, L), first layer
    first (L = config.num_tokens); pool_attention: with return_attention and latent pooling,
    the latents' cross-attention weights over the final tokens (B, H, num_latents, L)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    pool_attention: torch.Tensor | None = None


class ViT(nn.Module):
    """A Vision Transformer classifier; see the module docstring.

    Submodules: `patch_embedding` (`PatchEmbedding`), `cls_token` (1, 1, E) with pooling="cls",
    `position_embedding` (`LearnedPositionalEmbedding` over config.num_tokens positions, or
    `Sinusoidal2DPositionalEncoding` over the patch grid), `dropout`, `blocks` (num_layers
    pre-norm `EncoderBlock`s), `norm` (the final LayerNorm), `pool` (`LatentPooling`, with
    pooling="latent"), `head` (Linear(E, num_classes)).
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config: expected a ViTConfig, got {type(config).__name__}")
        check_model_fits(config)  # before allocating: sizes may come from a file
        self.config = config
        E = config.embed_dim
        self.patch_embedding = PatchEmbedding(
            image_size=config.image_size, patch_size=config.patch_size,
            channels=config.channels, embed_dim=E,
        )  # fmt: skip
        if config.pooling == "cls":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, E))  # (1, 1, E)
            nn.init.normal_(self.cls_token, std=0.02)
        if config.position == "learned":
            self.position_embedding = LearnedPositionalEmbedding(config.num_tokens, E)
        else:
            self.position_embedding = Sinusoidal2DPositionalEncoding(*config.grid, E)
        self.dropout = make_dropout(config.dropout)
        self.blocks = nn.ModuleList(_encoder_block(config) for _ in range(config.num_layers))
        self.norm = LayerNorm(E, eps=config.norm_eps)
        if config.pooling == "latent":
            self.pool = LatentPooling(
                E, config.num_heads, num_latents=config.num_latents, ffn_dim=config.ffn_dim,
                num_blocks=config.latent_blocks, dropout=config.dropout,
                activation=config.activation, eps=config.norm_eps,
            )  # fmt: skip
        self.head = nn.Linear(E, config.num_classes)

    def forward(
        self,
        images: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        return_attention: bool = False,
    ) -> ImageClassificationOutput:
        """images (B, C, H, W) -> logits (B, num_classes); labels (B,) class indices add the
        mean cross-entropy; return_attention adds the attention weights (see
        `ImageClassificationOutput`)."""
        x = self.embed(images)  # (B, L, E)
        recorded: list[torch.Tensor] = []
        with _recording(self.blocks, recorded, enabled=return_attention):
            for block in self.blocks:
                x = block(x)  # (B, L, E)
        x = self.norm(x)
        pool_attention = None
        if self.config.pooling == "cls":
            features = x[:, 0]  # (B, E): the [class] token (eq. 4)
        elif self.config.pooling == "mean":
            features = x.mean(dim=1)  # (B, E)
        else:
            pooled = self.pool(x, return_weights=return_attention)
            latents, pool_attention = pooled if return_attention else (pooled, None)
            features = latents.mean(dim=1)  # (B, num_latents, E) -> (B, E)
        logits = self.head(features)  # (B, num_classes)
        loss = None
        if labels is not None:
            check_class_labels(labels, logits.shape[0], self.config.num_classes)
            loss = F.cross_entropy(logits.float(), labels)
        return ImageClassificationOutput(
            logits=logits, loss=loss,
            attentions=tuple(recorded) if return_attention else None,
            pool_attention=pool_attention,
        )  # fmt: skip

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The encoder's input: patch embeddings, the [class] token first when there is one,
        plus positions, then dropout: (B, C, H, W) -> (B, L, E)."""
        x = self.patch_embedding(images)  # (B, N, E)
        B, N, _ = x.shape
        if self.config.position == "sinusoidal2d":  # the patches' grid positions only
            x = x + self.position_embedding(torch.arange(N, device=x.device))  # (N, E)
        if self.config.pooling == "cls":
            x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)  # (B, N + 1, E)
        if self.config.position == "learned":  # one row per token, [class] included
            x = x + self.position_embedding(torch.arange(x.shape[1], device=x.device))
        return self.dropout(x)


def _encoder_block(config: ViTConfig) -> EncoderBlock:
    """A pre-norm block (Dosovitskiy et al. 2021, eq. 2-3): x + MSA(LN(x)), then x + MLP(LN(x))."""
    return EncoderBlock(
        config.embed_dim, config.num_heads, config.ffn_dim, dropout=config.dropout,
        attention_dropout=config.attention_dropout, activation=config.activation,
        norm_first=True, eps=config.norm_eps,
    )  # fmt: skip


@contextmanager
def _recording(
    blocks: nn.ModuleList, recorded: list[torch.Tensor], *, enabled: bool
) -> Iterator[None]:
    """While inside, each block's self-attention appends its weights (B, H, L, L) to
    `recorded`, through `MultiHeadAttention.register_attention_hook`: the blocks run as they
    always do, and the weights come from `qkv.attention` on the q and k the layer attends
    with, before dropout (detached: they carry no gradient)."""
    if not enabled:
        yield
        return
    handles = [block.self_attn.register_attention_hook(_append_to(recorded)) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _append_to(recorded: list[torch.Tensor]):
    def hook(module: MultiHeadAttention, q, k, *, mask, causal, window, bias, cross, pattern):
        with torch.no_grad():
            _, weights = attention(
                q, k, k, mask=mask, causal=causal, window=window, bias=bias,
                return_weights=True,
            )  # fmt: skip
        recorded.append(weights)  # (B, H, L, L)

    return hook


register_model_class(ViT, ViTConfig)
