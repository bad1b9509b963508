"""`qkv viz` for a Vision Transformer: attention drawn over the image's patch grid.

A ViT (Dosovitskiy et al. 2021) reads an image as a sequence of patches, plus a [class] token
when it pools that way, so its attention rows are best read on the image itself: choose a query
(the [class] token, or a patch by clicking it) and every patch is shaded by the weight that
query puts on it, over the picture; the [class] token, which has no place on the grid, gets a
box of its own beside it. This is the layout of the attention figures in the ViT paper (s4.5,
Figure 6) and of Abnar & Zuidema 2020's attention rollout, for one layer and head at a time.
The weights are `record_attention`'s, exact from whatever backend the model runs; a ViT with
latent pooling (Jaegle et al. 2021) adds its latents' cross-attention over the patches.
"""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import torch

from qkv.analysis.inspection.attention_maps import record_attention
from qkv.analysis.pages.viz import render_page, view_data
from qkv.data import load_digits
from qkv.models import ViT, load

__all__ = ["digit_image", "image_attention_html", "load_vit", "patch_tokens", "png_data_uri"]


def image_attention_html(model: ViT, image: torch.Tensor, *, title: str | None = None) -> str:
    """Run `model` on one image (C, H, W), as the model takes it, and return the viewer page
    with every encoder layer's self-attention (and the latent pool's cross-attention) drawn
    over the patch grid. The picture is the image itself, scaled to 0..255 for display. The
    page's title is `title` followed by the class the model predicts."""
    if not isinstance(model, ViT):
        raise TypeError(f"model: expected a qkv ViT, got {type(model).__name__}")
    config = model.config
    want = (config.channels, config.image_size, config.image_size)
    if not isinstance(image, torch.Tensor) or tuple(image.shape) != want:
        got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"image: expected a tensor of shape (C, H, W) = {want}, got {got}")
    parameter = next(model.parameters())
    with record_attention(model) as recording, torch.inference_mode():
        output = model(image[None].to(parameter.device, parameter.dtype))
    tokens = patch_tokens(model)
    patches = tokens[1:] if config.pooling == "cls" else tokens
    own = [m for m in recording.maps if m.kind == "self"]
    pooled = [m for m in recording.maps if m.kind == "cross"]  # latents -> patches
    stacks = view_data(own, tokens)["stacks"]
    if pooled:
        latents = [f"latent {i}" for i in range(pooled[0].weights.shape[2])]
        stacks += view_data(pooled, latents, patches)["stacks"]
    rows, cols = config.grid
    picture = png_data_uri(image)
    for stack in stacks:
        stack["layout"] = "grid"
        stack["grid"] = {
            "rows": rows, "cols": cols, "image": picture,
            "offset": len(stack["tokens_k"]) - len(patches),  # keys before the first patch
        }  # fmt: skip
    predicted = int(output.logits[0].argmax())
    heading = f"ViT predicts class {predicted}"
    return render_page({"stacks": stacks}, f"{title}: {heading}" if title else heading)


def patch_tokens(model: ViT) -> list[str]:
    """The names of the encoder's tokens: "[CLS]" first when the model has one, then
    "patch (row, column)" in the order PatchEmbedding flattens the grid (row by row)."""
    rows, cols = model.config.grid
    names = [f"patch ({r}, {c})" for r in range(rows) for c in range(cols)]
    return ["[CLS]", *names] if model.config.pooling == "cls" else names


def png_data_uri(image: torch.Tensor) -> str:
    """An image (C, H, W), C = 1 or 3, as a data: URI of an 8-bit PNG, its values scaled from
    their minimum and maximum to 0..255 (a constant image is black)."""
    pixels = image.detach().float().cpu()
    low, high = pixels.min(), pixels.max()
    scaled = ((pixels - low) / (high - low).clamp_min(1e-12) * 255).round().to(torch.uint8)
    channels, height, width = scaled.shape
    if channels not in (1, 3):
        raise ValueError(f"image: expected 1 or 3 channels, got {channels}")
    rows = scaled.permute(1, 2, 0).reshape(height, width * channels)  # (H, W * C), RGB order
    raw = b"".join(b"\0" + bytes(row.tolist()) for row in rows)  # filter 0 before each row
    colour = 0 if channels == 1 else 2  # greyscale or truecolour (PNG spec, s11.2.2)
    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
    png += _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk: length, type, data and the CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def load_vit(path: str | Path) -> ViT:
    """The ViT saved in the qkv checkpoint folder `path` (`qkv train vit`'s), in eval mode."""
    model = load(path)
    if not isinstance(model, ViT):
        raise ValueError(
            f"--model: {path} holds a {type(model).__name__}; --digit needs a ViT checkpoint "
            "(qkv train vit)"
        )
    return model.eval()


def digit_image(index: int) -> tuple[torch.Tensor, int]:
    """(image (1, 8, 8), label) of scikit-learn's digit number `index` (0..1796), as
    `qkv.data.load_digits` gives it to `qkv train vit`."""
    digits = load_digits()
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(digits):
        raise ValueError(f"--digit: expected an index in 0..{len(digits) - 1}, got {index!r}")
    return digits.images[index], int(digits.labels[index])
