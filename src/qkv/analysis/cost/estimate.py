"""The cost planner behind `qkv cost`: parameters, FLOPs, score-matrix and KV-cache memory.

For a preset, a config or a checkpoint folder, `cost_report` gives, from formulas alone (no
weights are built):

- parameters: exact, every embedding table, projection, bias and norm, tied heads counted once;
- FLOPs (2 FLOPs per multiply-add, matrix products only; Kaplan et al. 2020, s2.1): forward per
  sequence and per token, one decoding step with a KV cache, training ~ 3 x forward (the
  backward pass costs two products per forward product: one for the input gradient, one for the
  weight gradient). One MHA layer costs 8 B L E^2 + 4 B L^2 E;
- score-matrix memory: the L x L matrix a non-fused attention materialises, per head and per
  layer (all H heads, the whole batch) at 8K, 32K and 128K tokens (32 heads x 8192^2 x 2 bytes
  = 4.29 GB for one layer in fp16);
- KV-cache bytes per sample (Pope et al. 2022, Efficiently Scaling Transformer Inference):

      L_ctx * layers * 2 (K and V) * H_kv * head_dim * bytes per element,

  for the model's own key/value heads and for MHA (H_kv = H), GQA and MQA (H_kv = 1) at the same
  size: Llama-2-70B at 4096 tokens in fp16 needs 1.25 GiB per sample with its 8 K/V heads and
  10 GiB with 64, as plain MHA would (GQA: Ainslie et al. 2023; MQA: Shazeer 2019).

Sizes are the arithmetic of `qkv.analysis.cost.layout`; the presets and checkpoint reading are
in `qkv.analysis.cost.sources`, the text tables in `qkv.analysis.cost.format`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from qkv.analysis.cost.layout import ModelConfig, ModelLayout, layout_of
from qkv.analysis.cost.scaling import crossover_length
from qkv.analysis.cost.sources import resolve_model
from qkv.validation import check_positive_int

__all__ = [
    "DTYPE_BYTES",
    "SCORE_LENGTHS",
    "CostReport",
    "KVCacheVariant",
    "ScoreMatrixMemory",
    "bytes_per_element",
    "cost_report",
    "kv_cache_bytes_per_sample",
    "score_matrix_bytes",
]

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
SCORE_LENGTHS = (8192, 32768, 131072)  # 8K, 32K, 128K: long contexts, where L^2 hurts
TRAINING_FLOPS_FACTOR = 3  # forward + backward (input and weight gradients: 2 x forward)


@dataclass(frozen=True)
class ScoreMatrixMemory:
    """The L x L attention scores at one length: for one head of one sample, and for one layer
    (all H query heads, the whole batch)."""

    length: int
    per_head_bytes: int
    per_layer_bytes: int


@dataclass(frozen=True)
class KVCacheVariant:
    """The KV cache of the same model with another number of key/value heads."""

    name: str  # "MHA" (H_kv = H), "GQA" (1 < H_kv < H) or "MQA" (H_kv = 1)
    num_kv_heads: int
    bytes_per_sample: int
    is_model: bool  # the model's own H_kv


@dataclass(frozen=True)
class CostReport:
    """What a model costs at `context` tokens, `batch` sequences, `dtype` elements.

    FLOPs are forward FLOPs unless named otherwise. Per sequence: one sequence of `context`
    tokens (source and target both that long in an encoder-decoder); per token: that / context;
    decode_flops_per_token: one new token over `context` cached keys (None for an encoder).
    kv_cache_bytes_per_sample: the decoder's self-attention cache (None for an encoder);
    cross_attention_cache_bytes_per_sample: an encoder-decoder's cached projections of a
    `context`-token memory (None otherwise). num_classes: a classifier's classes (a ViT's; None
    for a language model), whose context is the tokens of one image.
    """

    name: str
    family: str
    num_encoder_layers: int
    num_decoder_layers: int
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_positions: int
    context: int
    batch: int
    dtype: str
    bytes_per_element: int
    parameters: int
    embedding_parameters: int
    weight_bytes: int
    flops_per_sequence: int
    flops_per_token: float
    forward_flops: int  # the whole batch
    training_flops: int  # the whole batch, ~3 x forward
    attention_flops_per_layer: int  # one self-attention layer, one sequence
    decode_flops_per_token: int | None
    score_matrix_at_context: ScoreMatrixMemory
    score_matrix: tuple[ScoreMatrixMemory, ...]  # at SCORE_LENGTHS: 8K, 32K, 128K
    kv_cache_bytes_per_sample: int | None
    kv_cache_bytes: int | None  # the whole batch
    kv_cache_variants: tuple[KVCacheVariant, ...]
    cross_attention_cache_bytes_per_sample: int | None
    num_classes: int | None = None
    # the length where one layer's scores (4 L^2 H D) cost its projections and FFN (6E for the
    # standard block; `qkv.analysis.cost.scaling`)
    attention_crossover_length: float | None = None


def bytes_per_element(dtype: str) -> tuple[str, int]:
    """("fp16", 2) for "fp16" or "float16"; ValueError naming `dtype` for anything else."""
    if not isinstance(dtype, str):
        raise TypeError(f"dtype: expected a str such as 'fp16', got {type(dtype).__name__}")
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name, DTYPE_BYTES[name]


def kv_cache_bytes_per_sample(
    *, context: int, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int
) -> int:
    """L_ctx * layers * 2 (K and V) * H_kv * head_dim * bytes per element (Pope et al. 2022):
    what `qkv.layers.StaticKVCache` allocates for one row of the batch."""
    return context * num_layers * 2 * num_kv_heads * head_dim * bytes_per_element


def score_matrix_bytes(
    *, length: int, num_heads: int, batch: int, bytes_per_element: int
) -> ScoreMatrixMemory:
    """The (B, H, L, L) score matrix of one layer, and one head's (L, L) share of it (the score
    matrix QK^T of Vaswani et al. 2017, s3.2.1, has shape (L, L) per head)."""
    per_head = length * length * bytes_per_element
    return ScoreMatrixMemory(
        length=length, per_head_bytes=per_head, per_layer_bytes=per_head * num_heads * batch
    )


def cost_report(
    model: str | Path | ModelConfig,
    *,
    context: int | None = None,
    dtype: str = "fp16",
    batch: int = 1,
) -> CostReport:
    """The cost of `model` (a preset name, a checkpoint folder or config.json, or a config) at
    `context` tokens (default: the model's context, max_positions or the longer one RoPE
    scaling gives), for `batch` sequences of `dtype`
    ("fp32", "fp16", "bf16") elements. Pure arithmetic: no weights are built or read."""
    name, config = resolve_model(model)
    layout = layout_of(config)
    context = layout.max_positions if context is None else check_positive_int("context", context)
    batch = check_positive_int("batch", batch)
    dtype, width = bytes_per_element(dtype)
    if context > layout.max_positions:
        logger.info("%s: context %d exceeds max_positions %d", name, context, layout.max_positions)
    parameters = layout.parameters()
    per_sequence = layout.forward_flops(context)
    attention = layout.attention
    return CostReport(
        name=name, family=layout.family,
        num_encoder_layers=0 if layout.encoder is None else layout.encoder.num_layers,
        num_decoder_layers=0 if layout.decoder is None else layout.decoder.num_layers,
        embed_dim=layout.embed_dim, num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
        ffn_dim=layout.stacks[0].ffn.hidden_dim, vocab_size=layout.vocab_size,
        max_positions=layout.max_positions, context=context, batch=batch, dtype=dtype,
        bytes_per_element=width, parameters=parameters,
        embedding_parameters=layout.embedding_parameters, weight_bytes=parameters * width,
        flops_per_sequence=per_sequence, flops_per_token=per_sequence / context,
        forward_flops=batch * per_sequence,
        training_flops=TRAINING_FLOPS_FACTOR * batch * per_sequence,
        attention_flops_per_layer=attention.flops(context, context),
        decode_flops_per_token=layout.decode_flops(context),
        score_matrix_at_context=score_matrix_bytes(
            length=context, num_heads=attention.num_heads, batch=batch, bytes_per_element=width
        ),
        score_matrix=tuple(
            score_matrix_bytes(
                length=length, num_heads=attention.num_heads, batch=batch, bytes_per_element=width
            )
            for length in SCORE_LENGTHS
        ),
        num_classes=layout.num_classes or None,
        attention_crossover_length=float(
            crossover_length(attention, (layout.decoder or layout.encoder).ffn)
        ),
        **_kv_cache_fields(layout, context, batch, width),
    )  # fmt: skip


def _kv_cache_fields(layout: ModelLayout, context: int, batch: int, width: int) -> dict:
    """The KV-cache figures of a report: the decoder's, its MHA/GQA/MQA variants, and the
    cross-attention cache of an encoder-decoder. An encoder-only model keeps no cache."""
    decoder = layout.decoder
    if decoder is None:
        return {
            "kv_cache_bytes_per_sample": None, "kv_cache_bytes": None,
            "kv_cache_variants": (), "cross_attention_cache_bytes_per_sample": None,
        }  # fmt: skip
    attention = decoder.self_attention

    def size(num_kv_heads: int) -> int:
        return kv_cache_bytes_per_sample(
            context=context, num_layers=decoder.num_layers, num_kv_heads=num_kv_heads,
            head_dim=attention.head_dim, bytes_per_element=width,
        )  # fmt: skip

    own = size(attention.num_kv_heads)
    cross = decoder.cross_attention  # its keys and values: a `context`-token memory
    cross_bytes = None if cross is None else size(cross.num_kv_heads)
    return {
        "kv_cache_bytes_per_sample": own,
        "kv_cache_bytes": batch * own,
        "kv_cache_variants": tuple(
            KVCacheVariant(
                name=_variant_name(H_kv, attention.num_heads),
                num_kv_heads=H_kv,
                bytes_per_sample=size(H_kv),
                is_model=H_kv == attention.num_kv_heads,
            )
            for H_kv in sorted({attention.num_heads, attention.num_kv_heads, 1}, reverse=True)
        ),
        "cross_attention_cache_bytes_per_sample": cross_bytes,
    }


def _variant_name(num_kv_heads: int, num_heads: int) -> str:
    if num_kv_heads == num_heads:
        return "MHA"
    return "MQA" if num_kv_heads == 1 else "GQA"
