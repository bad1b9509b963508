"""Hierarchical long-document encoding: BERT reads each chunk, a small Transformer the chunks.

A document longer than BERT's window is cut into windows (`chunk_texts`, the windows that
`embed_long` averages); here each window becomes one vector, and instead of averaging them a
Transformer encoder runs over the sequence of window vectors, so that the document vector can
weigh and relate its parts (Pappagari et al. 2019, "Hierarchical Transformers for Long Document
Classification": BERT over segments, then a Transformer over the segment outputs, "ToBERT").
The two levels mirror the hierarchical attention networks of Yang et al. 2016 (words ->
sentence vectors -> document vector), whose attention pooling is one of the choices here.

    windows  (W, L)  token ids of every window of N texts           chunk_texts(...)
    -> chunk encoder (BERT), pooled per window: [CLS] or mean      (W, E)   embed_chunks
    -> grouped per text, padded to C chunks, chunk mask            (N, C, E), (N, C)
    -> + learned chunk positions, LayerNorm, dropout               (N, C, E)
    -> num_layers encoder blocks, padding chunks masked as keys    (N, C, E)
    -> pooled over real chunks: mean, or attention (Yang et al.)   (N, E)    encode_chunks

With a frozen chunk encoder (the default) the chunk vectors are fixed: compute them once with
`embed_chunks` and train the upper levels on them with `encode_chunks` / `classify_chunks`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import Linear

from qkv.applications.long_text import _run_windows
from qkv.applications.windows import Windows
from qkv.attention.sparse import SparsePattern
from qkv.layers import EncoderBlock, LayerNorm
from qkv.layers._dropout import make_dropout
from qkv.models.bert import BertModel, init_bert_weights, mean_pool
from qkv.positional import LearnedPositionalEmbedding
from qkv.validation import check_choice, check_int, check_positive_int, check_probability, describe

__all__ = [
    "CHUNK_POOLINGS",
    "DOCUMENT_POOLINGS",
    "AttentionPooling",
    "HierarchicalClassifier",
    "HierarchicalEncoder",
    "group_chunks",
]

# cls: the chunk encoder's last hidden state at [CLS]; mean: the mean over real tokens (`mean_pool`)
CHUNK_POOLINGS = ("cls", "mean")
# mean: the mean over real chunks; attention: `AttentionPooling` (Yang et al. 2016)
DOCUMENT_POOLINGS = ("mean", "attention")


def group_chunks(chunks: torch.Tensor, windows: Windows) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per window -> one padded row of chunks per text.

    chunks (W, E), in the order of `windows` -> (grouped (N, C, E), mask (N, C)), C the most
    windows any text has; mask is True on real chunks, and padding chunks are zeros.
    """
    index = windows.text_index.to(chunks.device)  # (W,)
    counts = torch.bincount(index, minlength=windows.num_texts)  # (N,)
    starts = torch.cumsum(counts, dim=0) - counts  # (N,) the first window of each text
    position = torch.arange(index.shape[0], device=chunks.device) - starts[index]  # (W,)
    C = int(counts.max())
    grouped = chunks.new_zeros(windows.num_texts, C, chunks.shape[1])  # (N, C, E)
    grouped = grouped.index_put((index, position), chunks)  # out of place: gradients flow
    mask = torch.arange(C, device=chunks.device)[None, :] < counts[:, None]  # (N, C)
    return grouped, mask


class AttentionPooling(nn.Module):
    """Attention pooling over a sequence, the word and sentence attention of hierarchical
    attention networks (Yang et al. 2016): u_i = tanh(W h_i + b), a_i = softmax_i(u_i . u_w)
    over the real positions, v = sum_i a_i h_i.

    forward(x (N, C, E), mask (N, C) True on real positions, at least one per row) -> (N, E).
    Submodules: `proj` (Linear(E, E)) and the learned context vector `context` (E,).
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        self.proj = Linear(embed_dim, embed_dim)
        self.context = nn.Parameter(torch.empty(embed_dim))  # (E,)
        nn.init.normal_(self.context, std=0.02)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = torch.tanh(self.proj(x)) @ self.context  # (N, C)
        scores = scores.float().masked_fill(~mask, float("-inf"))  # softmax statistics in fp32
        weights = torch.softmax(scores, dim=1).to(x.dtype)  # (N, C)
        return (weights.unsqueeze(-1) * x).sum(dim=1)  # (N, E)


class HierarchicalEncoder(nn.Module):
    """A document vector from BERT chunk vectors and a Transformer over chunks (see the module).

    chunk_encoder: the qkv BertModel that reads each window (e.g. the real all-MiniLM-L6-v2);
    with freeze_chunk_encoder its parameters stop requiring gradients (the module is changed in
    place), it stays in eval mode whatever `train()` sets, and runs without autograd.
    The Transformer over chunks has the chunk encoder's width E: num_layers post-norm
    `EncoderBlock`s (GELU FFN of ffn_dim, default 4 E), learned chunk positions for up to
    max_chunks chunks. chunk_pattern: a sparse pattern (`qkv.sparse`) for the chunk encoder's
    attention in every window (e.g. `longformer_pattern` over windows of 512), or None (dense).
    Submodules: chunk_encoder, chunk_position, norm, dropout, blocks, pooling.
    """

    def __init__(
        self,
        chunk_encoder: BertModel,
        *,
        num_layers: int = 2,
        num_heads: int = 6,
        ffn_dim: int | None = None,
        max_chunks: int = 64,
        chunk_pooling: str = "mean",
        document_pooling: str = "mean",
        dropout: float = 0.1,
        freeze_chunk_encoder: bool = True,
        chunk_pattern: SparsePattern | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(chunk_encoder, BertModel):
            raise TypeError(
                f"chunk_encoder: expected a qkv BertModel, got {type(chunk_encoder).__name__}"
            )
        check_choice("chunk_pooling", chunk_pooling, CHUNK_POOLINGS)
        check_choice("document_pooling", document_pooling, DOCUMENT_POOLINGS)
        if not isinstance(freeze_chunk_encoder, bool):
            raise TypeError(
                f"freeze_chunk_encoder: expected a bool, got {describe(freeze_chunk_encoder)}"
            )
        E = chunk_encoder.config.embed_dim
        ffn_dim = 4 * E if ffn_dim is None else check_positive_int("ffn_dim", ffn_dim)
        check_int("num_layers", num_layers, minimum=0)
        self.chunk_encoder = chunk_encoder
        self.chunk_pooling, self.document_pooling = chunk_pooling, document_pooling
        self.max_chunks = check_positive_int("max_chunks", max_chunks)
        self.freeze_chunk_encoder = freeze_chunk_encoder
        if chunk_pattern is not None and not isinstance(chunk_pattern, SparsePattern):
            raise TypeError(
                f"chunk_pattern: expected a qkv.sparse pattern or None, got "
                f"{type(chunk_pattern).__name__}"
            )
        self.chunk_pattern = chunk_pattern
        self.chunk_position = LearnedPositionalEmbedding(max_chunks, E)
        self.norm = LayerNorm(E, eps=chunk_encoder.config.norm_eps)
        self.dropout = make_dropout(check_probability("dropout", dropout))
        self.blocks = nn.ModuleList(
            EncoderBlock(E, num_heads, ffn_dim, dropout=dropout, activation="gelu")
            for _ in range(num_layers)
        )
        self.blocks.apply(init_bert_weights)
        self.pooling = AttentionPooling(E) if document_pooling == "attention" else None
        if freeze_chunk_encoder:
            chunk_encoder.requires_grad_(False)
            chunk_encoder.eval()

    @property
    def embed_dim(self) -> int:
        return self.chunk_encoder.config.embed_dim

    def train(self, mode: bool = True) -> HierarchicalEncoder:
        """As nn.Module.train, except that a frozen chunk encoder stays in eval mode."""
        super().train(mode)
        if self.freeze_chunk_encoder:
            self.chunk_encoder.eval()
        return self

    def forward(self, windows: Windows, *, batch_size: int = 32) -> torch.Tensor:
        """windows of N texts (`chunk_texts`) -> document vectors (N, E)."""
        return self.encode_chunks(self.embed_chunks(windows, batch_size=batch_size), windows)

    def embed_chunks(self, windows: Windows, *, batch_size: int = 32) -> torch.Tensor:
        """One vector per window, the chunk encoder's output pooled by chunk_pooling -> (W, E),
        computed batch_size windows at a time (each batch trimmed to its longest window)."""
        if not isinstance(windows, Windows):
            raise TypeError(f"windows: expected a Windows batch, got {type(windows).__name__}")
        check_positive_int("batch_size", batch_size)
        use_cls = self.chunk_pooling == "cls"

        def pool(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            hidden = self.chunk_encoder(ids, mask, pattern=self.chunk_pattern).last_hidden_state
            return hidden[:, 0] if use_cls else mean_pool(hidden, mask)  # (b, E)

        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_chunk_encoder):
            return _run_windows(pool, self.chunk_encoder, windows, batch_size)  # (W, E)

    def encode_chunks(self, chunks: torch.Tensor, windows: Windows) -> torch.Tensor:
        """Chunk vectors (W, E) (from `embed_chunks`) of the texts of `windows` -> (N, E)."""
        x, mask = group_chunks(self._check_chunks(chunks, windows), windows)  # (N, C, E), (N, C)
        num_chunks = x.shape[1]  # C
        if num_chunks > self.max_chunks:
            raise ValueError(
                f"windows: a text has {num_chunks} windows; expected at most max_chunks="
                f"{self.max_chunks} (use longer windows or a larger max_chunks)"
            )
        positions = torch.arange(num_chunks, device=x.device)  # (C,)
        x = self.dropout(self.norm(x + self.chunk_position(positions)))  # (N, C, E)
        # padding chunks are masked as keys; an all-real mask is dropped for the fast path
        key_mask = None if bool(mask.all()) else mask[:, None, None, :]  # (N, 1, 1, C)
        for block in self.blocks:
            x = block(x, mask=key_mask)  # (N, C, E)
        if self.pooling is not None:
            return self.pooling(x, mask)  # (N, E)
        return mean_pool(x, mask)  # (N, E)

    def _check_chunks(self, chunks: object, windows: Windows) -> torch.Tensor:
        if not isinstance(windows, Windows):
            raise TypeError(f"windows: expected a Windows batch, got {type(windows).__name__}")
        W, E = windows.input_ids.shape[0], self.embed_dim
        if not isinstance(chunks, torch.Tensor) or chunks.shape != (W, E):
            raise ValueError(
                f"chunks: expected a ({W}, {E}) tensor (one row per window, the chunk "
                f"encoder's width), got {describe(chunks)}"
            )
        if not chunks.is_floating_point():
            raise TypeError(f"chunks: expected a floating-point tensor, got dtype {chunks.dtype}")
        return chunks


class HierarchicalClassifier(nn.Module):
    """A HierarchicalEncoder, then dropout and Linear(E, num_labels) on the document vector
    (Pappagari et al. 2019). Submodules: `encoder`, `dropout`, `classifier`."""

    def __init__(
        self, encoder: HierarchicalEncoder, num_labels: int, *, dropout: float = 0.1
    ) -> None:
        super().__init__()
        if not isinstance(encoder, HierarchicalEncoder):
            raise TypeError(
                f"encoder: expected a HierarchicalEncoder, got {type(encoder).__name__}"
            )
        self.num_labels = check_positive_int("num_labels", num_labels)
        self.encoder = encoder
        self.dropout = make_dropout(check_probability("dropout", dropout))
        self.classifier = Linear(encoder.embed_dim, num_labels)
        self.classifier.apply(init_bert_weights)

    def forward(self, windows: Windows, *, batch_size: int = 32) -> torch.Tensor:
        """windows of N texts -> logits (N, num_labels)."""
        return self.classify_chunks(
            self.encoder.embed_chunks(windows, batch_size=batch_size), windows
        )

    def classify_chunks(self, chunks: torch.Tensor, windows: Windows) -> torch.Tensor:
        """Chunk vectors (W, E) (from `encoder.embed_chunks`) -> logits (N, num_labels)."""
        return self.classifier(self.dropout(self.encoder.encode_chunks(chunks, windows)))
