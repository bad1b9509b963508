"""What padding does to BatchNorm, against LayerNorm and RMSNorm: the first measurement of the
norms study (`qkv.studies.norms`).

Documentation sentences (`qkv.data.pydoc_documents`), tokenised by MiniLM's WordPiece and
embedded by the token table of the real all-MiniLM-L6-v2, make a padded batch (B, L, 384) whose
padded positions hold the [PAD] row, as the model sees them. Per-channel mean and standard
deviation over the real tokens are set against those over every position (what BatchNorm
computes when nobody tells it where the padding is; Ioffe & Szegedy 2015, s3). Then BatchNorm
over all positions, BatchNorm over the real tokens (`qkv.layers.BatchNorm` with a mask),
LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019) normalise the batch, and the
largest change of a real token's output is measured when only the padding changes (the batch
padded to its longest sentence, then to `pad_to` tokens, as MiniLM's own tokenizer file pads)
and when the first sentence's batchmates are replaced by other sentences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qkv.data import minilm_wordpiece, pydoc_documents
from qkv.layers import BatchNorm, LayerNorm, RMSNorm
from qkv.models.bert import BertModel
from qkv.models.checkpoints.bundled import default_model_path

__all__ = ["NORMS", "padding_effects"]

NORMS = ("BatchNorm, all positions", "BatchNorm, real tokens", "LayerNorm", "RMSNorm")


def padding_effects(settings: dict[str, Any], *, seed: int) -> dict[str, Any]:
    """Per-channel statistics of a padded batch of MiniLM token embeddings over the real tokens
    and over every position, and each norm's largest output change (see the module docstring)."""
    tokenizer = minilm_wordpiece()
    embedding = BertModel.from_pretrained(default_model_path()).embeddings.token_embedding
    pad_id = tokenizer.token_to_id("[PAD]")
    sentences = _sentences(tokenizer, settings, seed)  # 2B - 1 of them, as token id lists
    B = settings["text_batch"]
    batch, others = sentences[:B], sentences[:1] + sentences[B:]
    with torch.no_grad():
        x, real = _embedded(embedding, batch, pad_id)  # (B, L, E), (B, L)
        wide, wide_real = _embedded(embedding, batch, pad_id, length=settings["pad_to"])
        swapped, swapped_real = _embedded(embedding, others, pad_id)
        first = real[0]  # (L,): the first sentence's real tokens
        changes = {}
        for name, norm in _norm_functions(x.shape[-1]).items():
            out = norm(x, real)  # (B, L, E)
            more_padding = norm(wide, wide_real)[:, : x.shape[1]]  # (B, L, E)
            other_batch = norm(swapped, swapped_real)[0, : int(first.sum())]
            changes[name] = {
                "more_padding": float((out - more_padding)[real].abs().max()),
                "other_batchmates": float((out[0, first] - other_batch).abs().max()),
            }
    real_tokens, every = x[real], x.reshape(-1, x.shape[-1])  # (N, E), (B * L, E)
    return {
        "pad_fraction": 1.0 - float(real.float().mean()),
        "lengths": [len(ids) for ids in batch],
        "mean_real": real_tokens.mean(0).tolist(), "mean_all": every.mean(0).tolist(),
        "std_real": real_tokens.std(0, unbiased=False).tolist(),
        "std_all": every.std(0, unbiased=False).tolist(), "changes": changes,
    }  # fmt: skip


def _sentences(tokenizer, settings: dict[str, Any], seed: int) -> list[list[int]]:
    """2 * text_batch - 1 documentation sentences of min_tokens .. max_tokens WordPiece tokens
    ([CLS] and [SEP] included), drawn without replacement by `seed`."""
    texts = [sentence for document in pydoc_documents() for sentence in document]
    encoded = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    kept = [ids for ids in encoded if settings["min_tokens"] <= len(ids) <= settings["max_tokens"]]
    needed = 2 * settings["text_batch"] - 1
    if len(kept) < needed:
        raise ValueError(
            f"max_tokens: {len(kept)} sentences have {settings['min_tokens']} .. "
            f"{settings['max_tokens']} tokens; expected at least {needed}"
        )
    order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed))
    return [kept[int(index)] for index in order[:needed]]


def _embedded(embedding: nn.Embedding, batch: list[list[int]], pad_id: int, length=None):
    """The token embeddings of `batch` right-padded with [PAD] to `length` (default: the
    longest): (B, L, E), and the real-token mask (B, L)."""
    length = max(map(len, batch)) if length is None else length
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)  # (B, L)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
    return embedding(ids), ids != pad_id  # [PAD] never occurs inside a sentence


def _norm_functions(dim: int) -> dict[str, Any]:
    """(x (B, L, E), real (B, L)) -> normalised x, for each norm of NORMS, at initialisation
    (unit gain, no shift); BatchNorm in training mode: the batch's own statistics."""
    masked, unmasked = BatchNorm(dim), BatchNorm(dim)
    layer_norm, rms_norm = LayerNorm(dim), RMSNorm(dim)
    return {
        NORMS[0]: lambda x, real: unmasked(x),
        NORMS[1]: lambda x, real: masked(x, mask=real),
        NORMS[2]: lambda x, real: layer_norm(x),
        NORMS[3]: lambda x, real: rms_norm(x),
    }
