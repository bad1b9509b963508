"""What the models are used for, one layer above them.

- Sentence embeddings (`embed`, `SentenceEncoder`): Sentence-BERT's recipe (Reimers & Gurevych
  2019) with the real all-MiniLM-L6-v2, as sentence-transformers runs it.
- Long texts (`chunk_texts`, `embed_long`, `classify_long`, ...): BERT over overlapping windows,
  aggregated per text, for texts longer than its maximum length.
- Whole documents in one pass (`whole_documents`, `longformer_pattern`): Longformer's window +
  global [CLS] attention (`pattern=` of `embed_long` / `classify_long`), up to max_positions.
"""

from qkv.applications.embed import SentenceEncoder, embed
from qkv.applications.hierarchical import (
    CHUNK_POOLINGS,
    DOCUMENT_POOLINGS,
    AttentionPooling,
    HierarchicalClassifier,
    HierarchicalEncoder,
    group_chunks,
)
from qkv.applications.long_text import (
    AGGREGATIONS,
    Windows,
    aggregate_windows,
    chunk_batch,
    chunk_ids,
    chunk_texts,
    classify_long,
    classify_long_texts,
    embed_long,
    embed_long_texts,
    truncate_ids,
)
from qkv.applications.whole_documents import OVERFLOWS, longformer_pattern, whole_documents

__all__ = [
    "AGGREGATIONS",
    "CHUNK_POOLINGS",
    "DOCUMENT_POOLINGS",
    "OVERFLOWS",
    "AttentionPooling",
    "HierarchicalClassifier",
    "HierarchicalEncoder",
    "SentenceEncoder",
    "Windows",
    "aggregate_windows",
    "chunk_batch",
    "chunk_ids",
    "chunk_texts",
    "classify_long",
    "classify_long_texts",
    "embed",
    "embed_long",
    "embed_long_texts",
    "group_chunks",
    "longformer_pattern",
    "truncate_ids",
    "whole_documents",
]
