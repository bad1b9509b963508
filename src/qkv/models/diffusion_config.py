"""`DiffusionConfig`: the sizes, conditioning and noise schedule of a text-conditioned diffusion
Transformer (`qkv.models.DiffusionTransformer`).

    component      choices
    conditioning   "adaln_zero"  the timestep embedding sets the shift, scale and gate of every
                                 sub-layer, zero-initialised (DiT's adaLN-Zero; Peebles & Xie
                                 2023, s3.2); the prompt enters through cross-attention
                   "add"         the timestep embedding is added to the image tokens; the
                                 blocks are plain pre-norm self-attention, cross-attention and
                                 FFN, so the prompt and the noise level both arrive by attention
                                 and the residual stream (Rombach et al. 2022, s3.3)
                   "in_context"  the timestep embedding and the encoded prompt are tokens before
                                 the image tokens, the blocks plain pre-norm self-attention and
                                 FFN, no cross-attention (DiT's in-context conditioning, s3.2)

The noise schedule is part of the model (a denoiser is trained for one): num_timesteps T and
betas rising linearly from beta_start to beta_end (Ho et al. 2020, s4: T = 1000, 1e-4 to 0.02).

The presets: "diffusion-digits", the model `qkv train diffusion` trains on the 8x8 digits
(2 x 2 patches: 16 image tokens); "diffusion-tiny", one for tests.
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

__all__ = ["CONDITIONING_KINDS", "PRESETS", "DiffusionConfig"]

CONDITIONING_KINDS = ("adaln_zero", "add", "in_context")


@dataclass(frozen=True, kw_only=True)
class DiffusionConfig(SquarePatches):
    """Sizes and choices of a text-conditioned diffusion Transformer (see the module docstring).

    image_size (the side of a square image), patch_size P (dividing image_size), channels C,
    embed_dim E, num_layers (denoiser blocks), num_heads H, ffn_dim (the FFN's hidden width),
    vocab_size (the prompt tokenizer's), max_prompt_length (the prompt positions learned),
    text_layers (pre-norm encoder blocks over the prompt; 0: its embeddings alone),
    conditioning (see above), num_timesteps T, beta_start and beta_end (the linear schedule),
    activation (the FFNs'), norm_eps, dropout.
    """

    image_size: int
    patch_size: int
    channels: int
    embed_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    vocab_size: int
    max_prompt_length: int = 16
    text_layers: int = 1
    conditioning: str = "adaln_zero"
    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    activation: str = "gelu"
    norm_eps: float = 1e-6
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "embed_dim", "num_layers",
                     "num_heads", "ffn_dim", "vocab_size", "max_prompt_length",
                     "num_timesteps"):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        check_int("text_layers", self.text_layers, minimum=0)
        self._check_patches()
        check_heads(self.embed_dim, self.num_heads, self.num_heads)
        if self.embed_dim % 2:
            raise ValueError(
                f"embed_dim: {self.embed_dim} is odd; expected an even width (the timestep's "
                f"sinusoidal embedding comes in sin/cos pairs)"
            )
        check_choice("conditioning", self.conditioning, CONDITIONING_KINDS)
        check_choice("activation", self.activation, tuple(ACTIVATIONS))
        check_positive_float("beta_start", self.beta_start)
        check_positive_float("beta_end", self.beta_end)
        if not self.beta_start <= self.beta_end < 1:
            raise ValueError(
                f"beta_end: {self.beta_end} with beta_start={self.beta_start}; expected "
                f"beta_start <= beta_end < 1 (a variance that grows and keeps some signal)"
            )
        check_positive_float("norm_eps", self.norm_eps)
        check_probability("dropout", self.dropout)

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> DiffusionConfig:
        """A named preset (see `PRESETS`), optionally with some fields replaced.

        Example: `DiffusionConfig.from_name("diffusion-digits", vocab_size=120)`.
        """
        return preset(PRESETS, name, overrides)


PRESETS: dict[str, DiffusionConfig] = {
    # 8x8 grey digits in 2x2 patches: 16 image tokens (`qkv train diffusion`)
    "diffusion-digits": DiffusionConfig(
        image_size=8, patch_size=2, channels=1, embed_dim=64, num_layers=4, num_heads=4,
        ffn_dim=256, vocab_size=256, text_layers=0,
    ),
    # the smallest sensible model, for tests
    "diffusion-tiny": DiffusionConfig(
        image_size=8, patch_size=4, channels=1, embed_dim=16, num_layers=1, num_heads=2,
        ffn_dim=32, vocab_size=256, num_timesteps=50,
    ),
}  # fmt: skip
