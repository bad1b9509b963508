"""`VideoClassifier`: a video Transformer with joint or factorised space-time attention.

    videos                                                       (B, T, C, H, W)
    -> each frame cut into patches, projected (`PatchEmbedding`)  (B, T, N, E)
    -> + space position (one per patch, shared by the frames)
       + time position (one per frame, shared by the patches)    (B, T, N, E)
    -> num_layers pre-norm blocks                                (B, T, N, E)
         "full":       attention over all T * N tokens (Arnab et al. 2021, ViViT, model 1)
         "factorized": attention within each frame, then across the frames at each patch
                       position, then the FFN (ViViT model 3; Bertasius et al. 2021,
                       TimeSformer, divided space-time attention)
    -> final LayerNorm, mean over all T * N tokens                (B, E)
    -> linear head                                               (B, num_classes)

The patch embedding is ViT's (Dosovitskiy et al. 2021, s3.1) applied to every frame, ViViT's
"uniform frame sampling" tokenisation (s3.2). The blocks are `qkv.layers.SpaceTimeBlock` and
`qkv.layers.FactorizedBlock`; the mean pooling avoids a [class] token, which has no place in
the frame-by-frame and position-by-position reshapes of the factorised blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers._dropout import make_dropout
from qkv.layers.attention import check_heads
from qkv.layers.factorized_attention import FactorizedBlock, SpaceTimeBlock
from qkv.layers.feedforward import ACTIVATIONS
from qkv.layers.norms import LayerNorm
from qkv.layers.patch_embedding import PatchEmbedding
from qkv.models._inputs import check_class_labels
from qkv.models.outputs import ClassificationOutput
from qkv.models.patch_grid import SquarePatches
from qkv.models.serialization import register_model_class
from qkv.positional import LearnedPositionalEmbedding
from qkv.validation import (
    check_choice,
    check_positive_float,
    check_positive_int,
    check_probability,
    describe,
    preset,
)

__all__ = ["VIDEO_ATTENTION_KINDS", "VIDEO_PRESETS", "VideoClassifier", "VideoClassifierConfig"]

VIDEO_ATTENTION_KINDS = {"full": SpaceTimeBlock, "factorized": FactorizedBlock}


@dataclass(frozen=True, kw_only=True)
class VideoClassifierConfig(SquarePatches):
    """Sizes of a `VideoClassifier`: frames T, image_size (the side of a square frame),
    patch_size P (dividing image_size), channels C, embed_dim E, num_layers, num_heads H,
    ffn_dim, num_classes, attention ("full" or "factorized"), activation (the FFN's),
    norm_eps, dropout (embeddings, attention weights, FFN activations, residual branches)."""

    frames: int
    image_size: int
    patch_size: int
    channels: int
    embed_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    num_classes: int
    attention: str = "factorized"
    activation: str = "gelu"
    norm_eps: float = 1e-6
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("frames", "image_size", "patch_size", "channels", "embed_dim",
                     "num_layers", "num_heads", "ffn_dim", "num_classes"):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        self._check_patches()
        check_heads(self.embed_dim, self.num_heads, self.num_heads)
        check_choice("attention", self.attention, tuple(VIDEO_ATTENTION_KINDS))
        check_choice("activation", self.activation, tuple(ACTIVATIONS))
        check_positive_float("norm_eps", self.norm_eps)
        check_probability("dropout", self.dropout)

    @property
    def num_tokens(self) -> int:
        """T * N tokens per clip."""
        return self.frames * self.num_patches

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> VideoClassifierConfig:
        """A preset of `VIDEO_PRESETS`, with some fields replaced."""
        return preset(VIDEO_PRESETS, name, overrides)


VIDEO_PRESETS: dict[str, VideoClassifierConfig] = {
    # 6 frames of 16x16 digit videos (`qkv.data.digit_video`) in 4x4 patches: 96 tokens a clip
    "video-digits": VideoClassifierConfig(
        frames=6, image_size=16, patch_size=4, channels=1, embed_dim=48, num_layers=2,
        num_heads=4, ffn_dim=96, num_classes=10,
    ),
    # the smallest sensible model, for tests
    "video-tiny": VideoClassifierConfig(
        frames=3, image_size=8, patch_size=4, channels=1, embed_dim=16, num_layers=1,
        num_heads=2, ffn_dim=32, num_classes=4,
    ),
}  # fmt: skip


class VideoClassifier(nn.Module):
    """A video classifier; see the module docstring.

    Submodules: `patch_embedding` (`PatchEmbedding` of one frame), `space_position` (a
    `LearnedPositionalEmbedding` of N rows), `time_position` (T rows), `dropout`, `blocks`
    (num_layers `SpaceTimeBlock`s or `FactorizedBlock`s), `norm`, `head` (Linear(E, classes)).
    """

    def __init__(self, config: VideoClassifierConfig) -> None:
        super().__init__()
        if not isinstance(config, VideoClassifierConfig):
            raise TypeError(
                f"config: expected a VideoClassifierConfig, got {type(config).__name__}"
            )
        self.config = config
        E = config.embed_dim
        self.patch_embedding = PatchEmbedding(
            image_size=config.image_size, patch_size=config.patch_size,
            channels=config.channels, embed_dim=E,
        )  # fmt: skip
        self.space_position = LearnedPositionalEmbedding(config.num_patches, E)
        self.time_position = LearnedPositionalEmbedding(config.frames, E)
        self.dropout = make_dropout(config.dropout)
        block = VIDEO_ATTENTION_KINDS[config.attention]
        self.blocks = nn.ModuleList(
            block(E, config.num_heads, config.ffn_dim, dropout=config.dropout,
                  activation=config.activation, eps=config.norm_eps)
            for _ in range(config.num_layers)
        )  # fmt: skip
        self.norm = LayerNorm(E, eps=config.norm_eps)
        self.head = nn.Linear(E, config.num_classes)

    def forward(
        self, videos: torch.Tensor, labels: torch.Tensor | None = None
    ) -> ClassificationOutput:
        """videos (B, T, C, H, W) -> logits (B, num_classes); labels (B,) class indices add
        the mean cross-entropy."""
        x = self.embed(videos)  # (B, T, N, E)
        for block in self.blocks:
            x = block(x)  # (B, T, N, E)
        features = self.norm(x).mean(dim=(1, 2))  # (B, E): every token of the clip
        logits = self.head(features)  # (B, num_classes)
        loss = None
        if labels is not None:
            check_class_labels(labels, logits.shape[0], self.config.num_classes)
            loss = F.cross_entropy(logits.float(), labels)
        return ClassificationOutput(logits=logits, loss=loss)

    def embed(self, videos: torch.Tensor) -> torch.Tensor:
        """Patch embeddings of every frame plus space and time positions, then dropout:
        (B, T, C, H, W) -> (B, T, N, E)."""
        config = self.config
        expected = (config.frames, config.channels, config.image_size, config.image_size)
        if not isinstance(videos, torch.Tensor) or tuple(videos.shape[1:]) != expected:
            shape = ", ".join(map(str, expected))
            raise ValueError(f"videos: expected shape (B, {shape}) (B, T, C, H, W), got "
                             f"{describe(videos)}")  # fmt: skip
        B, T = videos.shape[:2]
        frames = self.patch_embedding(videos.flatten(0, 1))  # (B * T, N, E)
        x = frames.view(B, T, *frames.shape[1:])  # (B, T, N, E)
        x = x + self.space_position.weight + self.time_position.weight[:, None]  # (N, E), (T, 1, E)
        return self.dropout(x)


register_model_class(VideoClassifier, VideoClassifierConfig)
