"""`qkv.analysis.cost.flash_io` and `qkv.attention.tiled.count_tile_traffic`: the HBM traffic of
Dao et al. 2022 (Algorithms 0 and 1, Theorem 2) and of qkv's tiled loop.

Outside references: the bytes the real tiled forward moves, counted tile by tile (qkv's model
must equal them per tensor and direction, on lengths that are not a multiple of the block,
causal with L_q != L_k, GQA, fp64 and bf16 inputs); torch.tril's dense causal mask (the tiles
counted are exactly those holding a visible score); literal float64 replays of Algorithms 0
and 1 written here from the paper, which count the elements of every slice they load and store
and whose outputs equal `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.analysis.cost.flash_io import (
    flash_attention_io,
    paper_block_sizes,
    standard_attention_io,
    theorem2_flash,
    theorem2_standard,
    tiled_forward_io,
)
from qkv.attention.tiled import count_tile_traffic, flash_attention
from qkv.attention.tiled.traffic import active_traffic

SHAPES = [  # (B, H, H_kv, L_q, L_k, D, D_v, block_q, block_k, causal)
    (1, 1, 1, 37, 37, 8, 8, 8, 5, False),
    (1, 1, 1, 37, 37, 8, 8, 8, 5, True),
    (2, 4, 2, 20, 33, 6, 3, 7, 4, True),  # GQA, L_q < L_k, D_v != D
    (1, 2, 1, 33, 20, 4, 4, 8, 5, True),  # L_q > L_k: the first query blocks see no key
    (1, 3, 3, 16, 16, 4, 4, 16, 16, False),  # one tile
    (2, 2, 1, 1, 40, 8, 8, 4, 6, True),  # a decoding step
]


def _inputs(B, H, H_kv, L_q, L_k, D, D_v, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L_q, D, generator=generator).to(dtype)
    k = torch.randn(B, H_kv, L_k, D, generator=generator).to(dtype)
    v = torch.randn(B, H_kv, L_k, D_v, generator=generator).to(dtype)
    return q, k, v


def _assert_model_equals_count(shape, dtype=torch.float32, element_bytes=4):
    B, H, H_kv, L_q, L_k, D, D_v, block_q, block_k, causal = shape
    q, k, v = _inputs(B, H, H_kv, L_q, L_k, D, D_v, dtype)
    with count_tile_traffic() as traffic:
        flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    model = tiled_forward_io(
        query_len=L_q, key_len=L_k, head_dim=D, value_dim=D_v, block_q=block_q,
        block_k=block_k, causal=causal, batch=B, num_heads=H, num_kv_heads=H_kv,
        element_bytes=element_bytes,
    )  # fmt: skip
    for direction, per_tensor in (("read", model.reads), ("write", model.writes)):
        for tensor in ("q", "k", "v", "o", "lse"):
            expected = per_tensor.get(tensor, 0)
            assert traffic.elements(direction=direction, tensor=tensor) == expected, (
                direction,
                tensor,
            )
    assert traffic.bytes() == model.bytes


@pytest.mark.parametrize("shape", SHAPES)
def test_model_equals_the_counted_traffic_of_the_tiled_loop(shape):
    _assert_model_equals_count(shape)


@pytest.mark.parametrize(("dtype", "element_bytes"), [(torch.float64, 8), (torch.bfloat16, 4)])
def test_bytes_are_those_of_the_compute_dtype(dtype, element_bytes):
    _assert_model_equals_count(SHAPES[2], dtype, element_bytes)  # bf16 is computed in fp32


@settings(max_examples=25, deadline=None)
@given(
    L_q=st.integers(1, 24), L_k=st.integers(1, 24), block_q=st.integers(1, 9),
    block_k=st.integers(1, 9), group=st.sampled_from([1, 2]), causal=st.booleans(),
)  # fmt: skip
def test_model_equals_count_on_any_lengths_and_blocks(L_q, L_k, block_q, block_k, group, causal):
    _assert_model_equals_count((1, 2 * group, 2, L_q, L_k, 4, 4, block_q, block_k, causal))


def test_counted_tiles_are_those_holding_a_visible_score():
    B, H, H_kv, L_q, L_k, D, D_v, block_q, block_k = 2, 4, 2, 20, 33, 6, 3, 7, 4
    q, k, v = _inputs(B, H, H_kv, L_q, L_k, D, D_v)
    with count_tile_traffic() as traffic:
        flash_attention(q, k, v, causal=True, block_q=block_q, block_k=block_k)
    visible = torch.ones(L_q, L_k, dtype=torch.bool).tril(diagonal=L_k - L_q)  # bottom-right
    expected = {}
    for i, q_start in enumerate(range(0, L_q, block_q)):
        for j, k_start in enumerate(range(0, L_k, block_k)):
            block = visible[q_start : q_start + block_q, k_start : k_start + block_k]
            if block.any():  # one Q tile and one K and V tile, in fp32
                rows, keys = block.shape
                expected[(i, j)] = 4 * (B * H * rows * D + B * H_kv * keys * (D + D_v))
    assert traffic.per_tile() == expected


def test_counting_changes_no_result_and_stops_with_its_block():
    q, k, v = _inputs(1, 2, 1, 19, 19, 8, 8)
    plain = flash_attention(q, k, v, causal=True, block_q=4, block_k=6)
    assert active_traffic() is None
    with count_tile_traffic() as outer:
        with count_tile_traffic() as inner:
            counted = flash_attention(q, k, v, causal=True, block_q=4, block_k=6)
        assert active_traffic() is outer
    assert active_traffic() is None
    assert torch.equal(counted, plain)
    reference = F.scaled_dot_product_attention(q, k.expand(1, 2, 19, 8), v.expand(1, 2, 19, 8),
                                               is_causal=True)  # fmt: skip
    torch.testing.assert_close(counted, reference)
    assert inner.bytes() > 0 and outer.transfers == []
    with pytest.raises(RuntimeError), count_tile_traffic():
        raise RuntimeError("inside the block")
    assert active_traffic() is None


def test_backward_is_not_counted():
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 2, 13, 13, 4, 4))
    with count_tile_traffic() as forward_only:
        flash_attention(q, k, v, block_q=4, block_k=4)
    with count_tile_traffic() as with_backward:
        flash_attention(q, k, v, block_q=4, block_k=4).sum().backward()
    assert q.grad is not None
    assert with_backward.transfers == forward_only.transfers


def test_bias_and_dense_mask_tiles_are_counted():
    B, L, D = 2, 11, 4
    q, k, v = _inputs(B, 2, 2, L, L, D, D)
    bias = torch.randn(L, L)
    mask = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(1)) > 0.3
    with count_tile_traffic() as traffic:
        flash_attention(q, k, v, bias=bias, mask=mask, block_q=4, block_k=3)
    # every tile is computed (nothing hides one) and reads its slice of each, once
    assert traffic.bytes(tensor="bias") == bias.numel() * bias.element_size()
    assert traffic.bytes(tensor="mask") == mask.numel() * mask.element_size()


def _algorithm_0(q, k, v):
    """Dao et al. 2022 Algorithm 0 on (N, d) float64 tensors, counting what each line moves."""
    moved = Counter()
    moved["read q"], moved["read k"] = q.numel(), k.numel()
    scores = q @ k.T
    moved["write s"] += scores.numel()
    moved["read s"] += scores.numel()
    probs = torch.softmax(scores, dim=-1)
    moved["write p"] += probs.numel()
    moved["read p"], moved["read v"] = probs.numel(), v.numel()
    out = probs @ v
    moved["write o"] += out.numel()
    return out, moved


def _algorithm_1(q, k, v, block_q, block_k):
    """Dao et al. 2022 Algorithm 1, line by line, on (N, d) float64 tensors in "HBM"."""
    N, d = q.shape
    out, l, m = (
        torch.zeros(N, d, dtype=q.dtype),
        torch.zeros(N, dtype=q.dtype),
        torch.full((N,), -math.inf, dtype=q.dtype),
    )
    moved = Counter({"write o": out.numel(), "write l": l.numel(), "write m": m.numel()})
    for k_start in range(0, N, block_k):
        k_j, v_j = k[k_start : k_start + block_k], v[k_start : k_start + block_k]  # line 6
        moved["read k"] += k_j.numel()
        moved["read v"] += v_j.numel()
        for q_start in range(0, N, block_q):
            rows = slice(q_start, q_start + block_q)
            q_i, o_i, l_i, m_i = q[rows], out[rows].clone(), l[rows].clone(), m[rows].clone()
            for name, x in (("q", q_i), ("o", o_i), ("l", l_i), ("m", m_i)):  # line 8
                moved[f"read {name}"] += x.numel()
            s_ij = q_i @ k_j.T  # lines 9-11
            m_ij = s_ij.amax(dim=-1)
            p_ij = torch.exp(s_ij - m_ij[:, None])
            l_ij = p_ij.sum(dim=-1)
            m_new = torch.maximum(m_i, m_ij)
            l_new = torch.exp(m_i - m_new) * l_i + torch.exp(m_ij - m_new) * l_ij
            out[rows] = (
                (l_i * torch.exp(m_i - m_new))[:, None] * o_i
                + torch.exp(m_ij - m_new)[:, None] * (p_ij @ v_j)
            ) / l_new[:, None]  # line 12
            l[rows], m[rows] = l_new, m_new  # line 13
            for name, x in (("o", out[rows]), ("l", l[rows]), ("m", m[rows])):
                moved[f"write {name}"] += x.numel()
    return out, moved


def _as_counter(traffic):
    moved = Counter({f"read {t}": n for t, n in traffic.reads.items()})
    moved.update({f"write {t}": n for t, n in traffic.writes.items()})
    return moved


def test_standard_attention_model_equals_a_replay_of_algorithm_0():
    N, d = 21, 6
    q, k, v = torch.randn(3, N, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out, moved = _algorithm_0(q, k, v)
    reference = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0)[0]
    torch.testing.assert_close(out, reference)
    model = standard_attention_io(seq_len=N, head_dim=d, element_bytes=2)
    assert _as_counter(model) == moved
    assert model.bytes == 2 * sum(moved.values())


@pytest.mark.parametrize(("N", "d", "block_q", "block_k"), [(37, 8, 5, 7), (40, 4, 4, 8)])
def test_algorithm_1_model_equals_a_replay_of_algorithm_1(N, d, block_q, block_k):
    q, k, v = torch.randn(3, N, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, moved = _algorithm_1(q, k, v, block_q, block_k)
    reference = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0)[0]
    torch.testing.assert_close(out, reference)
    model = flash_attention_io(seq_len=N, head_dim=d, block_q=block_q, block_k=block_k)
    assert _as_counter(model) == moved
    # Every query row makes one round trip per K/V block, whatever B_r
    other = flash_attention_io(seq_len=N, head_dim=d, block_q=1, block_k=block_k)
    assert other == model


@pytest.mark.parametrize(("M", "d"), [(49152, 64), (16384, 64), (1000, 64), (100, 8), (7, 2)])
def test_paper_block_sizes_are_the_smallest_b_c_with_4_d_b_c_at_least_m(M, d):
    block_q, block_k = paper_block_sizes(sram_elements=M, head_dim=d)
    assert 4 * d * (block_k - 1) < M <= 4 * d * block_k  # B_c = ceil(M / 4d)
    assert block_q == (d if block_k >= d else block_k)
    assert paper_block_sizes(sram_elements=49152, head_dim=64) == (64, 192)


def test_theorem_2_forms_and_their_constants():
    for N, d in ((7, 3), (1000, 64)):  # 3 N d + 2 N^2 read, N d + 2 N^2 written
        exact = standard_attention_io(seq_len=N, head_dim=d).elements
        assert exact == 4 * theorem2_standard(seq_len=N, head_dim=d)
    N, d, block_k = 2**20, 64, 256
    M = 4 * d * block_k  # the SRAM whose paper blocks have B_c = block_k
    exact = flash_attention_io(seq_len=N, head_dim=d, block_q=d, block_k=block_k).elements
    bound = theorem2_flash(seq_len=N, head_dim=d, sram_elements=M)
    assert exact / bound == pytest.approx(12 + 16 / d, rel=1e-3)
    with pytest.raises(ValueError, match="sram_elements"):
        theorem2_flash(seq_len=16, head_dim=8, sram_elements=16 * 8 + 1)


def test_bad_arguments_name_themselves():
    common = {"query_len": 8, "key_len": 8, "head_dim": 4, "block_q": 2, "block_k": 2}
    with pytest.raises(ValueError, match="num_kv_heads"):
        tiled_forward_io(**common, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="block_k"):
        tiled_forward_io(**{**common, "block_k": 0})
    with pytest.raises(TypeError, match="seq_len"):
        standard_attention_io(seq_len=True, head_dim=4)
    with pytest.raises(ValueError, match="sram_elements"):
        paper_block_sizes(sram_elements=0, head_dim=4)
    with pytest.raises(ValueError, match="direction"), count_tile_traffic() as traffic:
        traffic.record("copy", "q", torch.zeros(2))
