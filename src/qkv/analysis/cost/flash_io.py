"""HBM traffic of exact attention, element by element: standard attention against FlashAttention.

Dao et al. 2022 ("FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
s3.2) count the elements that move between a GPU's large, slow memory (HBM) and its small, fast
on-chip memory (SRAM, M elements). Theorem 2: standard attention (their Algorithm 0) makes
Theta(N d + N^2) HBM accesses, FlashAttention (Algorithm 1) Theta(N^2 d^2 / M), for sequence
length N, head dimension d and d <= M <= N d. This module gives the exact counts behind both
Theta forms, for one head, and the exact count of the loop qkv runs:

- `standard_attention_io`: Algorithm 0. Read Q, K, write S = Q K^T; read S, write
  P = softmax(S); read P, V, write O = P V.
- `flash_attention_io`: Algorithm 1, the paper's loop order. Before the loops, O = 0,
  l = 0, m = -inf are written (line 2). The outer loop runs over the T_c = ceil(N / B_c) K/V
  blocks, loading each K_j, V_j once (line 6); the inner loop over the Q blocks loads Q_i, O_i,
  l_i, m_i (line 8) and writes back O_i, l_i, m_i (lines 12-13) at every step. Every query row
  makes T_c round trips, so the count depends on B_c alone, not on B_r.
- `tiled_forward_io`: the forward of `qkv.flash_attention`, in FlashAttention-2's order (Dao
  2023, Algorithm 1): the outer loop runs over query blocks, the inner one over the key blocks
  that the masking leaves computed (causal tiles above the diagonal are skipped). Its buffers O
  and the log-sum-exp (one statistic per row, not l and m) are written once before the loop
  (0 and -inf), and each query block reads its slices once and writes them once. Within a
  query block, every computed tile reads K_j and V_j, and reads Q_i again: the PyTorch loop
  takes the Q slice at each tile, where a GPU kernel keeps Q_i in SRAM. With GQA, the G query
  heads that share a K/V head share its K/V tiles. This is the count that
  `qkv.attention.tiled.count_tile_traffic` observes, tile by tile.

Names: block_q is the paper's B_r (query rows per block), block_k its B_c (key rows per block);
sram_elements is M. `paper_block_sizes` is Algorithm 1's choice of both from M, and
`theorem2_standard` / `theorem2_flash` are the Theta forms with their constants set to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qkv.validation import check_positive_int

__all__ = [
    "HbmTraffic",
    "flash_attention_io",
    "paper_block_sizes",
    "standard_attention_io",
    "theorem2_flash",
    "theorem2_standard",
    "tiled_forward_io",
]


@dataclass(frozen=True)
class HbmTraffic:
    """Elements read from and written to HBM, per tensor ("q", "k", "v", "o", "s", "p", "l",
    "m", "lse"), and their size at `element_bytes` bytes per element."""

    reads: dict[str, int]
    writes: dict[str, int]
    element_bytes: int

    @property
    def read_elements(self) -> int:
        return sum(self.reads.values())

    @property
    def write_elements(self) -> int:
        return sum(self.writes.values())

    @property
    def elements(self) -> int:
        return self.read_elements + self.write_elements

    @property
    def bytes(self) -> int:
        return self.elements * self.element_bytes

    def tensor_bytes(self, tensor: str) -> int:
        """Bytes of one tensor, read and written."""
        return (self.reads.get(tensor, 0) + self.writes.get(tensor, 0)) * self.element_bytes


def standard_attention_io(*, seq_len: int, head_dim: int, element_bytes: int = 4) -> HbmTraffic:
    """Exact HBM traffic of standard attention (Dao et al. 2022, Algorithm 0), one head:
    reads 3 N d + 2 N^2 elements, writes N d + 2 N^2."""
    N = check_positive_int("seq_len", seq_len)
    d = check_positive_int("head_dim", head_dim)
    check_positive_int("element_bytes", element_bytes)
    return HbmTraffic(
        reads={"q": N * d, "k": N * d, "s": N * N, "p": N * N, "v": N * d},
        writes={"s": N * N, "p": N * N, "o": N * d},
        element_bytes=element_bytes,
    )


def flash_attention_io(
    *, seq_len: int, head_dim: int, block_q: int, block_k: int, element_bytes: int = 4
) -> HbmTraffic:
    """Exact HBM traffic of FlashAttention's forward in the paper's order (Dao et al. 2022,
    Algorithm 1: K/V blocks outside, Q blocks inside), one head.

    With T_c = ceil(N / block_k): reads 2 N d (K, V once) + T_c (2 N d + 2 N) (Q_i, O_i, l_i,
    m_i at every inner step); writes N d + 2 N (line 2) + T_c (N d + 2 N). block_q (B_r) is
    checked but does not change the count: each query row is loaded T_c times whatever the
    block that carries it.
    """
    N = check_positive_int("seq_len", seq_len)
    d = check_positive_int("head_dim", head_dim)
    check_positive_int("block_q", block_q)
    check_positive_int("element_bytes", element_bytes)
    passes = math.ceil(N / check_positive_int("block_k", block_k))  # T_c
    return HbmTraffic(
        reads={"q": passes * N * d, "k": N * d, "v": N * d, "o": passes * N * d,
               "l": passes * N, "m": passes * N},
        writes={"o": (1 + passes) * N * d, "l": (1 + passes) * N, "m": (1 + passes) * N},
        element_bytes=element_bytes,
    )  # fmt: skip


def tiled_forward_io(
    *,
    query_len: int,
    key_len: int,
    head_dim: int,
    block_q: int,
    block_k: int,
    causal: bool = False,
    batch: int = 1,
    num_heads: int = 1,
    num_kv_heads: int | None = None,
    value_dim: int | None = None,
    element_bytes: int = 4,
) -> HbmTraffic:
    """Exact HBM traffic of `qkv.flash_attention`'s forward loop (FlashAttention-2 order; see
    the module): queries (B, H, L_q, D), keys (B, H_kv, L_k, D), values (B, H_kv, L_k, D_v).

    causal: aligned bottom-right as in `qkv.attention` (query i sees keys j <= i + L_k - L_q);
    the tiles it hides are not computed, and a query block that sees no key still reads and
    writes its output and log-sum-exp. element_bytes: of the compute dtype (4 for fp16, bf16 and
    fp32 inputs, which the loop computes in fp32; 8 for fp64).
    """
    L_q = check_positive_int("query_len", query_len)
    L_k = check_positive_int("key_len", key_len)
    D = check_positive_int("head_dim", head_dim)
    D_v = D if value_dim is None else check_positive_int("value_dim", value_dim)
    B, H = check_positive_int("batch", batch), check_positive_int("num_heads", num_heads)
    H_kv = H if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
    if H % H_kv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {H}, got {H_kv}")
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    check_positive_int("element_bytes", element_bytes)
    q_tile_rows = key_rows = 0  # query rows read, one Q tile per computed tile; key rows read
    for q_start in range(0, L_q, block_q):
        rows = min(q_start + block_q, L_q) - q_start
        tiles, keys = _computed_keys(q_start + rows - 1 + L_k - L_q, L_k, block_k, causal)
        q_tile_rows += tiles * rows
        key_rows += keys
    rows_out = B * H * L_q  # output and log-sum-exp rows
    return HbmTraffic(
        reads={"q": B * H * q_tile_rows * D, "k": B * H_kv * key_rows * D,
               "v": B * H_kv * key_rows * D_v, "o": rows_out * D_v, "lse": rows_out},
        writes={"o": 2 * rows_out * D_v, "lse": 2 * rows_out},  # set before the loop, then once
        element_bytes=element_bytes,
    )  # fmt: skip


def _computed_keys(last_position: int, key_len: int, block_k: int, causal: bool):
    """(computed key blocks, keys in them) for a query block whose last query sits at key
    position `last_position`: all blocks, or under causal the blocks starting at or before it."""
    num_blocks = math.ceil(key_len / block_k)
    if not causal:
        return num_blocks, key_len
    if last_position < 0:  # the whole block precedes the first key: nothing visible
        return 0, 0
    tiles = min(num_blocks, last_position // block_k + 1)
    return tiles, min(tiles * block_k, key_len)


def paper_block_sizes(*, sram_elements: int, head_dim: int) -> tuple[int, int]:
    """(block_q, block_k) = (B_r, B_c) from an SRAM of M elements (Dao et al. 2022, Algorithm 1
    line 1): B_c = ceil(M / 4d), B_r = min(ceil(M / 4d), d), so that Q_i, K_j, V_j and O_i fit."""
    M = check_positive_int("sram_elements", sram_elements)
    d = check_positive_int("head_dim", head_dim)
    block_k = math.ceil(M / (4 * d))
    return min(block_k, d), block_k


def theorem2_standard(*, seq_len: int, head_dim: int) -> int:
    """N d + N^2: Theorem 2's Theta form for standard attention (Dao et al. 2022), constant 1."""
    N = check_positive_int("seq_len", seq_len)
    return N * check_positive_int("head_dim", head_dim) + N * N


def theorem2_flash(*, seq_len: int, head_dim: int, sram_elements: int) -> float:
    """N^2 d^2 / M: Theorem 2's Theta form for FlashAttention (Dao et al. 2022), constant 1.

    The theorem holds for d <= M <= N d; an M outside that range raises a ValueError.
    """
    N = check_positive_int("seq_len", seq_len)
    d = check_positive_int("head_dim", head_dim)
    M = check_positive_int("sram_elements", sram_elements)
    if not d <= M <= N * d:
        raise ValueError(
            f"sram_elements: expected head_dim <= M <= seq_len * head_dim = [{d}, {N * d}] "
            f"(Theorem 2's range), got {M}"
        )
    return N * N * d * d / M
