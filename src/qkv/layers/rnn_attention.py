"""The attention of the recurrent encoder-decoders that came before the Transformer.

A decoder state (the query) scores every encoder annotation h_j (B, S, C) of the source; the
softmax of the scores over j gives the alignment weights, and the context vector is the
weighted sum of the annotations (the annotations are both keys and values):

    additive  e_ij = v_a^T tanh(W_a s_{i-1} + U_a h_j)     Bahdanau et al. 2015, s3.1 and
                                                            appendix A.1.2 ("Neural Machine
                                                            Translation by Jointly Learning to
                                                            Align and Translate")
    dot       score(h_t, h_s) = h_t^T h_s                   Luong et al. 2015, s3.1 ("Effective
    general   score(h_t, h_s) = h_t^T W_a h_s               Approaches to Attention-based Neural
                                                            Machine Translation")

Bahdanau et al. score with the decoder's previous state s_{i-1}, before the step; Luong et al.
with the current state h_t, after it: which state is passed in is the decoder's choice. The dot
and general scores are `qkv.attention` with one head and scale 1 (general first maps the
annotations by W_a). Additive scores go through the same masked softmax: U_a h_j does not
depend on the query, so `AdditiveAttention.project_memory` computes it once per source
(Bahdanau et al., appendix A.1.2) and a decoder passes it back in at every step.

Queries are (B, D_q) (one step) or (B, L_q, D_q) (a whole target). Masks follow qkv's
convention, True where a query may attend: (B, S) over the source, or (B, L_q, S). A query
with no visible annotation gets weights 0 and context 0, with finite gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.attention import attention
from qkv.validation import check_positive_int, describe

__all__ = ["AdditiveAttention", "DotAttention", "GeneralAttention", "masked_softmax"]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of scores (B, L_q, S), computed in at least float32, where
    mask (broadcastable, True = may attend) allows; a row with nothing allowed gets zeros."""
    compute = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if mask is not None:
        compute = compute.masked_fill(~mask, float("-inf"))
    empty = compute.amax(dim=-1, keepdim=True) == float("-inf")  # (B, L_q, 1)
    weights = torch.softmax(compute.masked_fill(empty, 0.0), dim=-1)  # finite, then zeroed
    return weights.masked_fill(empty, 0.0).to(scores.dtype)


def _as_sequence(query: torch.Tensor, width: int) -> tuple[torch.Tensor, bool]:
    """A query (B, D) or (B, L_q, D) as (B, L_q, D), and whether it was one step."""
    if not isinstance(query, torch.Tensor) or query.dim() not in (2, 3) or query.shape[-1] != width:
        raise ValueError(
            f"query: expected a (B, {width}) or (B, L_q, {width}) tensor, got {describe(query)}"
        )
    return (query[:, None], True) if query.dim() == 2 else (query, False)


def _check_memory(memory: object, batch: int | None, width: int | None) -> None:
    """memory must be (B, S, C), with B = batch and C = width where those are given."""
    expected = f"({'B' if batch is None else batch}, S, {'C' if width is None else width})"
    if (
        not isinstance(memory, torch.Tensor)
        or memory.dim() != 3
        or batch not in (None, memory.shape[0])
        or width not in (None, memory.shape[2])
    ):
        raise ValueError(f"memory: expected a {expected} tensor, got {describe(memory)}")


def _query_mask(mask: torch.Tensor | None, B: int, L_q: int, S: int) -> torch.Tensor | None:
    """mask (B, S) or (B, L_q, S) bool -> (B, L_q or 1, S)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool tensor (True = may attend), got {describe(mask)}")
    if mask.shape == (B, S):
        return mask[:, None]  # (B, 1, S)
    if mask.shape == (B, L_q, S):
        return mask
    raise ValueError(f"mask: expected shape ({B}, {S}) or ({B}, {L_q}, {S}), got {describe(mask)}")


def _finish(
    context: torch.Tensor, weights: torch.Tensor, one_step: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return (context[:, 0], weights[:, 0]) if one_step else (context, weights)


class AdditiveAttention(nn.Module):
    """Bahdanau et al. 2015 (s3.1, appendix A.1.2): e_ij = v_a^T tanh(W_a s_{i-1} + U_a h_j).

    query_proj is W_a (D_q -> A), memory_proj U_a (C -> A), score_proj v_a (A -> 1), none with
    a bias, as in the paper. forward(query, memory, *, mask, projected_memory) -> (context
    (B, [L_q,] C), weights (B, [L_q,] S)); projected_memory: `project_memory(memory)`, given
    to skip recomputing it at every decoding step.
    """

    def __init__(
        self,
        query_dim: int,
        memory_dim: int,
        attention_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.query_dim = check_positive_int("query_dim", query_dim)
        self.memory_dim = check_positive_int("memory_dim", memory_dim)
        check_positive_int("attention_dim", attention_dim)
        self.query_proj = nn.Linear(query_dim, attention_dim, bias=False, **factory)
        self.memory_proj = nn.Linear(memory_dim, attention_dim, bias=False, **factory)
        self.score_proj = nn.Linear(attention_dim, 1, bias=False, **factory)

    def project_memory(self, memory: torch.Tensor) -> torch.Tensor:
        """U_a h_j for every annotation: (B, S, C) -> (B, S, A)."""
        _check_memory(memory, None, self.memory_dim)
        return self.memory_proj(memory)

    def forward(
        self,
        query: torch.Tensor,
        memory: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        projected_memory: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query, one_step = _as_sequence(query, self.query_dim)  # (B, L_q, D_q)
        B, L_q, _ = query.shape
        _check_memory(memory, B, self.memory_dim)
        if projected_memory is None:
            projected_memory = self.memory_proj(memory)  # (B, S, A)
        elif projected_memory.shape[:2] != memory.shape[:2]:
            raise ValueError(
                f"projected_memory: expected shape ({B}, {memory.shape[1]}, A), got "
                f"{describe(projected_memory)}"
            )
        hidden = torch.tanh(self.query_proj(query)[:, :, None] + projected_memory[:, None])
        scores = self.score_proj(hidden)[..., 0]  # (B, L_q, S)
        weights = masked_softmax(scores, _query_mask(mask, B, L_q, memory.shape[1]))
        context = weights @ memory  # (B, L_q, C)
        return _finish(context, weights, one_step)


class DotAttention(nn.Module):
    """Luong et al. 2015 (s3.1), "dot": score(h_t, h_s) = h_t^T h_s, no parameters; the query
    and the annotations must have the same width. forward(query, memory, *, mask) -> (context,
    weights) as `AdditiveAttention`'s."""

    def forward(
        self, query: torch.Tensor, memory: torch.Tensor, *, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_memory(memory, None, None)
        query, one_step = _as_sequence(query, memory.shape[-1])
        return _finish(*_unscaled_attention(query, memory, memory, mask), one_step)


class GeneralAttention(nn.Module):
    """Luong et al. 2015 (s3.1), "general": score(h_t, h_s) = h_t^T W_a h_s, with memory_proj
    = W_a (C -> D_q, no bias) applied to the annotations; the context is a sum of the
    annotations themselves. forward(query, memory, *, mask) -> (context, weights)."""

    def __init__(
        self,
        query_dim: int,
        memory_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.query_dim = check_positive_int("query_dim", query_dim)
        self.memory_dim = check_positive_int("memory_dim", memory_dim)
        self.memory_proj = nn.Linear(memory_dim, query_dim, bias=False, device=device, dtype=dtype)

    def forward(
        self, query: torch.Tensor, memory: torch.Tensor, *, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query, one_step = _as_sequence(query, self.query_dim)
        _check_memory(memory, query.shape[0], self.memory_dim)
        keys = self.memory_proj(memory)  # (B, S, D_q)
        return _finish(*_unscaled_attention(query, keys, memory, mask), one_step)


def _unscaled_attention(
    query: torch.Tensor, keys: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(query keys^T) memory with one head and scale 1, by `qkv.attention`: query
    (B, L_q, D), keys (B, S, D), memory (B, S, C) -> (context (B, L_q, C), weights (B, L_q, S))."""
    B, L_q, _ = query.shape
    _check_memory(memory, B, None)
    allowed = _query_mask(mask, B, L_q, keys.shape[1])
    context, weights = attention(
        query[:, None], keys[:, None], memory[:, None],  # (B, 1, L, width): one head
        mask=None if allowed is None else allowed[:, None], scale=1.0, return_weights=True,
    )  # fmt: skip
    return context[:, 0], weights[:, 0]  # (B, L_q, C), (B, L_q, S)
