"""What attention over a video costs: joint space-time against factorised, on paper.

A clip of T frames of N patches is T * N tokens. Per layer and head, with head width D
(FLOPs: 2 per multiply-add, matrix products only, as in `qkv.analysis.cost.layout`):

    attention          score elements       Q K^T and weights @ V
    joint space-time   (T N)^2              4 D (T N)^2
    factorised         T N^2 + N T^2        4 D (T N^2 + N T^2)       spatial, then temporal
    as masked joint    2 (T N)^2            8 D (T N)^2               both steps, block masks

The factorised layer (Bertasius et al. 2021, TimeSformer, s3; Arnab et al. 2021, ViViT, s3.3,
model 3) runs one attention per frame (T sequences of N tokens) and one per patch position (N
sequences of T tokens): about min(T, N) times fewer scores than joint attention. The same two
steps written as joint attention under the "same frame" and "same patch position" masks
(`qkv.layers.factorized_attention`) compute every score of both and keep T N^2 and N T^2 of
them: the rest is wasted work, what a dense mask costs where a reshape costs nothing.

Per layer the projections come on top: 8 T N E^2 for joint attention, twice that for the two
attentions of the factorised layer, each with its own four projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.analysis.cost.layout import AttentionLayout
from qkv.validation import check_positive_int

__all__ = ["VideoAttentionCost", "video_attention_cost"]


@dataclass(frozen=True)
class VideoAttentionCost:
    """Attention over one clip of `frames` T x `patches` N tokens, for one layer.

    Per head: *_scores, the score-matrix elements; *_flops_per_head, the FLOPs of Q K^T and
    weights @ V. Per layer (all heads, with the q/k/v/out projections): *_flops. "full" is joint
    space-time attention, "factorized" the spatial and temporal steps as reshapes, "masked" the
    same two steps as joint attention under the block masks.
    """

    frames: int
    patches: int
    embed_dim: int
    num_heads: int
    full_scores: int
    factorized_scores: int
    masked_scores: int
    full_flops_per_head: int
    factorized_flops_per_head: int
    masked_flops_per_head: int
    full_flops: int
    factorized_flops: int
    masked_flops: int

    @property
    def wasted_scores(self) -> int:
        """Scores the masked form computes and the mask throws away, per head."""
        return self.masked_scores - self.factorized_scores

    @property
    def wasted_flops(self) -> int:
        """FLOPs the masked form spends beyond the reshaped one, per layer."""
        return self.masked_flops - self.factorized_flops


def video_attention_cost(
    *, frames: int, patches: int, embed_dim: int, num_heads: int
) -> VideoAttentionCost:
    """The attention cost of one layer over a clip of `frames` x `patches` tokens, for
    multi-head attention of width embed_dim and num_heads heads (with biases, as
    `qkv.layers.MultiHeadAttention` builds it)."""
    T, N = check_positive_int("frames", frames), check_positive_int("patches", patches)
    E, H = check_positive_int("embed_dim", embed_dim), check_positive_int("num_heads", num_heads)
    if E % H:
        raise ValueError(f"num_heads: {H} does not divide embed_dim={E}; expected a divisor")
    layer = AttentionLayout(embed_dim=E, num_heads=H, num_kv_heads=H, head_dim=E // H, bias=True)
    L = T * N
    full, factorized = L * L, T * N * N + N * T * T
    per_score = 2 * 2 * layer.head_dim  # Q K^T, then weights @ V: 2 D multiply-adds a score
    return VideoAttentionCost(
        frames=T, patches=N, embed_dim=E, num_heads=H,
        full_scores=full, factorized_scores=factorized, masked_scores=2 * full,
        full_flops_per_head=per_score * full,
        factorized_flops_per_head=per_score * factorized,
        masked_flops_per_head=per_score * 2 * full,
        full_flops=layer.flops(L, L),
        factorized_flops=T * layer.flops(N, N) + N * layer.flops(T, T),
        masked_flops=2 * layer.flops(L, L),
    )  # fmt: skip
