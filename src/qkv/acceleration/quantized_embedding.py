"""An embedding table that stays quantized: each lookup dequantizes only the rows it reads.

A tied LLM keeps one (V, E) table for its input embedding and its output layer: SmolLM2's is
49152 x 576, 30 MB as GGUF's Q8_0 blocks and 113 MB in fp32, more than all its other weights
as Q4_1. `QuantizedEmbedding` holds the table as GGUF blocks (`blocks`, any kind that
`qkv.models.gguf.quants` decodes; the very tensor a tied `QuantizedLinear` output layer holds,
so the table is in memory once) and returns, for each token id, its row dequantized bit for
bit as `dequantize` gives it: what `nn.Embedding` on the dequantized table returns.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.models.gguf.quants import BLOCK_FORMATS, decode_blocks, dequantize

__all__ = ["QuantizedEmbedding"]


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's lookup on a table of GGUF blocks: (...) int ids -> (..., E) float32.

    blocks: (num_embeddings, row bytes) uint8, whole blocks of `kind` per row. Frozen: the
    table has no gradient (a LoRA-style adapter trains elsewhere)."""

    def __init__(self, blocks: torch.Tensor, kind: str) -> None:
        super().__init__()
        if kind not in BLOCK_FORMATS:
            raise ValueError(f"kind: expected one of {sorted(BLOCK_FORMATS)}, got {kind!r}")
        fmt = BLOCK_FORMATS[kind]
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
            got = f"{blocks.dtype} {tuple(blocks.shape)}" if hasattr(blocks, "shape") else blocks
            raise ValueError(f"blocks: expected 2-D uint8 (num_embeddings, row bytes), got {got}")
        if blocks.shape[1] == 0 or blocks.shape[1] % fmt.nbytes:
            raise ValueError(f"blocks: rows of {blocks.shape[1]} bytes are not whole {kind} "
                             f"blocks of {fmt.nbytes} bytes")  # fmt: skip
        self.kind = kind
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = blocks.shape[1] // fmt.nbytes * fmt.values
        self.register_buffer("blocks", blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids: expected integer token ids, got {input_ids.dtype}")
        ids = input_ids.reshape(-1)  # (N,)
        checked = not torch.compiler.is_compiling()  # a host check a traced graph cannot make
        if (
            checked
            and ids.numel()
            and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings)
        ):
            raise IndexError(f"input_ids: expected ids in [0, {self.num_embeddings}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")  # fmt: skip
        nbytes = BLOCK_FORMATS[self.kind].nbytes  # the table's rows are whole blocks: checked
        blocks = self.blocks[ids].view(-1, nbytes)  # (N * blocks a row, block bytes)
        rows = decode_blocks(blocks, self.kind)  # (N * blocks a row, values a block)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def dequantized_weight(self) -> torch.Tensor:
        """A new (num_embeddings, embedding_dim) float32 tensor: the whole table."""
        return dequantize(self.blocks, self.kind, (self.num_embeddings, self.embedding_dim))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"
