"""`SquarePatches`: what a config of square images cut into square patches derives from its
`image_size` and `patch_size` fields (Dosovitskiy et al. 2021, s3.1: N = HW / P^2 patches),
shared by `ViTConfig`, `DiffusionConfig` and `VideoClassifierConfig`."""

from __future__ import annotations

__all__ = ["SquarePatches"]


class SquarePatches:
    """A mixin for a dataclass with int fields `image_size` (the side of a square image, or
    frame) and `patch_size` P."""

    def _check_patches(self) -> None:
        """ValueError naming patch_size unless it divides image_size (whole patches)."""
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size: {self.patch_size} does not divide image_size={self.image_size}; "
                f"expected a divisor (the image is cut into whole patches)"
            )

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of the patch grid."""
        side = self.image_size // self.patch_size
        return side, side

    @property
    def num_patches(self) -> int:
        """N = (image_size / P)^2 patches per image."""
        return self.grid[0] * self.grid[1]
