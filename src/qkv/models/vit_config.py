"""`ViTConfig`: the sizes and component choices of a Vision Transformer (`qkv.models.ViT`).

    component   choices
    pooling     "cls"      a learned [class] token; the head reads its final state
                           (Dosovitskiy et al. 2021, s3.1, eq. 4)
                "mean"     the mean of the patch tokens' final states (global average
                           pooling; Dosovitskiy et al. 2021, Appendix D.3)
                "latent"   learned queries cross-attend to the patch tokens, the head reads
                           their mean (Jaegle et al. 2021, the Perceiver's latent array)
    position    "learned"       a trained vector per position (the paper's default, s3.1)
                "sinusoidal2d"  fixed sinusoids, half the channels per axis (Appendix D.4)

The presets: "vit-base-16" is ViT-Base/16 (Dosovitskiy et al. 2021, Table 1: 12 layers,
E = 768, MLP 3072, 12 heads; 224 x 224 RGB images, patches of 16, 1000 ImageNet classes);
"vit-digits" the model `qkv train vit` trains on the 8x8 digits; "vit-tiny" one for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.layers.attention_checks import check_heads
from qkv.layers.feedforward import ACTIVATIONS
from qkv.models.patch_grid import SquarePatches
from qkv.validation import (
    check_choice,
    check_int,
    check_positive_float,
    check_positive_int,
    check_probability,
    preset,
)

__all__ = ["POOLING_KINDS", "PRESETS", "VIT_POSITION_KINDS", "ViTConfig"]

POOLING_KINDS = ("cls", "mean", "latent")
VIT_POSITION_KINDS = ("learned", "sinusoidal2d")


@dataclass(frozen=True, kw_only=True)
class ViTConfig(SquarePatches):
    """Sizes and component choices of a Vision Transformer (see the module docstring).

    image_size (the side of a square image), patch_size P (dividing image_size), channels C,
    embed_dim E, num_layers (pre-norm encoder blocks), num_heads H, ffn_dim (the MLP's hidden
    width), num_classes, pooling and position (the kinds above), num_latents and latent_blocks
    (the latent pooling head's queries and its self-attention blocks; read only when
    pooling="latent"), activation (the MLP's; GELU in the paper), norm_eps (1e-6 in the
    paper's code), dropout (embeddings, residual branches and MLP activations) and
    attention_dropout (attention weights).
    """

    image_size: int
    patch_size: int
    channels: int
    embed_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    num_classes: int
    pooling: str = "cls"
    position: str = "learned"
    num_latents: int = 4
    latent_blocks: int = 0
    activation: str = "gelu"
    norm_eps: float = 1e-6
    dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "embed_dim", "num_layers",
                     "num_heads", "ffn_dim", "num_classes", "num_latents"):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        check_int("latent_blocks", self.latent_blocks, minimum=0)
        self._check_patches()
        check_heads(self.embed_dim, self.num_heads, self.num_heads)
        check_choice("pooling", self.pooling, POOLING_KINDS)
        check_choice("position", self.position, VIT_POSITION_KINDS)
        check_choice("activation", self.activation, tuple(ACTIVATIONS))
        if self.position == "sinusoidal2d" and self.embed_dim % 4:
            raise ValueError(
                f"embed_dim: {self.embed_dim} is not a multiple of 4; position='sinusoidal2d' "
                f"gives each axis half the channels, in sin/cos pairs"
            )
        check_positive_float("norm_eps", self.norm_eps)
        check_probability("dropout", self.dropout)
        check_probability("attention_dropout", self.attention_dropout)

    @property
    def num_tokens(self) -> int:
        """The encoder's sequence length: the patches, plus one with a [class] token."""
        return self.num_patches + (self.pooling == "cls")

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> ViTConfig:
        """A named preset (see `PRESETS`), optionally with some fields replaced.

        Example: `ViTConfig.from_name("vit-digits", pooling="mean")`.
        """
        return preset(PRESETS, name, overrides)


PRESETS: dict[str, ViTConfig] = {
    # ViT-Base/16 (Dosovitskiy et al. 2021, Table 1), at ImageNet's 224 x 224 and 1000 classes
    "vit-base-16": ViTConfig(
        image_size=224, patch_size=16, channels=3, embed_dim=768, num_layers=12, num_heads=12,
        ffn_dim=3072, num_classes=1000, dropout=0.1,
    ),
    # 8x8 grey digits in 2x2 patches: 16 patch tokens (`qkv train vit`)
    "vit-digits": ViTConfig(
        image_size=8, patch_size=2, channels=1, embed_dim=64, num_layers=4, num_heads=4,
        ffn_dim=128, num_classes=10, dropout=0.1,
    ),
    # the smallest sensible model, for tests
    "vit-tiny": ViTConfig(
        image_size=8, patch_size=4, channels=1, embed_dim=16, num_layers=2, num_heads=2,
        ffn_dim=32, num_classes=10,
    ),
}  # fmt: skip
