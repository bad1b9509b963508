"""Linear layers that stay quantized: the weight kept in GGUF's blocks, multiplied as such.

A decoding step at batch 1 reads every weight once, so its speed is the bytes it reads (Pope et
al. 2022, s2): a weight kept as 4-bit codes with a scale per block of 32 (ggml's Q4_0, Q4_1)
reads 0.56-0.63 bytes per weight where fp32 reads 4. `QuantizedLinear` holds one linear's weight
as GGUF blocks (`blocks`, the bytes a GGUF file stores; see `qkv.models.gguf.quants` for the
formats) and computes x W^T + b with the first of these kernels that this machine supports:

- "int4pack" (Q4_0, Q4_1): PyTorch's int4 weight-only product for the CPU
  (`_weight_int4pack_mm_for_cpu`, groups of 32 along the input, a scale and a zero per group),
  which computes w = (q - 8) * scale + zero. GGUF's x = d * (q - 8) (Q4_0) and x = d * q + m
  (Q4_1) are that formula with scale = d and zero = 0, or zero = m + 8d. Its vectorised code
  (AVX2, AVX-512) takes bf16 activations and bf16 scales, sums in fp32 and returns bf16: so the
  activations, the outputs and each block's scale and zero are rounded to bf16 (a block's
  values move by at most about 2^-8 of its largest magnitude); the codes are GGUF's.
- "int4pack-pair" (Q8_0): the same int4pack product, as two nibbles. A Q8_0 value d * q (q an
  int8) is d * (16 h + l - 128) with h, l the nibbles of q + 128, so one product over [x, x]
  with the codes [h | l] along the input, scale 16d and zero 0 for the h groups, scale d and
  zero 8d for the l groups, gives x W^T (the codes exact, d rounded to bf16 as above), eager
  and in compiled graphs: 2.1x faster than "int8-blockwise" for one row (AVX2). It is the
  layer's only copy of the codes: from `PAIR_ROWS` rows on (a prompt) they are taken back out
  of it a chunk at a time (`int4pack_pair_codes`) for int8-blockwise's fp32 product, and the
  file's blocks are not read again (SmolLM2 in Q8_0 holds 1.3 bytes a weight, not 2.3).
  (`_weight_int8pack_mm` takes one scale per output row, not per block: not Q8_0's values.)
- "int8-blockwise" (Q8_0 where the pair does not run, and output layers: fp32): the int8 codes
  (a view of the blocks) times their fp32 scales, dequantized a chunk of rows at a time into
  a 2 MiB scratch that stays in cache, each chunk multiplied by F.linear: the exact weights.
  In a compiled graph, fewer rows are one reduction over the codes (`_graph_product`).
- "dequantized" (the fallback): the weight dequantized once, at construction, to fp32, and
  F.linear: correct everywhere, 4 bytes per weight.

Which kernel serves is decided by what the PyTorch build and the CPU are (the ops present, the
ISA PyTorch's kernels dispatch to), never by a timing (`quantized_kernel`). An input in another
dtype is cast to the kernel's compute dtype and its output cast back (float64 is computed in
float64 from the dequantized weight: a reference path for checks). Gradients flow to the input
(the backward multiplies by the dequantized weight); the quantized weight is frozen.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qkv.acceleration.quantized_kernels import (
    BLOCK,
    INT4PACK_OPS,
    graph_int8_reductions,
    int4pack_layout,
    int4pack_pair_blockwise_product,
    int4pack_pair_chunked_product,
    int4pack_pair_layout,
    int4pack_pair_rows,
    int4pack_product,
    int4pack_products,
    int4pack_row_block,
    int8_blockwise_product,
    int8_chunked_product,
    int8_layout,
    int8_reduction_product,
    int8_words,
    int8_words_chunked_product,
    int8_words_inputs,
    int8_words_reduction_product,
)
from qkv.capabilities import Support
from qkv.models.gguf.quants import (
    BLOCK_FORMATS,
    dequantize,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
)
from qkv.positional.rope_layout import interleaved_to_half_split

__all__ = [
    "INT4PACK_OPS",
    "KINDS",
    "QuantizedLinear",
    "int4pack_products",
    "quantize_blocks",
    "quantized_kernel",
]

KINDS = ("Q4_0", "Q4_1", "Q8_0")
_QUANTIZERS = {"Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1, "Q8_0": quantize_q8_0}
# From this many rows on, a Q8_0 product dequantizes chunks for F.linear (fp32) rather than
# running the pair product, whose cost grows with the rows (AVX2, 576 x 1536: 1 row 176 us
# against 371, 16 rows 736 against 645, a 512-token prefill 23 ms against 6)
PAIR_ROWS = 16
# In a graph, int8 codes beyond a cache (more than this) are read for every row by the one-row
# reduction: from GRAPH_CHUNK_ROWS rows on their chunks are dequantized once for all rows
# (SmolLM2's 49152 x 576 output layer: 2 rows 2.8 ms reduced, 3.6 chunked; 8 rows 10.9, 4.5)
CACHED_CODES = 1 << 22
GRAPH_CHUNK_ROWS = 4


def quantize_blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """(out, in) float weight -> (out, in // 32 * block bytes) uint8 GGUF blocks of `kind`
    ("Q4_0", "Q4_1" or "Q8_0"), byte for byte what gguf.quants.quantize writes."""
    _check_kind(kind)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a 2-D (out_features, in_features) tensor, got {got}")
    return _QUANTIZERS[kind](weight)


def quantized_kernel(kind: str, *, fp32_output: bool = False) -> tuple[str, Support]:
    """(kernel name, why) for a QuantizedLinear of `kind` built now on this machine;
    `fp32_output`: a Q8_0 layer whose outputs must not be rounded to bf16 (a model's logits)."""
    _check_kind(kind)
    support = int4pack_products()
    if kind == "Q8_0" and support and not fp32_output:
        if int4pack_row_block() is not None:  # a layout qkv reads the codes back from
            return "int4pack-pair", Support(True, f"{support.reason}: one product over two "
                                                  "nibbles of each Q8_0 code, in compiled "
                                                  "steps too; a prompt's rows in fp32 chunks "
                                                  "of the codes taken out of it")  # fmt: skip
        support = Support(False, "int4pack's layout here is not one qkv can read the codes "
                                 "back from")  # fmt: skip
    if kind == "Q8_0":
        why = "fp32 outputs asked for" if fp32_output else support.reason
        codes = "the codes" if graph_int8_reductions() else "the codes, read as int32 words,"
        return "int8-blockwise", Support(True, f"{why}; Q8_0: int8 codes times fp32 block "
                                               "scales, in cache-sized chunks (public ops, "
                                               f"any CPU), one reduction over {codes} in a "
                                               "compiled step")  # fmt: skip
    if support:
        return "int4pack", support
    return "dequantized", Support(False, f"{support.reason}: dequantized once to fp32, F.linear")


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks of `kind` (Q4_0, Q4_1, Q8_0): a frozen weight.

    blocks: (out_features, in_features // 32 * block bytes) uint8 (a GGUF tensor's raw rows, or
    `quantize_blocks`'s), a torch tensor or a numpy array (copied when read-only, as a file's
    mapping is). bias: (out_features,) or None, a trainable Parameter as nn.Linear's.
    fp32_output: for a model's output layer, keep Q8_0 outputs in fp32 ("int8-blockwise"):
    logits rounded to bf16 move in steps of 1/8 around 16, which ties a greedy choice and
    coarsens sampling (Q4_0 and Q4_1 have no fp32 kernel here but the dequantized fallback).
    rope_heads: `blocks` are a q or k projection's rows in llama.cpp's interleaved RoPE order,
    for this many heads; the layer's rows are qkv's half-split order
    (`interleaved_to_half_split`), laid out from them: a file's blocks are kept, not copied in
    that order (the state dict holds them in the layer's order).
    (..., in_features) -> (..., out_features) in x's dtype; `kernel` names what computes it.
    """

    def __init__(
        self,
        blocks: torch.Tensor | np.ndarray,
        kind: str,
        *,
        bias: torch.Tensor | None = None,
        fp32_output: bool = False,
        rope_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.fp32_output, self.rope_heads = fp32_output, rope_heads
        _check_kind(kind)
        blocks = _as_block_rows(blocks, kind)
        rows = blocks.shape[0]
        if rope_heads is not None and (
            rope_heads <= 0 or rows % rope_heads or rows // rope_heads % 2
        ):
            raise ValueError(f"rope_heads: expected heads of an even size, {rows} rows in all; "
                             f"got {rope_heads}")  # fmt: skip
        self.kind = kind
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // BLOCK_FORMATS[kind].nbytes * BLOCK
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(_checked_bias(bias, self.out_features))
        self._sharing = None  # (its QuantizedSharing, its index) once it shares inputs
        self._prepare()
        self.register_load_state_dict_post_hook(lambda module, _: module._prepare())

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, kind: str = "Q4_1", *, fp32_output: bool = False
    ) -> QuantizedLinear:
        """The linear's weight quantized to `kind` (`quantize_blocks`), its bias copied."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        _check_kind(kind)
        if linear.in_features % BLOCK:
            raise ValueError(f"linear: in_features={linear.in_features} is not a multiple of "
                             f"the {kind} block size {BLOCK}")  # fmt: skip
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        blocks = quantize_blocks(linear.weight.detach(), kind)
        module = cls(blocks, kind, bias=bias, fp32_output=fp32_output)
        if module.bias is not None:
            module.bias.requires_grad_(linear.bias.requires_grad)
        return module

    def _prepare(self) -> None:
        """Choose the kernel here (`quantized_kernel`) and lay the blocks out for it, in
        buffers that are not saved (the state dict holds the blocks alone) but that
        torch.export sees, so that the exported decoding step reads them as the model's. A
        layer laid out again computes alone (its `QuantizedSharing` is dissolved)."""
        if getattr(self, "_sharing", None) is not None:
            self._sharing[0].dissolve()
        self.kernel, self.kernel_reason = quantized_kernel(self.kind, fp32_output=self.fp32_output)
        self.graph_int8_reductions = graph_int8_reductions()  # decided here: graphs read a bool
        self.row_block = int4pack_row_block() if self.kernel == "int4pack-pair" else None
        shape, blocks = (self.out_features, self.in_features), self.row_blocks()
        if self.kernel == "int4pack":
            packed, scales_and_zeros = int4pack_layout(blocks, self.kind, *shape)
            laid_out = {"packed": packed, "scales_and_zeros": scales_and_zeros}
        elif self.kernel == "int4pack-pair":  # and the file's fp16 scales for a prompt's rows
            packed, scales_and_zeros = int4pack_pair_layout(blocks, *shape)
            scales = int8_layout(blocks, *shape)[1].half()  # (out, groups, 1), exact
            scales = F.pad(scales, (0, 0, 0, 0, 0, packed.shape[0] - self.out_features))
            laid_out = {"packed": packed, "scales_and_zeros": scales_and_zeros, "scales": scales}
        elif self.kernel == "int8-blockwise":
            codes, scales = int8_layout(blocks, *shape)
            laid_out = {"codes": codes, "scales": scales}
            if not self.graph_int8_reductions:  # AVX2: the codes as words, the blocks unread
                laid_out = {"words": int8_words(codes), "scales": scales}
        else:
            laid_out = {"dense_weight": self.dequantized_weight()}
        for name in _LAID_OUT:
            self._buffers.pop(name, None)
        for name, tensor in laid_out.items():
            self.register_buffer(name, tensor, persistent=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the kernel computes in (inputs are cast to it, outputs cast back), for
        fewer than PAIR_ROWS rows (int4pack-pair's products of more rows are fp32)."""
        return torch.bfloat16 if self.kernel.startswith("int4pack") else torch.float32

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new (out_features, in_features) tensor: the blocks dequantized (bit-exact)."""
        shape = (self.out_features, self.in_features)
        return dequantize(self.row_blocks(), self.kind, shape).to(dtype)

    def row_blocks(self) -> torch.Tensor:
        """The blocks in the layer's row order: `blocks`, or (rope_heads) a reordered copy."""
        if self.rope_heads is None:
            return self.blocks
        return interleaved_to_half_split(self.blocks, self.rope_heads)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.rope_heads is not None:  # the blocks in the layer's row order
            destination[prefix + "blocks"] = self.row_blocks()

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        if self.rope_heads is not None and prefix + "blocks" in state_dict:  # the layer's order
            self.rope_heads, self.blocks = None, torch.empty_like(self.blocks)  # not the file's
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"x: expected a CPU tensor (..., {self.in_features}), got "
                             f"{tuple(x.shape)} on {x.device}")  # fmt: skip
        if x.requires_grad and torch.is_grad_enabled():
            y = _QuantizedProduct.apply(x, self)
        elif self._sharing is None or self._traced_alone():
            y = self.product(x)
        else:  # its slice of one product with the layers that read x too (quantized_sharing)
            y = self._sharing[0].product(self._sharing[1], x)
        bias = self.bias
        return y if bias is None else y + bias.to(y.dtype)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T with no bias and no autograd: (..., in) -> (..., out) in x's dtype. A decoding
        step calls this ~200 times (SmolLM2): each op here costs microseconds, so only the
        ones a shape needs run (no reshape of 2-D rows, no slice where no rows were padded)."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (N, in)
        if x.dtype == torch.float64:  # no kernel takes float64: the reference product
            y = F.linear(rows, self.dequantized_weight(torch.float64))
        else:
            y = self._kernel_product(rows)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _kernel_product(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out), in the kernel's compute dtype (fp32 where a graph reduces)."""
        if self.kernel == "int4pack":
            return int4pack_product(rows, self.packed, self.scales_and_zeros, self.out_features)
        if self.kernel == "dequantized":
            return F.linear(rows.float(), self.dense_weight)
        compiling = torch.compiler.is_compiling()
        if self.kernel == "int8-blockwise":
            if compiling:
                return self._graph_product(rows)
            if "words" in self._buffers:  # the inputs in the words' byte order
                words = self.words.view(torch.int8)
                return int8_blockwise_product(int8_words_inputs(rows), words, self.scales)
            return int8_blockwise_product(rows, self.codes, self.scales)
        # int4pack-pair; held to AVX2 a graph's uint8 loads are slow: the pair for any rows
        if rows.shape[0] < PAIR_ROWS or (compiling and not self.graph_int8_reductions):
            return int4pack_product(int4pack_pair_rows(rows), self.packed,
                                    self.scales_and_zeros, self.out_features)  # fmt: skip
        product = int4pack_pair_chunked_product if compiling else int4pack_pair_blockwise_product
        y = product(rows, self.packed, self.scales, self.row_block)  # (N, out + padding)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]

    def _graph_product(self, rows: torch.Tensor) -> torch.Tensor:
        """An int8-blockwise product inside a graph (torch.compile, torch.export), fp32 on the
        exact weights: under PAIR_ROWS rows (GRAPH_CHUNK_ROWS where the codes are more than
        CACHED_CODES) one reduction over the codes, which inductor makes one streaming pass
        (SmolLM2's 49152 x 576 output layer: 1.6 ms a row, ~10 for the eager chunks; Intel
        AVX-512, 2 threads); from there their chunks (`int8_chunked_product`), without the
        eager scratch that a graph would copy at every chunk. (N, in) -> (N, out)."""
        reduced = GRAPH_CHUNK_ROWS if self.scales.numel() * BLOCK > CACHED_CODES else PAIR_ROWS
        if "words" in self._buffers:  # held to AVX2
            if rows.shape[0] < reduced:
                return int8_words_reduction_product(rows, self.words, self.scales)
            return int8_words_chunked_product(rows, self.words, self.scales)
        if rows.shape[0] < reduced:
            return int8_reduction_product(rows, self.codes, self.scales)
        return int8_chunked_product(rows, self.codes, self.scales)

    def _traced_alone(self) -> bool:
        """Inside torch.compile's graphs each layer computes its own product (kept slices would
        be state guarded in the graph). torch.export's tracing (non-strict: the Python runs, on
        fake tensors) shares products as eager calls do, so that the exported decoding step
        holds one product per shared input."""
        return torch.compiler.is_compiling() and not torch.compiler.is_exporting()

    def requires_grad_(self, requires_grad: bool = True) -> QuantizedLinear:
        """The bias follows; the quantized weight cannot: refused when `requires_grad`."""
        if requires_grad:
            raise ValueError(
                f"requires_grad: the {self.kind} weight of this QuantizedLinear is frozen (GGUF "
                "blocks have no gradient); train its bias with bias.requires_grad_(), or a "
                "float copy of the layer"
            )
        return super().requires_grad_(False)

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(
                f"weight: a QuantizedLinear holds its weight as {self.kind} blocks (`blocks`, "
                "frozen); dequantized_weight() gives a float copy"
            )
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, kind={self.kind}, bias={self.bias is not None}, kernel={self.kernel}"


class _QuantizedProduct(torch.autograd.Function):
    """x W^T through the module's kernel; the input's gradient is grad W (dequantized)."""

    @staticmethod
    def forward(x: torch.Tensor, module: QuantizedLinear) -> torch.Tensor:
        return module.product(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.module = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
        weight = ctx.module.dequantized_weight(dtype)  # (out, in)
        return (grad.to(dtype) @ weight).to(grad.dtype), None  # (..., in)


_LAID_OUT = ("packed", "scales_and_zeros", "codes", "words", "scales", "dense_weight")


def _check_kind(kind: object) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def _as_block_rows(blocks: torch.Tensor | np.ndarray, kind: str) -> torch.Tensor:
    """(out, row bytes) uint8 blocks as a torch tensor, their size checked against `kind`."""
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(blocks if blocks.flags.writeable else blocks.copy())
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        got = f"{blocks.dtype} {tuple(blocks.shape)}" if hasattr(blocks, "shape") else blocks
        raise ValueError(f"blocks: expected 2-D uint8 (out_features, row bytes), got {got}")
    nbytes = BLOCK_FORMATS[kind].nbytes
    if blocks.shape[1] == 0 or blocks.shape[1] % nbytes:
        raise ValueError(f"blocks: rows of {blocks.shape[1]} bytes are not whole {kind} blocks "
                         f"of {nbytes} bytes")  # fmt: skip
    return blocks.detach().contiguous()


def _checked_bias(bias: torch.Tensor, out_features: int) -> torch.Tensor:
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (out_features,):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias: expected shape ({out_features},), got {got}")
    return bias.detach().float()
