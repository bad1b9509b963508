"""qkv.models.gguf.quants against the gguf package's numpy reference, bit for bit.

Every comparison is on the float32 bit patterns (so -0.0 != 0.0), with NaNs compared by
position only (their payloads are not part of the format).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from qkv.models.gguf import quants
from qkv.models.gguf.quants import BLOCK_FORMATS, dequantize, quantize_q8_0

ALL_KINDS = list(BLOCK_FORMATS)
# the types gguf.quants.quantize can write (the K-quants it can only read)
QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
BLOCK_KINDS = [name for name in ALL_KINDS if BLOCK_FORMATS[name].values > 1]
# byte offsets of the float16 fields (d, dmin / m) inside one block
F16_FIELDS = {
    "F16": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip


def reference(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf's own dequantization, as a float32 tensor of `shape` (copied out of any memmap)."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf scales of random bytes
        out = reference_dequantize(raw, GGMLQuantizationType[name])
    return torch.from_numpy(np.array(out, dtype=np.float32)).reshape(shape)


def assert_same_bits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    nans = torch.isnan(ours)
    assert torch.equal(nans, torch.isnan(expected)), "NaNs at different positions"
    ours_bits = torch.where(nans, 0.0, ours).view(torch.int32)
    expected_bits = torch.where(nans, 0.0, expected).view(torch.int32)
    different = ours_bits != expected_bits
    assert not different.any(), (
        f"{int(different.sum())} values differ, e.g. {ours[different][:4].tolist()} "
        f"instead of {expected[different][:4].tolist()}"
    )


def check(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    ours = dequantize(raw, name, shape)
    assert_same_bits(ours, reference(raw, name, shape))
    return ours


def test_block_formats_are_ggmls():
    for name, fmt in BLOCK_FORMATS.items():
        kind = GGMLQuantizationType[name]
        assert (fmt.type_id, (fmt.values, fmt.nbytes)) == (kind, gguf.GGML_QUANT_SIZES[kind])


def weights(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Normal rows at scales from 1e-4 to 1e4, plus a zero row, a negative constant row and a
    row of exact halves (ties for the rounding)."""
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-4, 4, size=(rows, 1))
    x[0] = 0.0
    x[1] = -3.0
    x[2] = np.arange(cols) % 32 - 15.5
    return x.astype(np.float32)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_data_quantized_by_gguf_dequantizes_as_gguf_does(name):
    x = weights(np.random.default_rng(0), 12, 256)
    raw = reference_quantize(x, GGMLQuantizationType[name])  # F32 / F16: typed arrays
    ours = check(raw, name, x.shape)
    assert (ours - torch.from_numpy(x)).abs().max() <= np.abs(x).max() / 4


@pytest.mark.parametrize("finite_scales", [False, True], ids=["any-bytes", "finite-scales"])
@pytest.mark.parametrize("name", ALL_KINDS)
def test_random_bytes_dequantize_as_gguf_does(name, finite_scales):
    fmt = BLOCK_FORMATS[name]
    rows, blocks_per_row = 6, 3
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (rows, blocks_per_row, fmt.nbytes), dtype=np.uint8)
    if finite_scales:  # clear the top exponent bit of every float16: |scale| < 2, never inf/NaN
        for offset in F16_FIELDS.get(name, []):
            raw[..., offset + 1] &= 0xBF
    ours = check(raw.reshape(rows, -1), name, (rows, blocks_per_row * fmt.values))
    if finite_scales and name != "F32" and name != "BF16":
        assert torch.isfinite(ours).all()


def edge_blocks(name: str) -> np.ndarray:
    """Blocks of all-equal quant bytes (0x00, 0xFF, alternating bits, nibble patterns) under
    zero, negative zero, negative, subnormal, largest and tiny scales."""
    scales = np.array([0.0, -0.0, -1.5, 2.0**-24, 65504.0, -6.1e-5, 1.0], dtype=np.float16)
    fields = F16_FIELDS[name]
    blocks = []
    for fill in (0x00, 0xFF, 0x0F, 0xF0, 0x55, 0xAA, 0x80):
        for i, scale in enumerate(scales):
            block = np.full(BLOCK_FORMATS[name].nbytes, fill, dtype=np.uint8)
            for j, offset in enumerate(fields):  # a second field (min): another scale
                value = scales[(i + 3 * j) % len(scales)] if j else scale
                block[offset : offset + 2] = np.array([value]).view(np.uint8)
            blocks.append(block)
    return np.stack(blocks)


@pytest.mark.parametrize("name", BLOCK_KINDS)
def test_edge_blocks_dequantize_as_gguf_does(name):
    raw = edge_blocks(name)
    check(raw, name, (raw.shape[0], BLOCK_FORMATS[name].values))


def test_16_bit_floats_are_accepted_in_any_dtype():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 8)) * 100).astype(np.float32)
    halves = x.astype(np.float16)
    expected = check(halves, "F16", x.shape)
    assert_same_bits(dequantize(halves.view(np.uint8), "F16", x.shape), expected)
    assert_same_bits(dequantize(torch.from_numpy(halves), "F16", x.shape), expected)
    brains = reference_quantize(x, GGMLQuantizationType.BF16)  # uint8, two bytes per value
    expected = check(brains, "BF16", x.shape)
    assert_same_bits(torch.from_numpy(x).bfloat16().float(), expected)
    for raw in (brains.view(np.uint16), brains.view(np.int16), torch.from_numpy(brains)):
        assert_same_bits(dequantize(raw, "BF16", x.shape), expected)
    assert_same_bits(dequantize(torch.from_numpy(x).bfloat16(), "BF16", x.shape), expected)


def test_f32_is_copied_not_aliased():
    x = torch.arange(6, dtype=torch.float32)
    out = dequantize(x, "F32", (2, 3))
    x[0] = 42.0
    assert out[0, 0] == 0.0 and out.shape == (2, 3)


def test_kind_by_name_id_or_gguf_enum():
    raw = edge_blocks("Q8_0")
    shape = (raw.shape[0], 32)
    expected = dequantize(raw, "Q8_0", shape)
    for kind in ("q8_0", 8, GGMLQuantizationType.Q8_0):
        assert_same_bits(dequantize(raw, kind, shape), expected)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "F16"])
def test_chunked_decoding_equals_one_pass(name, monkeypatch):
    fmt = BLOCK_FORMATS[name]
    raw = np.random.default_rng(3).integers(0, 256, (5, 7 * fmt.nbytes), dtype=np.uint8)
    shape = (5, 7 * fmt.values)
    expected = dequantize(raw, name, shape)
    monkeypatch.setattr(quants, "CHUNK_VALUES", 3 * fmt.values)  # 35 blocks in chunks of 3
    assert_same_bits(dequantize(raw, name, shape), expected)


def test_any_number_of_dims():
    raw = np.random.default_rng(4).integers(0, 256, (2, 3, 2 * 20), dtype=np.uint8)
    out = check(raw, "Q4_1", (2, 3, 64))
    assert out.shape == (2, 3, 64)
    assert dequantize(np.zeros(0, np.uint8), "Q8_0", (0, 32)).shape == (0, 32)
    assert dequantize(np.ones(1, np.float32), "F32", ()).shape == ()


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("kind", ["Q9_9", 16, GGMLQuantizationType.IQ2_XXS, None, True])
def test_unknown_kind_is_refused_by_name(kind):
    with pytest.raises(ValueError, match=r"kind: .* supported: F32 \(0\), F16 \(1\), Q4_0"):
        dequantize(np.zeros(34, np.uint8), kind, (32,))
    if kind is GGMLQuantizationType.IQ2_XXS:
        with pytest.raises(ValueError, match="IQ2_XXS"):
            dequantize(np.zeros(66, np.uint8), kind, (256,))


def test_wrong_byte_count_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"raw: a Q8_0 tensor of shape \(2, 32\) takes 68 bytes, got 67"
    ):
        dequantize(np.zeros(67, np.uint8), "Q8_0", (2, 32))
    with pytest.raises(ValueError, match=r"raw: .* takes 16 bytes, got 12"):
        dequantize(np.zeros(3, np.float32), "F32", (4,))
    with pytest.raises(ValueError, match="raw: byte order"):
        dequantize(np.zeros(4, ">f4"), "F32", (4,))
    with pytest.raises(TypeError, match="raw: expected a torch.Tensor or numpy.ndarray"):
        dequantize(bytes(34), "Q8_0", (32,))


@pytest.mark.parametrize("shape", [(2, 33), (48,), ()])
def test_rows_cut_inside_a_block_are_refused_by_name(shape):
    with pytest.raises(ValueError, match=r"shape: .* not a multiple of the Q8_0 block size 32"):
        dequantize(np.zeros(68, np.uint8), "Q8_0", shape)


def test_negative_dims_are_refused_by_name():
    with pytest.raises(ValueError, match="shape: .* negative"):
        dequantize(np.zeros(0, np.uint8), "Q4_0", (-1, 32))


# ----------------------------------------------------------------------------- Q8_0 writing


def test_quantize_q8_0_writes_ggufs_bytes():
    x = weights(np.random.default_rng(5), 64, 256)
    x[3, :32] = np.arange(32) - 15.5 + 127 * (np.arange(32) == 0)  # d = 1: exact ties
    x[4] *= 1e-3  # a float16 scale in the subnormals
    x[5] *= 1e6  # a float16 scale past 65504: inf
    ours = quantize_q8_0(torch.from_numpy(x))
    expected = reference_quantize(x, GGMLQuantizationType.Q8_0)
    assert ours.dtype == torch.uint8 and ours.shape == expected.shape == (64, 8 * 34)
    assert np.array_equal(ours.numpy(), expected)
    back = dequantize(ours, "Q8_0", x.shape)[6:]  # the finite rows of ordinary scales
    assert torch.allclose(back, torch.from_numpy(x[6:]), rtol=0, atol=float(np.abs(x).max()))


def test_quantize_q8_0_takes_any_float_dtype_and_shape():
    x = torch.from_numpy(weights(np.random.default_rng(6), 6, 64)).reshape(2, 3, 64)
    for weight in (x.half(), x.bfloat16(), x.double()):
        expected = reference_quantize(weight.float().numpy(), GGMLQuantizationType.Q8_0)
        assert np.array_equal(quantize_q8_0(weight).numpy(), expected)


def test_quantize_q8_0_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="weight: .* multiple of the Q8_0 block size 32"):
        quantize_q8_0(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="weight: Q8_0 needs finite"):
        quantize_q8_0(torch.full((32,), float("nan")))


# ----------------------------------------------------------------------------- the real file


def check_real(file, names: list[str]) -> None:
    """file: SmolLM2-135M-Instruct's GGUF (Q4_1, a Q8_0 token embedding), as read_gguf maps it."""
    for name in names:
        tensor = file.tensors[name]
        ours = dequantize(tensor.raw, tensor.kind, tensor.shape)
        assert_same_bits(ours, reference(tensor.raw, tensor.kind, tensor.shape))


def test_real_q8_0_token_embedding(smollm2_file):
    embedding = smollm2_file.tensors["token_embd.weight"]
    assert embedding.kind == "Q8_0"
    assert embedding.shape == (49152, 576)
    check_real(smollm2_file, ["token_embd.weight"])


def test_real_q4_1_and_f32_tensors(smollm2_file):
    by_kind: dict[str, list[str]] = {}
    for tensor in smollm2_file.tensors.values():
        by_kind.setdefault(tensor.kind, []).append(tensor.name)
    assert len(by_kind["Q4_1"]) == 210
    check_real(smollm2_file, by_kind["Q4_1"][:4] + by_kind["Q4_1"][-2:] + by_kind["F32"][:2])
