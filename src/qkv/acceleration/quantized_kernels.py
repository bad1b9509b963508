"""The kernels behind `QuantizedLinear` (quantized.py): how GGUF blocks are laid out for each
product, and the products. Shapes: blocks (out, in // 32 * block bytes) uint8, rows (N, in).

- int4pack (Q4_0, Q4_1): `int4pack_layout`, `int4pack_product` (PyTorch's
  `_weight_int4pack_mm_for_cpu`: w = (q - 8) * scale + zero per group of 32, bf16);
- int4pack-pair (Q8_0): `int4pack_pair_layout`, the same product over [x, x], and for a
  prompt's rows fp32 chunks of the codes taken back out of it (`int4pack_pair_codes`);
- int8-blockwise (Q8_0): `int8_layout`, `int8_blockwise_product` (fp32, exact weights), and
  `int8_reduction_product`, the same product written as one reduction for a compiled graph
  (`int8_words_reduction_product` over `int8_words` where PyTorch's kernels are AVX2).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qkv.capabilities import Support
from qkv.models.gguf.quants import BLOCK_FORMATS, dequantize, quantize_q4_1

__all__ = [
    "BLOCK",
    "INT4PACK_OPS",
    "SCRATCH_VALUES",
    "graph_int8_reductions",
    "int4pack_layout",
    "int4pack_pair_blockwise_product",
    "int4pack_pair_chunked_product",
    "int4pack_pair_codes",
    "int4pack_pair_layout",
    "int4pack_pair_rows",
    "int4pack_product",
    "int4pack_products",
    "int4pack_row_block",
    "int8_blockwise_product",
    "int8_chunked_product",
    "int8_layout",
    "int8_reduction_product",
    "int8_words",
    "int8_words_chunked_product",
    "int8_words_inputs",
    "int8_words_reduction_product",
]

BLOCK = 32  # values per block of every kind here, and int4pack's group size
INT4PACK_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
_VECTORISED = ("AVX2", "AVX512")  # the ISAs int4pack's CPU kernel has vector code for
# fp32 values dequantized at once by the Q8_0 kernel: a scratch of 2 MiB, kept in cache
SCRATCH_VALUES = 1 << 19
# the pair layout's rows are padded to a multiple of this: whole blocks of int4pack's CPU
# layout, whose blocks are 64 output rows (AVX-512) or 32 (AVX2) (`int4pack_row_block`)
PAIR_ROW_PADDING = 64


def int4pack_products() -> Support:
    """Can PyTorch's int4pack CPU kernel serve Q4_0/Q4_1 products here? The build must have
    its ops, PyTorch's kernels must dispatch to AVX2 or AVX-512 (elsewhere, e.g. under
    ATEN_CPU_CAPABILITY=default, the kernel is a scalar loop, tens of times slower than
    F.linear), and one product on a tiny weight must be right."""
    missing = [op for op in INT4PACK_OPS if not hasattr(torch.ops.aten, op)]
    if missing:
        return Support(False, f"this PyTorch build lacks the int4pack ops {missing}")
    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in _VECTORISED:
        return Support(False, f"PyTorch's kernels dispatch to {isa} here, and int4pack's CPU "
                              "kernel is vectorised for AVX2 and AVX-512 only")  # fmt: skip
    return _int4pack_proved()


@functools.cache
def _int4pack_proved() -> Support:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 2 * BLOCK, generator=generator)  # (out, in)
    x = torch.randn(3, 2 * BLOCK, generator=generator)
    blocks = quantize_q4_1(weight)
    try:
        y = int4pack_product(x, *int4pack_layout(blocks, "Q4_1", 16, 2 * BLOCK), 16)
    except RuntimeError as error:
        first_line = (str(error).strip().splitlines() or ["no message"])[0]
        return Support(False, f"PyTorch's int4pack product failed here: {first_line}")
    expected = F.linear(x, dequantize(blocks, "Q4_1", (16, 2 * BLOCK)))
    if not torch.allclose(y.float(), expected, rtol=0.02, atol=0.05):
        return Support(False, "PyTorch's int4pack product gave wrong results here")
    isa = torch.backends.cpu.get_cpu_capability()
    return Support(True, f"PyTorch's int4pack ops, with {isa} vector code")


def int4pack_layout(
    blocks: torch.Tensor, kind: str, out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 blocks packed for `_weight_int4pack_mm_for_cpu` (the layout of this process's
    ISA): (packed codes, (groups, out + padding, 2) bf16 scales and zeros). The output rows are
    padded to a multiple of 16, as the packing requires (scale 0, zero 0)."""
    groups = in_features // BLOCK
    fields = blocks.reshape(out_features, groups, BLOCK_FORMATS[kind].nbytes)
    d = _f16(fields, 0)  # (out, groups)
    zero = _f16(fields, 2) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)  # exact: f64
    codes = fields[..., -BLOCK // 2 :]  # (out, groups, 16): value i low, value i + 16 high
    q = torch.cat((codes & 15, codes >> 4), dim=-1).reshape(out_features, in_features)
    padding = -out_features % 16
    q = F.pad(q.to(torch.int32), (0, 0, 0, padding))  # (out + padding, in)
    scales_and_zeros = F.pad(torch.stack((d, zero), dim=-1), (0, 0, 0, 0, 0, padding))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # each value rounded once from its exact float64
    return packed, scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)


def int4pack_pair_layout(
    blocks: torch.Tensor, out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks as one int4pack weight of (out, 2 in): the high nibbles h of q + 128 (scale
    16d, zero 0: (h - 8) 16d = 16dh - 128d), then the low ones l (scale d, zero 8d: dl); their
    sum over [x, x] is x (d q)^T. Rows padded to PAIR_ROW_PADDING (scale 0, zero 0)."""
    groups = in_features // BLOCK
    fields = blocks.reshape(out_features, groups, BLOCK_FORMATS["Q8_0"].nbytes)
    d = _f16(fields, 0)  # (out, groups) float64
    q = fields[..., 2:].view(torch.int8).to(torch.int32) + 128  # (out, groups, 32) in [0, 255]
    codes = torch.cat(((q >> 4).reshape(out_features, in_features),
                       (q & 15).reshape(out_features, in_features)), dim=1)  # fmt: skip
    padding = -out_features % PAIR_ROW_PADDING
    codes = F.pad(codes, (0, 0, 0, padding))  # (out + padding, 2 in)
    high = torch.stack((16 * d, torch.zeros_like(d)), dim=-1)  # (out, groups, 2)
    low = torch.stack((d, 8 * d), dim=-1)
    scales_and_zeros = F.pad(torch.cat((high, low), dim=1), (0, 0, 0, 0, 0, padding))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed, scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)


@functools.cache
def int4pack_row_block() -> int | None:
    """Output rows per block of int4pack's CPU layout here (64 where PyTorch's kernels are
    AVX-512, 32 AVX2), learned by packing a known weight: None where neither layout below is
    what this PyTorch writes, and the pair's codes cannot be read back (`int4pack_pair_codes`).
    In a block of B rows the values of input k are B / 2 bytes, byte i holding row i in its
    low nibble and row B / 2 + i in its high one."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (2 * PAIR_ROW_PADDING, 64), generator=generator)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    except (AttributeError, RuntimeError):  # no such op in this build, or it refused
        return None
    for block in (64, 32):
        halves = values.view(-1, 2, block // 2, 64)  # (blocks, low/high nibble, i, k)
        bytes_ = (halves[:, 0] | halves[:, 1] << 4).transpose(1, 2)  # (blocks, k, i)
        if torch.equal(bytes_.flatten().to(torch.uint8), packed.flatten()):
            return block
    return None


def int4pack_pair_codes(packed: torch.Tensor, row_block: int) -> torch.Tensor:
    """The Q8_0 codes of whole blocks of a pair layout's rows, taken back out of it: packed
    (n, in) uint8 rows of `int4pack_pair_layout`, n a multiple of `row_block`
    (`int4pack_row_block`) -> (n, in // 32, 32) int8, the blocks' own codes."""
    n, in_features = packed.shape
    nibbles = packed.view(n // row_block, 2, in_features, row_block // 2)  # (b, h/l, k, i)
    high, low = nibbles[:, 0], nibbles[:, 1]
    first = (high & 15) << 4 | low & 15  # q + 128 of the block's rows i
    second = high & 0xF0 | low >> 4  # of rows row_block / 2 + i
    shifted = torch.stack((first, second), dim=1).transpose(-1, -2)  # (b, 2, i, k)
    return (shifted ^ 0x80).reshape(n, in_features // BLOCK, BLOCK).view(torch.int8)


def int4pack_pair_blockwise_product(
    rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_block: int
) -> torch.Tensor:
    """`int8_blockwise_product` (fp32, the exact weights) over the codes of a pair layout,
    taken out of it a chunk at a time; scales (out + padding, groups, 1) fp16 or fp32. (N, in)
    -> (N, out + padding)."""
    codes = functools.partial(_pair_chunk, packed, row_block)
    return _blockwise(rows, scales, codes, row_block)


def int4pack_pair_chunked_product(
    rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_block: int
) -> torch.Tensor:
    """`int8_chunked_product` (inside a graph) over the codes of a pair layout, taken out of it
    a chunk at a time. (N, in) -> (N, out + padding)."""

    def weights(chunk: slice) -> torch.Tensor:  # (n, groups, 32)
        return _pair_chunk(packed, row_block, chunk.start, chunk.stop).float() * scales[chunk]

    return _by_chunks(rows, scales.shape, weights, row_block)


def _pair_chunk(packed: torch.Tensor, row_block: int, start: int, stop: int) -> torch.Tensor:
    return int4pack_pair_codes(packed[start:stop], row_block)


def int4pack_pair_rows(rows: torch.Tensor) -> torch.Tensor:
    """(N, in) -> (N, 2 in) bf16 [x, x]: the input of an int4pack-pair product (the high
    nibbles' groups, then the low ones')."""
    rows = rows.to(torch.bfloat16)
    return torch.cat((rows, rows), dim=1)


def int4pack_product(
    rows: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int
) -> torch.Tensor:
    """(N, in) -> (N, out) bf16. The kernel reads scales_and_zeros as contiguous whatever
    its strides (a column slice gave wrong outputs, silently): a view is copied first."""
    x = rows.to(torch.bfloat16).contiguous()
    scales = scales_and_zeros.contiguous()  # itself where it is contiguous
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scales)
    return y if y.shape[1] == out_features else y[:, :out_features]  # rows padded to 16


def int8_layout(
    blocks: torch.Tensor, out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks -> (codes (out, groups, 32) int8, a view of the blocks; scales (out,
    groups, 1) fp32)."""
    fields = blocks.reshape(out_features, in_features // BLOCK, 34)
    return fields[..., 2:].view(torch.int8), fields[..., :2].view(torch.float16).float()


def int8_blockwise_product(
    rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Q8_0: codes times fp32 scales, a cache-sized chunk of rows at a time, each chunk
    multiplied by F.linear in fp32: the exact weights, never all at once. (N, in) -> (N, out)."""
    return _blockwise(rows, scales, lambda start, stop: codes[start:stop])


def _blockwise(rows: torch.Tensor, scales: torch.Tensor, codes, multiple: int = 1) -> torch.Tensor:
    """The chunk loop of `int8_blockwise_product`: `codes(start, stop)` gives the (stop -
    start, groups, 32) int8 codes of those output rows; chunks of a multiple of `multiple`."""
    rows = rows.float()
    out_features, groups = scales.shape[:2]
    y = rows.new_empty(rows.shape[0], out_features)
    step = _chunk_rows(groups, multiple)
    scratch = rows.new_empty(min(step, out_features), groups, BLOCK)
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        weight = scratch[: stop - start].copy_(codes(start, stop))  # int8 -> fp32
        weight.mul_(scales[start:stop])  # (rows, groups, 32): dequantize's values
        y[:, start:stop] = F.linear(rows, weight.view(stop - start, -1))
    return y


def int8_reduction_product(
    rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Q8_0, as `int8_blockwise_product` computes it (fp32, the exact weights), written as one
    sum over each output's codes times its block scale times the input: inside a graph
    (torch.compile, AOTInductor) inductor makes it one streaming reduction that reads the int8
    codes and converts them in registers: for one row of SmolLM2's 49152 x 576 output layer,
    1.6 ms where the eager chunks take ~10 (Intel AVX-512, 2 threads). Eager, it would hold
    (N, out, in) fp32 at once: graphs only.
    (N, in) -> (N, out)."""
    out_features, groups, block = codes.shape
    x = rows.float().view(rows.shape[0], 1, groups, block)  # (N, 1, groups, 32)
    return (codes * x * scales).sum((-1, -2))  # (N, out, groups, 32) -> (N, out)


def int8_chunked_product(
    rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Q8_0 inside a graph, for several rows: `int8_blockwise_product`'s chunks written without
    a scratch (which a graph would copy): each chunk of output rows dequantized to fp32 (the
    exact weights) once, into a buffer that stays in cache, and multiplied by a matrix product
    for every input row at once; the chunks' outputs concatenated. Where the codes do not fit
    in cache, the one-row reduction (`int8_reduction_product`) reads them from memory again for
    each row: for 8 rows of SmolLM2's 49152 x 576 output layer, 4.5 ms here against 10.9 (Intel
    AVX-512, 2 threads). (N, in) -> (N, out)."""
    return _by_chunks(rows, codes.shape, lambda chunk: codes[chunk].float() * scales[chunk])


def _by_chunks(rows: torch.Tensor, shape: torch.Size, weights, multiple: int = 1) -> torch.Tensor:
    """The rows times each chunk of output rows' fp32 weights, `weights(chunk)` (n, groups, 32)
    for a slice of the (out, groups, ...) `shape`, one matrix product a chunk, concatenated;
    chunks of a multiple of `multiple` rows."""
    x = rows.float()
    out_features, groups = shape[:2]
    step = _chunk_rows(groups, multiple)
    starts = range(0, out_features, step)
    chunks = [x @ weights(slice(start, start + step)).flatten(1).t() for start in starts]
    return torch.cat(chunks, dim=-1)


def graph_int8_reductions() -> bool:
    """Do Q8_0 products of a few rows run as one reduction over the int8 codes inside a graph?
    Not where PyTorch's kernels (and so inductor's code) are AVX2: its vector loops load 8 int8
    values at a time through a copy (at::vec's partial load), where AVX-512's loads are masked;
    one row of SmolLM2's 49152 x 576 table reduced took 24 ms held to AVX2 against 1.4 ms, the
    int4pack pair 3.5 ms (Intel). There a layer with the pair layout takes the pair product in
    graphs for any number of rows (the codes taken out of the pair for more rows would be
    loaded the same slow way); one without (fp32 outputs) reduces over its codes kept as words
    (`int8_words`)."""
    return torch.backends.cpu.get_cpu_capability() != "AVX2"


def int8_words(codes: torch.Tensor) -> torch.Tensor:
    """Q8_0 codes (out, groups, 32) int8 -> (out, groups, 8) int32 words, a copy in which byte
    k of word j (little-endian) holds code 8k + j. Inductor's AVX2 loops load int8 values 8 at
    a time through a copy (at::vec's partial load); words load a full vector at a time, their
    bytes are taken apart in registers, and byte k of a block's 8 words are its codes 8k to
    8k + 7, which multiply 8 consecutive inputs: one row of SmolLM2's 49152 x 576 output layer
    reduced in 1.6 ms held to AVX2, against 24 from the codes (Intel, 2 threads)."""
    out_features, groups, _ = codes.shape
    order = codes.reshape(out_features, groups, 4, 8).transpose(-1, -2)  # (out, groups, j, k)
    return order.contiguous().view(out_features, groups, BLOCK).view(torch.int32)


def int8_words_inputs(rows: torch.Tensor) -> torch.Tensor:
    """Rows (N, in) in the order of `int8_words`' bytes (input 8k + j of a block where code
    8k + j is): a copy, whose product with the words' bytes read as codes, in memory order
    (`int8_blockwise_product(rows, words.view(torch.int8), scales)`), is the product."""
    return rows.reshape(rows.shape[0], -1, 4, 8).transpose(-1, -2).reshape(rows.shape)


def _word_values(words: torch.Tensor) -> list[torch.Tensor]:
    """Byte k of every word as the int8 code it holds, k = 0..3: 4 x (..., 8) int32."""
    return [(((words >> (8 * k)) & 0xFF) ^ 0x80) - 0x80 for k in range(4)]


def int8_words_reduction_product(
    rows: torch.Tensor, words: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """`int8_reduction_product` over `int8_words`' words, for graphs held to AVX2. (N, in) ->
    (N, out)."""
    out_features, groups, _ = words.shape
    x = rows.float().view(rows.shape[0], 1, groups, 4, 8)  # input 8k + j at [..., k, j]
    terms = [values * x[:, :, :, k] for k, values in enumerate(_word_values(words))]
    return ((terms[0] + terms[1] + terms[2] + terms[3]) * scales).sum((-1, -2))


def int8_words_chunked_product(
    rows: torch.Tensor, words: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """`int8_chunked_product` over `int8_words`' words: each chunk's codes taken out of its
    words, in the inputs' order, then dequantized and multiplied. (N, in) -> (N, out)."""

    def weights(chunk: slice) -> torch.Tensor:  # (n, groups, 32)
        values = torch.stack(_word_values(words[chunk]), dim=-2)  # (n, groups, 4, 8)
        return values.float().flatten(-2) * scales[chunk]

    return _by_chunks(rows, words.shape, weights)


def _chunk_rows(groups: int, multiple: int = 1) -> int:
    """Output rows of a Q8_0 weight of `groups` blocks a row dequantized at once: SCRATCH_VALUES
    fp32 values, at least 16 rows, rounded up to a multiple of `multiple`."""
    rows = max(16, SCRATCH_VALUES // (groups * BLOCK))
    return -(-rows // multiple) * multiple


def _f16(fields: torch.Tensor, offset: int) -> torch.Tensor:
    """(out, groups, bytes) blocks -> (out, groups) float64: the f16 field at byte `offset`."""
    return fields[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).double()
