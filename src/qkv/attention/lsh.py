"""LSH attention: each query attends only to the keys that hash to its bucket.

Softmax is dominated by its largest terms, so a query needs only the keys closest to it. The
Reformer finds them by locality-sensitive hashing (Kitaev, Kaiser, Levskaya 2020, s2):

1. Shared QK: the keys are the queries normalised, k_j = q_j / |q_j|, so that q_i and k_i land
   in the same bucket.
2. Angular LSH by a random rotation R of shape (D, num_buckets / 2), one per hashing round:
   h(x) = argmax([xR; -xR]). Vectors close in angle share a bucket more often (Andoni et al.
   2015, the hash the paper uses).
3. Per round: sort the positions by (bucket, position); split the sorted sequence into chunks of
   `chunk_size`; each chunk attends to itself and to the chunk before it, only to keys of the
   query's bucket, with causal masking when asked (key position <= query position). A token
   attends to itself only when no other key is available: its own key is masked (-inf) unless
   its row would be empty, and then it is its only key, with its true score (a large finite
   negative score instead would leave such a round a near-zero weight in step 4).
4. Undo the sort and combine the rounds r = 1 .. n_r with their log-sum-exps z_r (s2,
   multi-round LSH attention): o_i = sum_r exp(z_r - logsumexp_r z_r) o_i^r. A key that
   query i sees in N_ij rounds has its score lowered by log N_ij in each of them, so the
   rounds together weigh it once: the result is softmax attention over the union of the sets.

The first chunk has no chunk before it (the sorted order does not wrap around). Scores are
computed in fp32 (fp64 stays fp64); masked scores are -inf. Every query sees at least itself,
so no row is empty. `lsh_attention_cost` counts what this costs next to full attention, in the
units of `qkv cost`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qkv.validation import check_int, check_positive_float, check_positive_int, describe

__all__ = ["LSHAttentionCost", "lsh_attention", "lsh_attention_cost", "lsh_hash"]


def lsh_hash(
    x: torch.Tensor,
    *,
    num_buckets: int,
    num_rounds: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Bucket ids (B, H, num_rounds, L) of x (B, H, L, D): h(x) = argmax([xR; -xR]) (s2).

    R is drawn as `torch.randn(H, num_rounds, D, num_buckets // 2, generator=generator)` on x's
    device (in fp32, then cast to the compute dtype): one random rotation per head and round,
    shared by the batch. num_buckets must be even: each column of R gives two buckets, +x and -x.
    """
    _check_tensor("x", x)
    _check_num_buckets(num_buckets)
    check_positive_int("num_rounds", num_rounds)
    _check_generator(generator)
    B, H, L, D = x.shape
    dtype = torch.promote_types(x.dtype, torch.float32)
    rotations = torch.randn(
        H, num_rounds, D, num_buckets // 2, generator=generator, device=x.device
    )  # (H, R, D, num_buckets / 2)
    rotated = torch.einsum("bhld,hrdn->bhrln", x.to(dtype), rotations.to(dtype))
    return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)  # (B, H, R, L)


def lsh_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    *,
    num_buckets: int,
    num_rounds: int = 1,
    chunk_size: int,
    causal: bool = False,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    return_buckets: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Shared-QK LSH attention (Kitaev et al. 2020, s2): output (B, H, L, D_v) in qk's dtype.

    qk (B, H, L, D) holds the queries (the keys are qk normalised), v (B, H, L, D_v) the values.
    num_buckets (even) and num_rounds: the hash of `lsh_hash`, drawn from `generator`; chunk_size:
    the length of the chunks of the sorted order; scale: 1 / sqrt(D) by default. With
    return_buckets, returns (output, buckets (B, H, num_rounds, L)).
    """
    _check_arguments(qk, v, num_buckets, num_rounds, chunk_size, causal, scale, generator)
    B, H, L, D = qk.shape
    dtype = torch.promote_types(torch.promote_types(qk.dtype, v.dtype), torch.float32)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    buckets = lsh_hash(qk, num_buckets=num_buckets, num_rounds=num_rounds, generator=generator)
    chunks = _sorted_chunks(buckets, chunk_size)
    visible, counts = _visible_keys(chunks, causal)
    queries = qk.to(dtype)
    keys = F.normalize(queries, dim=-1)  # k_j = q_j / |q_j|
    output, lse = _attend_chunks(chunks, queries * scale, keys, v.to(dtype), visible, counts)
    output, lse = _unsort(chunks, output), _unsort(chunks, lse.unsqueeze(-1)).squeeze(-1)
    weights = torch.softmax(lse, dim=2)  # (B, H, R, L): exp(z_r - logsumexp_r z_r)
    output = (weights.unsqueeze(-1) * output).sum(dim=2).to(qk.dtype)  # (B, H, L, D_v)
    return (output, buckets) if return_buckets else output


class _Chunks(NamedTuple):
    """The sorted order of every round, cut into chunks of `size` (n = ceil(L / size) of them).

    queries (B, H, R, n, size) and keys (B, H, R, n, 2 size): the positions in the sequence of
    each chunk's queries and of the keys it sees (the chunk before, then itself); -1 marks the
    slots past the end of the sequence and before its start. slot (B, H, R, L): where each
    position lands in its round's sorted order.
    """

    buckets: torch.Tensor
    slot: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    size: int


def _sorted_chunks(buckets: torch.Tensor, size: int) -> _Chunks:
    """Sort each round by (bucket, position) and cut the order into chunks (s2, Figure 2)."""
    B, H, R, L = buckets.shape
    num_chunks = -(-L // size)
    # a stable sort by bucket keeps the positions of one bucket in increasing order
    order = torch.sort(buckets, dim=-1, stable=True).indices  # (B, H, R, L)
    positions = torch.arange(L, device=order.device).expand_as(order)
    slot = torch.empty_like(order).scatter_(-1, order, positions)  # inverse permutation
    after = order.new_full((B, H, R, num_chunks * size - L), -1)
    before = order.new_full((B, H, R, size), -1)
    padded = torch.cat([order, after], dim=-1)  # (B, H, R, n * size)
    queries = padded.view(B, H, R, num_chunks, size)  # (B, H, R, n, size)
    keys = torch.cat([before, padded], dim=-1).unfold(-1, 2 * size, size)  # (B, H, R, n, 2 size)
    return _Chunks(buckets, slot, queries, keys, size)


def _visible_keys(chunks: _Chunks, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, counts), both (B, H, R, n, size, 2 size): may each query of a chunk see each key
    of its window in this round, and in how many rounds it sees that key (at least 1 where
    visible; the N_ij of s2's multi-round attention)."""
    query = chunks.queries.unsqueeze(-1)  # (B, H, R, n, size, 1)
    key = chunks.keys.unsqueeze(-2)  # (B, H, R, n, 1, 2 size)
    same_bucket = _in_round(chunks.buckets, query) == _in_round(chunks.buckets, key)
    others = same_bucket & _allowed(query, key, causal) & (query != key)
    alone = ~others.any(dim=-1)  # (B, H, R, n, size): no key but itself
    visible = others | ((query == key) & alone.unsqueeze(-1))
    alone_at = _unsort(chunks, alone.unsqueeze(-1)).squeeze(-1)  # (B, H, R, L)
    counts = torch.zeros(visible.shape, dtype=torch.int32, device=visible.device)
    for other in range(chunks.buckets.shape[2]):
        counts += _seen_in_round(chunks, alone_at, other, query, key, causal)
    return visible, counts


def _seen_in_round(
    chunks: _Chunks,
    alone_at: torch.Tensor,
    other: int,
    query: torch.Tensor,
    key: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """Does query see key in round `other`: same bucket, same or previous chunk of that round's
    sorted order, allowed, and not itself unless alone there. Bool, broadcast of query and key."""
    bucket, slot = chunks.buckets[:, :, other], chunks.slot[:, :, other]  # (B, H, L) each
    same_bucket = _lookup(bucket, query) == _lookup(bucket, key)
    query_chunk = _lookup(slot, query) // chunks.size
    key_chunk = _lookup(slot, key) // chunks.size
    near = (query_chunk == key_chunk) | (query_chunk == key_chunk + 1)
    not_self = (query != key) | _lookup(alone_at[:, :, other], query)
    return same_bucket & near & not_self & _allowed(query, key, causal)


def _in_round(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """table (B, H, R, L) read at positions (B, H, R, ...) of the same round; -1 reads 0."""
    B, H, R = positions.shape[:3]
    index = positions.clamp(min=0).reshape(B, H, R, -1)  # (B, H, R, P)
    return table.gather(-1, index).view(positions.shape)  # (B, H, R, ...)


def _allowed(query: torch.Tensor, key: torch.Tensor, causal: bool) -> torch.Tensor:
    """Both are positions of the sequence (not padding), and causal if asked."""
    allowed = (query >= 0) & (key >= 0)
    return allowed & (key <= query) if causal else allowed


def _lookup(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """table (B, H, L) read at positions (B, H, ...), -1 (padding) read as position 0."""
    B, H = positions.shape[:2]
    index = positions.clamp(min=0).reshape(B, H, -1)  # (B, H, P)
    return table.gather(-1, index).view(positions.shape)  # (B, H, ...)


def _rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) at positions (B, H, ...): (B, H, ..., D); -1 (padding) reads row 0."""
    B, H, L, D = x.shape
    index = positions.clamp(min=0).reshape(B, H, -1, 1).expand(B, H, -1, D)  # (B, H, P, D)
    return x.gather(2, index).view(*positions.shape, D)  # (B, H, ..., D)


def _attend_chunks(
    chunks: _Chunks,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per round and chunk: (output (B, H, R, n, size, D_v), lse (B, H, R, n, size)).

    Scores minus log N_ij, softmax over the visible keys of the window. Rows of padding slots
    see their whole window (finite, never read back) so that no row is all -inf."""
    q = _rows(queries, chunks.queries)  # (B, H, R, n, size, D)
    k = _rows(keys, chunks.keys)  # (B, H, R, n, 2 size, D)
    v = _rows(values, chunks.keys)  # (B, H, R, n, 2 size, D_v)
    scores = q @ k.transpose(-1, -2)  # (B, H, R, n, size, 2 size)
    scores = scores - counts.clamp(min=1).to(scores.dtype).log()
    padding = (chunks.queries < 0).unsqueeze(-1)  # (B, H, R, n, size, 1)
    scores = scores.masked_fill(~(visible | padding), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, R, n, size)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    return weights @ v, lse


def _unsort(chunks: _Chunks, x: torch.Tensor) -> torch.Tensor:
    """x (B, H, R, n, size, F) in sorted slots -> (B, H, R, L, F) in sequence order."""
    B, H, R, L = chunks.slot.shape
    num_features = x.shape[-1]
    in_order = x.reshape(B, H, R, -1, num_features)[:, :, :, :L]  # (B, H, R, L, F) by slot
    index = chunks.slot.unsqueeze(-1).expand(B, H, R, L, num_features)
    return in_order.gather(3, index)


@dataclass(frozen=True)
class LSHAttentionCost:
    """What one LSH attention call costs, next to full attention at the same length.

    FLOPs count 2 per multiply-add, matrix products only, as `qkv cost` does: the scores and
    weighted sums of every round over the (2 chunk_size)-key windows (attention_flops), the
    rotations of the hash (hash_flops). sort_operations: B H n_r L ceil(log2 L) comparisons of
    the per-round sorts, one operation each. score_bytes: the chunk scores (B, H, n_r, n,
    chunk_size, 2 chunk_size) of all rounds, the largest intermediate, n = ceil(L / chunk_size).
    full_attention_flops and full_score_bytes: the dense (B, H, L, L) computation, Q K^T and the
    weighted sum (4 B H L^2 D, with D_v = D) and its score matrix.
    """

    length: int
    attention_flops: int
    hash_flops: int
    sort_operations: int
    score_bytes: int
    full_attention_flops: int
    full_score_bytes: int

    @property
    def flops(self) -> int:
        """Everything: attention, hash and sort, a comparison counting as one operation."""
        return self.attention_flops + self.hash_flops + self.sort_operations


def lsh_attention_cost(
    *,
    length: int,
    head_dim: int,
    num_buckets: int,
    num_rounds: int,
    chunk_size: int,
    batch: int = 1,
    num_heads: int = 1,
    value_dim: int | None = None,
    bytes_per_element: int = 4,
) -> LSHAttentionCost:
    """The FLOPs, sort and score bytes of `lsh_attention` on (B, H, L, D) inputs (value_dim:
    D_v, default D), with those of full attention; bytes_per_element 4: scores are in fp32.

    Linear in L for a fixed chunk size (plus the L log L sort), where full attention is
    quadratic: the comparison of Kitaev et al. 2020, s2 (Table 1)."""
    L, D = check_positive_int("length", length), check_positive_int("head_dim", head_dim)
    D_v = D if value_dim is None else check_positive_int("value_dim", value_dim)
    _check_num_buckets(num_buckets)
    R = check_positive_int("num_rounds", num_rounds)
    size = check_positive_int("chunk_size", chunk_size)
    heads = check_positive_int("batch", batch) * check_positive_int("num_heads", num_heads)
    check_positive_int("bytes_per_element", bytes_per_element)
    pairs = heads * R * -(-L // size) * size * 2 * size  # every (query slot, window key)
    return LSHAttentionCost(
        length=L,
        attention_flops=2 * pairs * (D + D_v),
        hash_flops=2 * heads * R * L * D * (num_buckets // 2),
        sort_operations=heads * R * L * (L - 1).bit_length(),
        score_bytes=pairs * bytes_per_element,
        full_attention_flops=2 * heads * L * L * (D + D_v),
        full_score_bytes=heads * L * L * bytes_per_element,
    )


def _check_arguments(
    qk: object,
    v: object,
    num_buckets: object,
    num_rounds: object,
    chunk_size: object,
    causal: object,
    scale: object,
    generator: object,
) -> None:
    _check_tensor("qk", qk)
    _check_tensor("v", v)
    if v.shape[:3] != qk.shape[:3]:
        raise ValueError(
            f"v: expected (B, H, L, D_v) with (B, H, L) = {tuple(qk.shape[:3])} as qk, "
            f"got shape {tuple(v.shape)}"
        )
    _check_num_buckets(num_buckets)
    check_positive_int("num_rounds", num_rounds)
    check_positive_int("chunk_size", chunk_size)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {describe(causal)}")
    if scale is not None:
        check_positive_float("scale", scale)
    _check_generator(generator)


def _check_tensor(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor (B, H, L, D), got {describe(x)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 4 or x.shape[2] == 0 or x.shape[3] == 0:
        raise ValueError(
            f"{name}: expected 4 dimensions (B, H, L, D) with L, D >= 1, got shape {tuple(x.shape)}"
        )


def _check_num_buckets(num_buckets: object) -> None:
    check_int("num_buckets", num_buckets, minimum=2)
    if num_buckets % 2:
        raise ValueError(
            f"num_buckets: expected an even int (R gives +x and -x), got {num_buckets}"
        )


def _check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {describe(generator)}")
