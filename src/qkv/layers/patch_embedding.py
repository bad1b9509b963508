"""Patch embedding: an image cut into non-overlapping P x P patches, each flattened and
projected to E channels, the token sequence of a Vision Transformer.

    x_p^i = flatten(patch i of the image)      (C * P * P,)
    z^i   = x_p^i W + b                        (E,)        Dosovitskiy et al. 2021, s3.1, eq. 1

An H x W image gives N = (H / P) * (W / P) patches, numbered row-major. The flattening order is
that of `torch.nn.functional.unfold`: channel, then row within the patch, then column. A
convolution with kernel P and stride P computes the same map (its kernel (E, C, P, P) is W^T
reshaped; the "hybrid" remark of Dosovitskiy et al. 2021, s3.1): `from_conv` and `to_conv`
cross over between the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.validation import check_positive_int

__all__ = ["PatchEmbedding"]


class PatchEmbedding(nn.Module):
    """(B, C, H, W) images -> (B, N, E) patch embeddings, N = (H / P) * (W / P), row-major.

    Args:
        image_size: H = W, or (H, W); each a multiple of patch_size.
        patch_size: P, the side of a square patch.
        channels: C.
        embed_dim: E.
        bias: a bias on the projection.

    Submodule `proj`: Linear(C * P * P -> E). Attributes `grid` (H / P, W / P) and
    `num_patches` N.
    """

    def __init__(
        self,
        *,
        image_size: int | tuple[int, int],
        patch_size: int,
        channels: int,
        embed_dim: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        height, width = _image_size(image_size)
        self.patch_size = check_positive_int("patch_size", patch_size)
        self.channels = check_positive_int("channels", channels)
        self.embed_dim = check_positive_int("embed_dim", embed_dim)
        for name, side in (("height", height), ("width", width)):
            if side % patch_size:
                raise ValueError(
                    f"image_size: the {name} {side} is not a multiple of patch_size="
                    f"{patch_size}; expected whole patches"
                )
        self.image_size = (height, width)
        self.grid = (height // patch_size, width // patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        patch_dim = channels * patch_size * patch_size
        self.proj = nn.Linear(patch_dim, embed_dim, bias=bias, device=device, dtype=dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) -> (B, N, E)."""
        self._check_images(images)
        P = self.patch_size
        patches = F.unfold(images, kernel_size=P, stride=P)  # (B, C * P * P, N)
        return self.proj(patches.transpose(1, 2))  # (B, N, C * P * P) -> (B, N, E)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, *, image_size: int | tuple[int, int]) -> PatchEmbedding:
        """The same map as `conv` (kernel = stride = P, no padding, dilation 1, one group),
        weights copied: conv(images).flatten(2).transpose(1, 2) == from_conv(conv)(images)."""
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv: expected a torch.nn.Conv2d, got {type(conv).__name__}")
        P = conv.kernel_size[0]
        expected = {
            "kernel_size": (P, P), "stride": (P, P), "padding": (0, 0), "dilation": (1, 1),
            "groups": 1, "padding_mode": "zeros",
        }  # fmt: skip
        for name, value in expected.items():
            if getattr(conv, name) != value:
                raise ValueError(
                    f"conv: {name}={getattr(conv, name)!r}; a patch embedding is a convolution "
                    f"with a square kernel and stride = kernel, expected {name}={value!r}"
                )
        layer = cls(
            image_size=image_size, patch_size=P, channels=conv.in_channels,
            embed_dim=conv.out_channels, bias=conv.bias is not None,
            device=conv.weight.device, dtype=conv.weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            layer.proj.weight.copy_(conv.weight.reshape(conv.out_channels, -1))  # (E, C*P*P)
            if conv.bias is not None:
                layer.proj.bias.copy_(conv.bias)
        return layer

    def to_conv(self) -> nn.Conv2d:
        """An `nn.Conv2d` (kernel = stride = P) computing the same map, weights copied."""
        P, E, C = self.patch_size, self.embed_dim, self.channels
        weight = self.proj.weight
        conv = nn.Conv2d(C, E, kernel_size=P, stride=P, bias=self.proj.bias is not None,
                         device=weight.device, dtype=weight.dtype)  # fmt: skip
        with torch.no_grad():
            conv.weight.copy_(weight.reshape(E, C, P, P))
            if self.proj.bias is not None:
                conv.bias.copy_(self.proj.bias)
        return conv

    def extra_repr(self) -> str:
        return (
            f"image_size={self.image_size}, patch_size={self.patch_size}, "
            f"channels={self.channels}, embed_dim={self.embed_dim}, grid={self.grid}"
        )

    def _check_images(self, images: torch.Tensor) -> None:
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"images: expected a torch.Tensor, got {type(images).__name__}")
        expected = (self.channels, *self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"images: expected shape (B, {', '.join(map(str, expected))}) (B, C, H, W), "
                f"got {tuple(images.shape)}"
            )
        if not images.is_floating_point():
            raise TypeError(f"images: expected a floating-point tensor, got {images.dtype}")


def _image_size(image_size: object) -> tuple[int, int]:
    if isinstance(image_size, tuple) and len(image_size) == 2:
        return (
            check_positive_int("image_size", image_size[0]),
            check_positive_int("image_size", image_size[1]),
        )
    if isinstance(image_size, tuple):
        raise ValueError(f"image_size: expected an int or a (height, width) pair, got {image_size}")
    side = check_positive_int("image_size", image_size)
    return side, side
