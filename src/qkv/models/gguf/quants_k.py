"""ggml's K-quants (super-blocks of 256 values) dequantized in PyTorch, and the bit helpers.

The layouts are described in `qkv.models.gguf.quants`, which dispatches to the decoders here.
Each decoder takes a (n_blocks, bytes per block) uint8 tensor and returns (n_blocks, 256)
float32, in the arithmetic order of the gguf package's numpy reference: the float16 super-block
scales are widened to float32, multiplied by the integer sub-block scales (one float32 rounding),
and only then applied to the quants (`scale * q - offset`, two more roundings, never fused).
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize_q2_k",
    "dequantize_q3_k",
    "dequantize_q4_k",
    "dequantize_q5_k",
    "dequantize_q6_k",
    "f16_field",
    "unpack_bits",
]

QK_K = 256  # values per super-block


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at byte `offset` of each block, widened: (n_blocks, 1) float32."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each byte into 8 // bits fields, lowest bits first, as a new second-to-last axis.

    (..., m) uint8 -> (..., 8 // bits, m) uint8, where [..., j, i] = (packed[..., i] >> bits * j)
    & (2**bits - 1): for bits=4, row 0 holds the low nibbles and row 1 the high nibbles.
    """
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> the 8 six-bit scales and the 8 six-bit mins, (n_blocks, 8) each.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales 4-7 and mins 4-7
    take their low 4 bits from bytes 8-11 (low / high nibble) and their top 2 bits from the spare
    top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # (n_blocks, 4) each
    scales = torch.cat((low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)), dim=1)
    mins = torch.cat((mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)), dim=1)
    return scales, mins


def _four_bit_k(nibbles: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 quant bytes, (n_blocks, 128) -> (n_blocks, 8, 32) low 4 bits.

    Each run of 32 bytes holds two sub-blocks: the low nibbles, then the high nibbles.
    """
    n_blocks = nibbles.shape[0]
    return unpack_bits(nibbles.reshape(n_blocks, 4, 32), 4).reshape(n_blocks, 8, 32)


def _affine_k(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: (d * scale) * q - (dmin * min) per sub-block; q: (n_blocks, 8, 32) uint8."""
    scales, mins = _scales_and_mins(blocks[:, 4:16])
    scale = (f16_field(blocks, 0) * scales.float()).unsqueeze(-1)  # (n_blocks, 8, 1)
    offset = (f16_field(blocks, 2) * mins.float()).unsqueeze(-1)  # (n_blocks, 8, 1)
    return q.float().mul_(scale).sub_(offset).reshape(-1, QK_K)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K, 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles."""
    return _affine_k(blocks, _four_bit_k(blocks[:, 16:144]))


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K, 176 bytes: Q4_K's header, 32 bytes of fifth bits (bit j: sub-block j), 128 nibbles."""
    fifth = unpack_bits(blocks[:, 16:48], 1)  # (n_blocks, 8, 32)
    return _affine_k(blocks, _four_bit_k(blocks[:, 48:176]) | (fifth << 4))


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K, 210 bytes: ql (128), qh (64), 16 int8 scales, d (f16); q = ql | qh << 4, minus 32.

    Each half of 128 values takes 64 ql bytes (low nibbles: values 0-63, high nibbles: 64-127)
    and 32 qh bytes (2-bit fields 0, 1, 2, 3: values 0-31, 32-63, 64-95, 96-127).
    """
    n_blocks = blocks.shape[0]
    scales = blocks[:, 192:208].view(torch.int8).float()  # (n_blocks, 16)
    scale = (f16_field(blocks, 208) * scales).unsqueeze(-1)  # (n_blocks, 16, 1)
    low = unpack_bits(blocks[:, 0:128].reshape(n_blocks, 2, 64), 4)  # (n_blocks, 2, 2, 64)
    high = unpack_bits(blocks[:, 128:192].reshape(n_blocks, 2, 32), 2)  # (n_blocks, 2, 4, 32)
    q = low.reshape(n_blocks, 8, 32) | (high.reshape(n_blocks, 8, 32) << 4)
    q = q.float().sub_(32).view(n_blocks, 16, 16)  # 16 sub-blocks of 16
    return q.mul_(scale).reshape(n_blocks, QK_K)


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K, 84 bytes: 16 scale bytes (scale: low nibble, min: high), 64 quant bytes, d, dmin.

    Each run of 32 quant bytes holds 128 values: bits 0-1 of the 32 bytes, then bits 2-3, 4-5
    and 6-7 (Q3_K's low bits are packed the same way).
    """
    n_blocks = blocks.shape[0]
    packed = blocks[:, 0:16]  # (n_blocks, 16), one byte per sub-block of 16
    scale = (f16_field(blocks, 80) * (packed & 0x0F).float()).unsqueeze(-1)  # (n_blocks, 16, 1)
    offset = (f16_field(blocks, 82) * (packed >> 4).float()).unsqueeze(-1)  # (n_blocks, 16, 1)
    q = unpack_bits(blocks[:, 16:80].reshape(n_blocks, 2, 32), 2)  # (n_blocks, 2, 4, 32)
    return q.reshape(n_blocks, 16, 16).float().mul_(scale).sub_(offset).reshape(n_blocks, QK_K)


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K, 110 bytes: hmask (32), qs (64), 12 bytes of 6-bit scales, d (f16).

    q = (2 low bits from qs) - 4 where the hmask bit is 0; scale = 6-bit scale - 32, its low 4
    bits from bytes 0-7 (low nibbles: scales 0-7, high: 8-15), its top 2 bits from bytes 8-11.
    """
    n_blocks = blocks.shape[0]
    low = unpack_bits(blocks[:, 96:104], 4).reshape(n_blocks, 16)  # (n_blocks, 2, 8) -> 16
    high = unpack_bits(blocks[:, 104:108], 2).reshape(n_blocks, 16)  # (n_blocks, 4, 4) -> 16
    scales = (low | (high << 4)).float().sub_(32)
    scale = (f16_field(blocks, 108) * scales).unsqueeze(-1)  # (n_blocks, 16, 1)
    q = unpack_bits(blocks[:, 32:96].reshape(n_blocks, 2, 32), 2).reshape(n_blocks, 16, 16)
    hmask = unpack_bits(blocks[:, 0:32], 1).reshape(n_blocks, 16, 16)  # (n_blocks, 8, 32)
    q = q.float().sub_(((hmask ^ 1) << 2).float())
    return q.mul_(scale).reshape(n_blocks, QK_K)
