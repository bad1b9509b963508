"""`DiffusionUNet`: a text-conditioned noise predictor eps_theta(x_t, t, prompt) with a small U-Net
body, the denoiser of DDPM and of latent diffusion, beside `DiffusionTransformer` (the DiT).

A U-Net (Ronneberger et al. 2015) works on the image as a grid: convolutions, a downsampling to
half the resolution and back, and a skip connection that carries the full-resolution features
across. Ho et al. 2020 (Appendix B) add the timestep to every residual block and self-attention
at the coarse resolutions; Rombach et al. 2022 (s3.3) make it read a prompt by inserting, at
each such place, a Transformer block whose cross-attention takes the encoded prompt as keys and
values. Here, on H x W images (8 x 8 digits: 64 and then 16 positions):

    x_t -> conv 3x3                                           (B, E, H, W)
    ResBlock(t), SpatialTransformer(prompt)                   (B, E, H, W)       kept: skip
    conv 3x3 stride 2, ResBlock(t), SpatialTransformer         (B, E, H/2, W/2)
    upsample x2, conv 3x3, concat skip, ResBlock(t),
    SpatialTransformer                                         (B, E, H, W)
    GroupNorm, SiLU, conv 3x3 (zero at initialisation)         (B, C, H, W)      the noise

ResBlock(t): GroupNorm, SiLU, conv 3x3, plus a linear map of the timestep's embedding per
channel, GroupNorm, SiLU, dropout, conv 3x3, and the residual (a 1 x 1 conv where the widths
differ). SpatialTransformer: GroupNorm, the positions as H*W tokens of width E through one
pre-norm `DecoderBlock` without a causal mask (self-attention over the positions,
cross-attention to the prompt's tokens with its padding masked, FFN), back to the grid, plus the
residual. The timestep and prompt encoders are the DiT's (`PromptDenoiser`). Of the config, the
U-Net uses embed_dim (every level's width), num_heads, ffn_dim, activation, norm_eps and dropout;
num_layers and patch_size are the Transformer's, unused here; conditioning must be "add" (the
timestep added, the prompt by cross-attention, as the U-Net takes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import DecoderBlock
from qkv.models.diffusion_config import DiffusionConfig
from qkv.models.diffusion_prompt import PromptDenoiser
from qkv.models.serialization import register_model_class

__all__ = ["DiffusionUNet", "ResBlock", "SpatialTransformer"]

GROUPS = 8  # GroupNorm's groups (Wu & He 2018), as DDPM's U-Net normalises


class ResBlock(nn.Module):
    """x + conv(SiLU(GN(conv(SiLU(GN(x))) + W t_emb))): (B, C_in, H, W), (B, E) -> (B, C_out,
    H, W); the residual through a 1 x 1 conv where C_in != C_out (Ho et al. 2020, App. B)."""

    def __init__(self, in_channels: int, out_channels: int, time_dim: int, *, dropout: float):
        super().__init__()
        self.norm1 = nn.GroupNorm(GROUPS, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time = nn.Linear(time_dim, out_channels)
        self.norm2 = nn.GroupNorm(GROUPS, out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        same = in_channels == out_channels
        self.skip = nn.Identity() if same else nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (B, C_out, H, W)
        h = h + self.time(time)[:, :, None, None]  # the noise level, per channel
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class SpatialTransformer(nn.Module):
    """x + grid(DecoderBlock(tokens(GN(x)), prompt)): the H*W positions of a (B, E, H, W) grid
    as tokens through self-attention, cross-attention to the prompt (B, S, E) and an FFN
    (Rombach et al. 2022, s3.3). Returns (B, E, H, W)."""

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__()
        E = config.embed_dim
        self.norm = nn.GroupNorm(GROUPS, E)
        self.block = DecoderBlock(E, config.num_heads, config.ffn_dim,
                                  activation=config.activation, dropout=config.dropout,
                                  norm_first=True, eps=config.norm_eps)  # fmt: skip

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, E, H, W = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, E)
        tokens = self.block(tokens, context, memory_mask=mask, causal=False)  # (B, H*W, E)
        return x + tokens.transpose(1, 2).reshape(B, E, H, W)


class DiffusionUNet(PromptDenoiser):
    """The noise predictor eps_theta(x_t, t, prompt) with a U-Net body; see the module
    docstring. Called as `DiffusionTransformer` is: (noisy_images (B, C, H, W), timesteps (B,),
    prompt_ids (B, S), prompt_mask (B, S) or None) -> the predicted noise (B, C, H, W).

    Submodules: the timestep's and the prompt's (`PromptDenoiser`), `stem`, `down` (ResBlock,
    SpatialTransformer at full resolution), `downsample`, `middle` (at half resolution),
    `upsample` (nearest x2 and a conv), `up` (ResBlock over the concatenated skip,
    SpatialTransformer), `out_norm`, `out` (zero at initialisation: no noise predicted at first).
    """

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__(config)
        _check_unet(config)
        self._build_conditioning()
        E, C, p = config.embed_dim, config.channels, config.dropout
        self.stem = nn.Conv2d(C, E, 3, padding=1)
        self.down = nn.ModuleList([ResBlock(E, E, E, dropout=p), SpatialTransformer(config)])
        self.downsample = nn.Conv2d(E, E, 3, stride=2, padding=1)
        self.middle = nn.ModuleList([ResBlock(E, E, E, dropout=p), SpatialTransformer(config)])
        self.upsample = nn.Conv2d(E, E, 3, padding=1)
        self.up = nn.ModuleList([ResBlock(2 * E, E, E, dropout=p), SpatialTransformer(config)])
        self.out_norm = nn.GroupNorm(GROUPS, E)
        self.out = nn.Conv2d(E, C, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(
        self,
        noisy_images: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        want = (self.config.channels, self.config.image_size, self.config.image_size)
        if noisy_images.dim() != 4 or tuple(noisy_images.shape[1:]) != want:
            raise ValueError(f"noisy_images: expected (B, C, H, W) = (B, *{want}), got shape "
                             f"{tuple(noisy_images.shape)}")  # fmt: skip
        mask, context, cond = self.conditions(noisy_images, timesteps, prompt_ids, prompt_mask)
        x = self.stem(noisy_images)  # (B, E, H, W)
        skip = self._level(self.down, x, cond, context, mask)  # (B, E, H, W)
        x = self._level(self.middle, self.downsample(skip), cond, context, mask)  # (B, E, H/2, W/2)
        x = self.upsample(F.interpolate(x, scale_factor=2.0, mode="nearest"))  # (B, E, H, W)
        x = self._level(self.up, torch.cat((x, skip), dim=1), cond, context, mask)
        return self.out(F.silu(self.out_norm(x)))  # (B, C, H, W)

    @staticmethod
    def _level(level: nn.ModuleList, x, cond, context, mask) -> torch.Tensor:
        """One resolution: its ResBlock (the timestep), then its SpatialTransformer (the
        prompt)."""
        residual, attention = level
        return attention(residual(x, cond), context, mask)


def _check_unet(config: DiffusionConfig) -> None:
    """What the U-Net needs of a DiffusionConfig beyond what the config checks itself."""
    if config.conditioning != "add":
        raise ValueError(
            f"conditioning: {config.conditioning!r}; the U-Net adds the timestep in its residual "
            f"blocks and reads the prompt by cross-attention: expected 'add'"
        )
    if config.image_size % 2:
        raise ValueError(f"image_size: {config.image_size} is odd; the U-Net halves the "
                         f"resolution once, so expected an even size")  # fmt: skip
    if config.embed_dim % GROUPS:
        raise ValueError(f"embed_dim: {config.embed_dim} is not a multiple of {GROUPS}, the "
                         f"GroupNorm groups")  # fmt: skip


register_model_class(DiffusionUNet, DiffusionConfig)
