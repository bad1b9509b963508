"""ggml's block formats (the tensor types of GGUF files) dequantized in PyTorch, and quantized to
Q4_0, Q4_1 and Q8_0 (`quantize_q4_0`, `quantize_q4_1`, `quantize_q8_0`), byte for byte as ggml.

A GGUF tensor is stored row by row (a row: the innermost dimension, GGUF's ne[0]), and each
row is cut into blocks of a fixed number of values; a block is a fixed number of bytes holding
one or two scales and the values' small integer codes. The formats are defined by ggml's C
code (ggml-common.h declares the block structs, ggml-quants.c's dequantize_row_* reads them);
the gguf Python package ships a numpy port of the same reader, which is the reference the tests
hold this module to, bit for bit. All multi-byte fields are little-endian; "f16" is IEEE half.

Plain types (one value per "block"):
    F32   4 bytes: float32.          F16   2 bytes: float16.
    BF16  2 bytes: the top half of a float32 (value = bits << 16).

Legacy types (32 values per block; nibbles: byte i of qs holds value i in its low 4 bits and
value i + 16 in its high 4 bits):
    Q4_0  18 bytes: d (f16), 16 bytes of nibbles; x = d * (q - 8).
    Q4_1  20 bytes: d, m (f16), 16 bytes of nibbles; x = d * q + m.
    Q5_0  22 bytes: d (f16), qh (4 bytes: bit i = fifth bit of value i), 16 bytes of nibbles;
          x = d * (q - 16).
    Q5_1  24 bytes: d, m (f16), qh (4 bytes), 16 bytes of nibbles; x = d * q + m.
    Q8_0  34 bytes: d (f16), 32 int8; x = d * q.

K-quants (super-blocks of 256 values, cut into sub-blocks of 32 or 16; see quants_k.py):
    Q2_K  84 bytes: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit codes, d, dmin (f16);
          x = d * scale * q - dmin * min, 16 sub-blocks of 16.
    Q3_K  110 bytes: hmask (32 bytes of third bits), 64 bytes of 2-bit codes, 12 bytes of
          6-bit scales (offset 32), d (f16); x = d * (scale - 32) * q, q in -4..3.
    Q4_K  144 bytes: d, dmin (f16), 12 bytes packing 8 six-bit scales and 8 six-bit mins
          (low 6 bits of bytes 0-7, the rest split into nibbles of bytes 8-11 plus the spare top
          2 bits of bytes 0-7), 128 bytes of nibbles (each run of 32 bytes: low nibbles for one
          sub-block, high nibbles for the next); x = d * scale * q - dmin * min, 8 of 32.
    Q5_K  176 bytes: as Q4_K, with 32 bytes of fifth bits (bit j of byte i: value i of
          sub-block j) between the scales and the nibbles.
    Q6_K  210 bytes: ql (128 bytes of low nibbles), qh (64 bytes of 2-bit high parts),
          16 int8 scales, d (f16); x = d * scale * (q - 32), 16 sub-blocks of 16.

The arithmetic follows the reference's order exactly: scales are widened from f16 to float32
first and every product and sum is rounded to float32 on its own (no fused multiply-add).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from qkv.models.gguf.quants_k import (
    dequantize_q2_k,
    dequantize_q3_k,
    dequantize_q4_k,
    dequantize_q5_k,
    dequantize_q6_k,
    f16_field,
    unpack_bits,
)

__all__ = [
    "BLOCK_FORMATS",
    "BlockFormat",
    "decode_blocks",
    "dequantize",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q8_0",
]

# values per chunk of blocks dequantized at once: bounds the temporaries to a few MiB
CHUNK_VALUES = 1 << 20


class BlockFormat(NamedTuple):
    """A ggml type's block: its ggml type id, values per block and bytes per block."""

    type_id: int
    values: int
    nbytes: int


BLOCK_FORMATS: dict[str, BlockFormat] = {
    "F32": BlockFormat(0, 1, 4),
    "F16": BlockFormat(1, 1, 2),
    "Q4_0": BlockFormat(2, 32, 18),
    "Q4_1": BlockFormat(3, 32, 20),
    "Q5_0": BlockFormat(6, 32, 22),
    "Q5_1": BlockFormat(7, 32, 24),
    "Q8_0": BlockFormat(8, 32, 34),
    "Q2_K": BlockFormat(10, 256, 84),
    "Q3_K": BlockFormat(11, 256, 110),
    "Q4_K": BlockFormat(12, 256, 144),
    "Q5_K": BlockFormat(13, 256, 176),
    "Q6_K": BlockFormat(14, 256, 210),
    "BF16": BlockFormat(30, 1, 2),
}
_NAMES_BY_ID = {fmt.type_id: name for name, fmt in BLOCK_FORMATS.items()}


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)  # (n, 4) bytes -> (n, 1)


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float16).float()  # (n, 2) bytes -> (n, 1)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks.view(torch.int16).to(torch.int32) << 16).view(torch.float32)  # (n, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 16) bytes -> (n_blocks, 32): the 16 low nibbles, then the 16 high nibbles."""
    return unpack_bits(qs, 4).reshape(qs.shape[0], 32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 4) bytes, one little-endian uint32 -> (n_blocks, 32): bit i, at 16."""
    bits = unpack_bits(qh, 1)  # (n_blocks, 8, 4): [bit in byte, byte]
    return bits.transpose(1, 2).reshape(qh.shape[0], 32) << 4


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 2:18]).float().sub_(8).mul_(f16_field(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:20]).float()
    return q.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])
    return q.float().sub_(16).mul_(f16_field(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8])).float()
    return q.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:34].view(torch.int8).float().mul_(f16_field(blocks, 0))


_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32,
    "F16": _f16,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": dequantize_q2_k,
    "Q3_K": dequantize_q3_k,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
}


def _kind_name(kind: object) -> str:
    """A type name, a ggml type id or a gguf.GGMLQuantizationType (an int) -> our type name."""
    if isinstance(kind, str) and kind.upper() in BLOCK_FORMATS:
        return kind.upper()
    if isinstance(kind, int) and not isinstance(kind, bool) and int(kind) in _NAMES_BY_ID:
        return _NAMES_BY_ID[int(kind)]
    label = f"{kind.name} ({int(kind)})" if hasattr(kind, "name") else repr(kind)
    raise ValueError(
        f"kind: {label} is not a ggml type qkv can dequantize; supported: "
        + ", ".join(f"{name} ({fmt.type_id})" for name, fmt in BLOCK_FORMATS.items())
    )


def _checked_shape(shape: Sequence[int], name: str) -> tuple[int, ...]:
    dims = tuple(int(dim) for dim in shape)
    if any(dim < 0 for dim in dims):
        raise ValueError(f"shape: {dims} has a negative dimension")
    block = BLOCK_FORMATS[name].values
    if block > 1 and (not dims or dims[-1] % block):
        last = dims[-1] if dims else "none (a scalar)"
        raise ValueError(
            f"shape: the last dimension of {dims} is {last}, not a multiple of the {name} "
            f"block size {block} (ggml blocks never straddle rows)"
        )
    return dims


def _as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The raw bytes as a flat uint8 tensor, without a copy unless numpy's array is read-only."""
    if isinstance(raw, np.ndarray):
        if not raw.dtype.isnative:
            raise ValueError(f"raw: byte order {raw.dtype.byteorder!r}; GGUF data is little-endian")
        flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        # torch warns on (and must never write to) read-only arrays such as GGUFReader's memmap
        raw = torch.from_numpy(flat if flat.flags.writeable else flat.copy())
    elif not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw: expected a torch.Tensor or numpy.ndarray, got {type(raw).__name__}")
    return raw.detach().contiguous().reshape(-1).view(torch.uint8)


def dequantize(
    raw: torch.Tensor | np.ndarray, kind: str | int, shape: Sequence[int]
) -> torch.Tensor:
    """Decode a GGUF tensor's data into a new float32 tensor of `shape`.

    raw: the tensor's bytes, any shape and dtype (GGUFReader's uint8 rows, or its float32 /
    float16 arrays for F32 / F16). kind: the ggml type, by name ("Q4_1"), by id (3) or as a
    gguf.GGMLQuantizationType. shape: PyTorch order, outermost first (GGUF's ne reversed).
    """
    name = _kind_name(kind)
    dims = _checked_shape(shape, name)
    fmt = BLOCK_FORMATS[name]
    data = _as_bytes(raw)
    n_blocks = int(np.prod(dims, dtype=np.int64)) // fmt.values
    if data.numel() != n_blocks * fmt.nbytes:
        raise ValueError(
            f"raw: a {name} tensor of shape {dims} takes {n_blocks * fmt.nbytes} bytes, "
            f"got {data.numel()}"
        )
    blocks = data.view(n_blocks, fmt.nbytes)  # one row per block
    out = torch.empty(n_blocks, fmt.values, dtype=torch.float32, device=data.device)
    step = max(1, CHUNK_VALUES // fmt.values)
    for start in range(0, n_blocks, step):
        out[start : start + step] = _DECODERS[name](blocks[start : start + step])
    return out.view(dims)


def decode_blocks(blocks: torch.Tensor, kind: str | int) -> torch.Tensor:
    """(n, block bytes) uint8 blocks of `kind` -> (n, values per block) float32: the decoding
    `dequantize` does, without its checks of sizes against a shape (made on the host, which a
    traced graph cannot do): the caller vouches for the blocks' width."""
    return _DECODERS[_kind_name(kind)](blocks)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (C's roundf), exactly: sign(x) * (|x| rounded)."""
    size = x.abs()
    whole = size.floor()
    return x.sign() * (whole + (2 * (size - whole)).floor())


def _quantize_q8_0_blocks(x: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 32) float32 -> (n_blocks, 34) bytes: d = max |x| / 127, q = roundf(x / d)."""
    d = x.abs().amax(dim=1, keepdim=True) / 127  # (n_blocks, 1)
    inverse = torch.where(d == 0, 0.0, 1.0 / d)
    q = _round_half_away(x * inverse).to(torch.int8)
    return torch.cat((d.half().view(torch.uint8), q.view(torch.uint8)), dim=1)


def _quantize_q4_0_blocks(x: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 32) float32 -> (n_blocks, 18) bytes: d = -(the value of largest magnitude) / 8,
    q = min(15, trunc(x / d + 8.5)), so that the largest value maps to code 0 exactly."""
    peak = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # (n_blocks, 1), first on ties
    d = peak / -8
    inverse = torch.where(d == 0, 0.0, 1.0 / d)
    q = torch.trunc(x * inverse + 8.5).clamp_(0, 15).to(torch.uint8)
    return torch.cat((d.half().view(torch.uint8), _pack_nibbles(q)), dim=1)


def _quantize_q4_1_blocks(x: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 32) float32 -> (n_blocks, 20) bytes: m = min x, d = (max x - m) / 15,
    q = min(15, trunc((x - m) / d + 0.5))."""
    low = x.amin(dim=1, keepdim=True)  # (n_blocks, 1)
    d = (x.amax(dim=1, keepdim=True) - low) / 15
    inverse = torch.where(d == 0, 0.0, 1.0 / d)
    q = torch.trunc((x - low) * inverse + 0.5).clamp_(0, 15).to(torch.uint8)
    scales = torch.cat((d.half().view(torch.uint8), low.half().view(torch.uint8)), dim=1)
    return torch.cat((scales, _pack_nibbles(q)), dim=1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 32) codes 0..15 -> (n_blocks, 16) bytes: value i low, value i + 16 high."""
    return q[:, :16] | (q[:, 16:] << 4)


_QUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _quantize_q4_0_blocks,
    "Q4_1": _quantize_q4_1_blocks,
    "Q8_0": _quantize_q8_0_blocks,
}


def _quantize(weight: torch.Tensor, name: str) -> torch.Tensor:
    """(..., k) float -> (..., k // 32 * block bytes) uint8 in `name`'s blocks, in chunks."""
    weight = torch.as_tensor(weight).detach()
    if weight.ndim == 0 or weight.shape[-1] % 32:
        raise ValueError(f"weight: the last dimension of {tuple(weight.shape)} is not a multiple "
                         f"of the {name} block size 32")  # fmt: skip
    if not weight.is_floating_point() or not torch.isfinite(weight).all():
        raise ValueError(f"weight: {name} needs finite floating-point values")
    nbytes = BLOCK_FORMATS[name].nbytes
    blocks = weight.to(torch.float32).reshape(-1, 32)  # (n_blocks, 32)
    out = torch.empty(blocks.shape[0], nbytes, dtype=torch.uint8, device=blocks.device)
    step = CHUNK_VALUES // 32
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = _QUANTIZERS[name](blocks[start : start + step])
    return out.view(*weight.shape[:-1], weight.shape[-1] // 32 * nbytes)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Quantize to Q8_0: (..., k) float -> (..., k // 32 * 34) uint8, k a multiple of 32.

    Byte for byte what ggml's quantize_row_q8_0_ref (and gguf.quants.quantize) writes.
    """
    return _quantize(weight, "Q8_0")


def quantize_q4_0(weight: torch.Tensor) -> torch.Tensor:
    """Quantize to Q4_0: (..., k) float -> (..., k // 32 * 18) uint8, k a multiple of 32.

    Byte for byte what gguf.quants.quantize writes (the numpy port of ggml's
    quantize_row_q4_0_ref): the products and sums rounded to float32 one by one, as there.
    """
    return _quantize(weight, "Q4_0")


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """Quantize to Q4_1: (..., k) float -> (..., k // 32 * 20) uint8, k a multiple of 32.

    Byte for byte what gguf.quants.quantize writes (the numpy port of ggml's
    quantize_row_q4_1_ref).
    """
    return _quantize(weight, "Q4_1")
