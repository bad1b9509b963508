"""FlashAttention-2 as Triton kernels: forward, and backward from the saved log-sum-exp.

Layer 1 of 3 (kernels -> `function.py`, the autograd.Function -> `backend.py`, qkv.attention's
backend `triton`). Dao 2023, Algorithms 1 and 2.

Each program of the forward owns BLOCK_M queries of one (batch, query head) and streams the
keys and values of that head's K/V head (GQA/MQA: head // group, never a copy) through SRAM,
keeping the running max m and sum l in fp32 registers. Scores are kept in base 2 (the scale
is multiplied by log2(e)) so the exponentials are exp2, one instruction on the GPU. Key blocks
that the causal/window structure hides are not visited: the loop bounds come from the block's
first and last query, and sink keys are a second, short loop.

The backward runs two kernels after a preprocess (delta = rowsum(dO * O)): one program per key
block accumulates dK and dV over every query head of its group and every visible query block,
and one program per query block accumulates dQ over the visible key blocks, so no atomics.

Visibility of key j from query i, with i' = i + L_k - L_q (bottom-right alignment), matches
`qkv.attention.tiles`: ([j <= i'] if causal) and (i' - left <= j <= i' + right if a
window), or (j < sinks and j <= i' + future); and always j < length[b]. With per-row query
lengths (`HAS_QUERY_LENGTHS`), i' = i + length[b] - query_length[b], and the rows past
query_length[b] are padding: the forward stores output 0 and lse -inf there, so the backward's
recomputed probabilities of those rows are 0.

With an offset bias (`OFFSET_BIAS`, `qkv.attention.OffsetBias`: T5's bucketed bias, Shaw et
al.'s relative keys), each score gains RelBias[b, h, i, clip(j - i - rel_shift, -R, R) + R],
read per tile from a (B or 1, H or 1, L_q or 1, 2R + 1) tensor (zero strides where shared),
never an L_q x L_k one; the dQ kernel also adds dS into its gradient (atomics: several
programs share a column).

With a sparse pattern (`SPARSE`, qkv.attention.sparse), the blocks to visit come from lists
instead of the loop bounds: for each query block, its key blocks (`BlockRows`, CSR offsets, and
`BlockCols`), and for each key block, its query blocks (`ColRows`, `ColQBlocks`, `ColSlots`),
every entry with the pattern's (BLOCK_M, BLOCK_N) mask of that tile (`BlockMasks`, uint8),
AND-ed with the structural rule above. Only listed tiles are loaded: the work is the number of
computed blocks.
"""

import triton
import triton.language as tl

LN2: tl.constexpr = 0.6931471805599453


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation. "upcast" multiplies in fp32: Triton 3.9's interpreter gets
    bf16 tl.dot wrong, so CPU tests of bf16 inputs take this path (GPUs never do)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _visible(
    q_pos, k_pos, key_len, left, right, sinks, future, CAUSAL: tl.constexpr, WINDOW: tl.constexpr
):
    """(BLOCK_M, BLOCK_N) mask from aligned query positions q_pos and key positions k_pos."""
    ok = k_pos[None, :] < key_len
    structural = ok
    if CAUSAL:
        structural = structural & (k_pos[None, :] <= q_pos[:, None])
    if WINDOW:
        structural = structural & (k_pos[None, :] >= q_pos[:, None] - left)
        structural = structural & (k_pos[None, :] <= q_pos[:, None] + right)
    sink = ok & (k_pos[None, :] < sinks) & (k_pos[None, :] <= q_pos[:, None] + future)
    return structural | sink


@triton.jit
def _shift(QueryLengths, batch, key_len, L_q, L_k, HAS_QUERY_LENGTHS: tl.constexpr):
    """Query i sits at key position i + shift: the padded lengths' bottom-right alignment, or,
    with per-row query lengths, the row's own (its last real query on its last real key)."""
    if HAS_QUERY_LENGTHS:
        return key_len - tl.load(QueryLengths + batch)
    return L_k - L_q


@triton.jit
def _offset_columns(rel_q, k_pos, rel_max):
    """(BLOCK_M, BLOCK_N) column of each score's offset bias: clip(j - i - shift) + R."""
    offset = k_pos[None, :] - rel_q[:, None]
    return tl.minimum(tl.maximum(offset, -rel_max), rel_max) + rel_max


@triton.jit
def _offset_rows(RelBias, batch, head, rows, L_q, rel_stride_b, rel_stride_h, rel_stride_m):
    """Pointers to each query row's values (rows past L_q read the last one; never stored)."""
    base = RelBias + batch * rel_stride_b + head * rel_stride_h
    return base + tl.minimum(rows, L_q - 1) * rel_stride_m


@triton.jit
def _key_range(
    q_first,
    q_last,
    key_len,
    left,
    right,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[lo, hi): the key blocks any of the queries at aligned positions q_first..q_last sees."""
    hi = key_len
    if CAUSAL:
        hi = tl.minimum(hi, q_last + 1)
    if WINDOW:
        hi = tl.minimum(hi, q_last + right + 1)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, q_first - left)
        lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, 0)
    return lo, hi


@triton.jit
def _fwd_block(
    acc,
    m_i,
    l_i,
    q,
    k_ptrs,
    v_ptrs,
    stride_kn,
    stride_vn,
    start,
    stop,
    q_pos,
    offs_n,
    d_mask,
    key_len,
    left,
    right,
    sinks,
    future,
    scale_log2,
    slope_log2,
    rel_rows,
    rel_q,
    rel_max,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIBI: tl.constexpr,
    OFFSET_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold key blocks [start, stop) into the running (acc, m, l): the online softmax."""
    for start_n in range(start, stop, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, start_n, q_pos, offs_n,
            d_mask, key_len, left, right, sinks, future, scale_log2, slope_log2, 0, rel_rows,
            rel_q, rel_max, CAUSAL, WINDOW, ALIBI, False, OFFSET_BIAS, PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, start_n, q_pos, offs_n, d_mask,
    key_len, left, right, sinks, future, scale_log2, slope_log2, allowed, rel_rows, rel_q,
    rel_max, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ALIBI: tl.constexpr,
    SPARSE: tl.constexpr, OFFSET_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold the key block at start_n into (acc, m, l); `allowed` is the pattern's tile mask."""
    k_pos = start_n + offs_n
    in_range = k_pos < key_len
    k = tl.load(k_ptrs + start_n * stride_kn, mask=in_range[:, None] & d_mask[None, :], other=0.0)
    s = _dot(q, tl.trans(k), PRECISION) * scale_log2  # base-2 scores
    if ALIBI:
        s -= slope_log2 * tl.abs(q_pos[:, None] - k_pos[None, :]).to(tl.float32)
    if OFFSET_BIAS:
        columns = _offset_columns(rel_q, k_pos, rel_max)
        s += tl.load(rel_rows[:, None] + columns).to(tl.float32) * 1.4426950408889634
    visible = _visible(q_pos, k_pos, key_len, left, right, sinks, future, CAUSAL, WINDOW)
    if SPARSE:
        visible = visible & allowed
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs + start_n * stride_vn, mask=in_range[:, None] & d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tile_mask(BlockMasks, entry, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The pattern's (BLOCK_M, BLOCK_N) bool mask of the listed tile `entry`."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return tl.load(BlockMasks + entry * (BLOCK_M * BLOCK_N) + offs) != 0


@triton.jit
def attention_forward_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Lengths,
    Slopes,
    QueryLengths,
    BlockRows,
    BlockCols,
    BlockMasks,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads,
    group,
    L_q,
    L_k,
    head_dim,
    scale_log2,
    left,
    right,
    sinks,
    future,
    RelBias,
    rel_stride_b,
    rel_stride_h,
    rel_stride_m,
    rel_max,
    rel_shift,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIBI: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE: tl.constexpr = False,
    HAS_QUERY_LENGTHS: tl.constexpr = False,
    OFFSET_BIAS: tl.constexpr = False,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    kv_head = head // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    key_len = L_k
    if HAS_LENGTHS:
        key_len = tl.load(Lengths + batch)
    shift = _shift(QueryLengths, batch, key_len, L_q, L_k, HAS_QUERY_LENGTHS)
    q_pos = offs_m + shift
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(Slopes + head) * 1.4426950408889634
    rel_rows = _offset_rows(RelBias, batch, head, offs_m, L_q, rel_stride_b, rel_stride_h,
                            rel_stride_m)  # fmt: skip
    rel_q = offs_m + rel_shift

    q = tl.load(
        Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=(offs_m < L_q)[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_ptrs = (
        K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    )
    v_ptrs = (
        V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    )
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)

    q_first = pid_m * BLOCK_M + shift
    lo, hi = _key_range(
        q_first, q_first + BLOCK_M - 1, key_len, left, right, CAUSAL, WINDOW, BLOCK_N
    )
    sink_stop = tl.minimum(lo, ((sinks + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    if SPARSE:  # the listed key blocks only; the loops below then run over nothing
        for entry in range(tl.load(BlockRows + pid_m), tl.load(BlockRows + pid_m + 1)):
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
                tl.load(BlockCols + entry) * BLOCK_N, q_pos, offs_n, d_mask, key_len, left,
                right, sinks, future, scale_log2, slope_log2,
                _tile_mask(BlockMasks, entry, BLOCK_M, BLOCK_N), rel_rows, rel_q, rel_max,
                CAUSAL, WINDOW, ALIBI, True, OFFSET_BIAS, PRECISION,
            )  # fmt: skip
        sink_stop, lo, hi = 0, 0, 0
    acc, m_i, l_i = _fwd_block(
        acc,
        m_i,
        l_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        0,
        sink_stop,
        q_pos,
        offs_n,
        d_mask,
        key_len,
        left,
        right,
        sinks,
        future,
        scale_log2,
        slope_log2,
        rel_rows,
        rel_q,
        rel_max,
        CAUSAL,
        WINDOW,
        ALIBI,
        OFFSET_BIAS,
        PRECISION,
        BLOCK_N,
    )
    acc, m_i, l_i = _fwd_block(
        acc,
        m_i,
        l_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        lo,
        hi,
        q_pos,
        offs_n,
        d_mask,
        key_len,
        left,
        right,
        sinks,
        future,
        scale_log2,
        slope_log2,
        rel_rows,
        rel_q,
        rel_max,
        CAUSAL,
        WINDOW,
        ALIBI,
        OFFSET_BIAS,
        PRECISION,
        BLOCK_N,
    )

    empty = l_i == 0.0  # no visible key: output 0, lse -inf
    if HAS_QUERY_LENGTHS:  # a row's padding queries (aligned past its last key): the same
        empty = empty | (q_pos >= key_len)
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    row_mask = offs_m < L_q
    tl.store(
        Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )
    tl.store(Lse + pid_bh * L_q + offs_m, lse, mask=row_mask)


@triton.jit
def attention_backward_preprocess(
    Out,
    DOut,
    Delta,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads,
    L_q,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta_i = sum_d dO_id * O_id (FlashAttention-2, Algorithm 2 line 4), fp32."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < L_q)[:, None] & (offs_d < head_dim)[None, :]
    offset = batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    o = tl.load(Out + offset, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DOut + offset, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh * L_q + offs_m, tl.sum(o * do, 1), mask=offs_m < L_q)


@triton.jit
def _recompute_probs(
    q,
    k,
    lse_log2,
    q_pos,
    k_pos,
    key_len,
    left,
    right,
    sinks,
    future,
    scale_log2,
    slope_log2,
    allowed,
    rel_rows,
    rel_q,
    rel_max,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIBI: tl.constexpr,
    SPARSE: tl.constexpr,
    OFFSET_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """P of one (query block, key block) tile from the saved log-sum-exp, 0 where hidden;
    `allowed`: the pattern's tile mask (SPARSE)."""
    s = _dot(q, tl.trans(k), PRECISION) * scale_log2
    if ALIBI:
        s -= slope_log2 * tl.abs(q_pos[:, None] - k_pos[None, :]).to(tl.float32)
    if OFFSET_BIAS:
        columns = _offset_columns(rel_q, k_pos, rel_max)
        s += tl.load(rel_rows[:, None] + columns).to(tl.float32) * 1.4426950408889634
    visible = _visible(q_pos, k_pos, key_len, left, right, sinks, future, CAUSAL, WINDOW)
    if SPARSE:
        visible = visible & allowed
    p = tl.math.exp2(s - lse_log2[:, None])
    return tl.where(visible, p, 0.0)


@triton.jit
def attention_backward_dkdv_kernel(
    Q,
    K,
    V,
    DOut,
    DK,
    DV,
    Lse,
    Delta,
    Lengths,
    Slopes,
    QueryLengths,
    ColRows,
    ColQBlocks,
    ColSlots,
    BlockMasks,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_kv_heads,
    group,
    L_q,
    L_k,
    head_dim,
    scale_log2,
    left,
    right,
    sinks,
    future,
    RelBias,
    rel_stride_b,
    rel_stride_h,
    rel_stride_m,
    rel_max,
    rel_shift,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIBI: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE: tl.constexpr = False,
    HAS_QUERY_LENGTHS: tl.constexpr = False,
    OFFSET_BIAS: tl.constexpr = False,
):
    """One program: one key block of one K/V head; loops over its group's query heads."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, kv_head = pid_bh // num_kv_heads, pid_bh % num_kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    key_len = L_k
    if HAS_LENGTHS:
        key_len = tl.load(Lengths + batch)
    kv_mask = (offs_n < L_k)[:, None] & d_mask[None, :]
    k = tl.load(
        K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    shift = _shift(QueryLengths, batch, key_len, L_q, L_k, HAS_QUERY_LENGTHS)
    # The queries that can see this key block (sinks may be seen by every later query).
    q_lo = 0
    if CAUSAL:
        q_lo = tl.maximum(0, pid_n * BLOCK_N - shift)
    if WINDOW:
        q_lo = tl.maximum(q_lo, pid_n * BLOCK_N - right - shift)
    if pid_n * BLOCK_N < sinks:
        q_lo = tl.maximum(0, pid_n * BLOCK_N - future - shift)
    q_lo = (q_lo // BLOCK_M) * BLOCK_M
    q_hi = L_q
    if WINDOW and pid_n * BLOCK_N >= sinks:  # later queries have slid past this block
        q_hi = tl.minimum(L_q, (pid_n + 1) * BLOCK_N + left - shift)
    if SPARSE:  # the listed query blocks only
        q_lo, q_hi = 0, 0
    for g in range(0, group):
        head = kv_head * group + g
        slope_log2 = 0.0
        if ALIBI:
            slope_log2 = tl.load(Slopes + head) * 1.4426950408889634
        row = (batch * num_kv_heads * group + head) * L_q
        rel_base = RelBias + batch * rel_stride_b + head * rel_stride_h
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = DOut + batch * stride_ob + head * stride_oh
        for start_m in range(q_lo, q_hi, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, Lse + row, Delta + row, start_m, offs_m, offs_n,
                offs_d, d_mask, stride_qm, stride_om, L_q, shift, key_len, left, right, sinks,
                future, scale_log2, slope_log2, 0, rel_base, rel_stride_m, rel_shift, rel_max,
                CAUSAL, WINDOW, ALIBI, False, OFFSET_BIAS, PRECISION,
            )  # fmt: skip
        if SPARSE:
            for entry in range(tl.load(ColRows + pid_n), tl.load(ColRows + pid_n + 1)):
                allowed = _tile_mask(BlockMasks, tl.load(ColSlots + entry), BLOCK_M, BLOCK_N)
                dk, dv = _dkdv_tile(
                    dk, dv, k, v, q_base, do_base, Lse + row, Delta + row,
                    tl.load(ColQBlocks + entry) * BLOCK_M, offs_m, offs_n, offs_d, d_mask,
                    stride_qm, stride_om, L_q, shift, key_len, left, right, sinks, future,
                    scale_log2, slope_log2, allowed, rel_base, rel_stride_m, rel_shift, rel_max,
                    CAUSAL, WINDOW, ALIBI, True, OFFSET_BIAS, PRECISION,
                )  # fmt: skip
    dk *= scale_log2 * LN2  # d(q . k * scale)/dk = scale * q
    out_offset = (
        batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    )
    tl.store(DK + out_offset, dk.to(DK.dtype.element_ty), mask=kv_mask)
    out_offset = (
        batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    )
    tl.store(DV + out_offset, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, q_base, do_base, lse_row, delta_row, start_m, offs_m, offs_n, offs_d, d_mask,
    stride_qm, stride_om, L_q, shift, key_len, left, right, sinks, future, scale_log2,
    slope_log2, allowed, rel_base, rel_stride_m, rel_shift, rel_max, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, ALIBI: tl.constexpr, SPARSE: tl.constexpr,
    OFFSET_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Add one query block's share to dK = dS^T Q and dV = P^T dO of this key block."""
    rows = start_m + offs_m
    row_mask = rows < L_q
    q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    do = tl.load(do_base + rows[:, None] * stride_om + offs_d[None, :],
                 mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    lse = tl.load(lse_row + rows, mask=row_mask, other=float("inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_row + rows, mask=row_mask, other=0.0)
    rel_rows = rel_base + tl.minimum(rows, L_q - 1) * rel_stride_m
    p = _recompute_probs(
        q, k, lse_log2, rows + shift, offs_n, key_len, left, right, sinks, future, scale_log2,
        slope_log2, allowed, rel_rows, rows + rel_shift, rel_max, CAUSAL, WINDOW, ALIBI, SPARSE,
        OFFSET_BIAS, PRECISION,
    )  # fmt: skip
    dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION)
    dp = _dot(do, tl.trans(v), PRECISION).to(tl.float32)
    ds = p * (dp - delta[:, None])  # dS = P * (dP - D)
    dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
    return dk, dv


@triton.jit
def _dq_block(
    dq,
    q,
    do,
    lse_log2,
    delta,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    start,
    stop,
    q_pos,
    offs_n,
    d_mask,
    L_k,
    key_len,
    left,
    right,
    sinks,
    future,
    scale_log2,
    slope_log2,
    rel_rows,
    drel_rows,
    rel_q,
    rel_max,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIBI: tl.constexpr,
    OFFSET_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Accumulate dQ = dS K over key blocks [start, stop) (scale applied by the caller)."""
    for start_n in range(start, stop, BLOCK_N):
        dq = _dq_tile(
            dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn, start_n, q_pos,
            offs_n, d_mask, L_k, key_len, left, right, sinks, future, scale_log2, slope_log2, 0,
            rel_rows, drel_rows, rel_q, rel_max, CAUSAL, WINDOW, ALIBI, False, OFFSET_BIAS,
            PRECISION,
        )  # fmt: skip
    return dq


@triton.jit
def _dq_tile(
    dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn, start_n, q_pos, offs_n,
    d_mask, L_k, key_len, left, right, sinks, future, scale_log2, slope_log2, allowed,
    rel_rows, drel_rows, rel_q, rel_max, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    ALIBI: tl.constexpr, SPARSE: tl.constexpr, OFFSET_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ += dS K for the key block at start_n; with an offset bias, its gradient += dS."""
    offs_d = tl.arange(0, d_mask.shape[0])
    k_pos = start_n + offs_n
    kv_mask = (k_pos < L_k)[:, None] & d_mask[None, :]
    k = tl.load(k_base + k_pos[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + k_pos[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    p = _recompute_probs(
        q, k, lse_log2, q_pos, k_pos, key_len, left, right, sinks, future, scale_log2,
        slope_log2, allowed, rel_rows, rel_q, rel_max, CAUSAL, WINDOW, ALIBI, SPARSE,
        OFFSET_BIAS, PRECISION,
    )  # fmt: skip
    dp = _dot(do, tl.trans(v), PRECISION).to(tl.float32)
    ds = p * (dp - delta[:, None])  # dS = P * (dP - D)
    if OFFSET_BIAS:  # d(score)/d(bias) = 1; hidden and padding scores have dS = 0
        columns = _offset_columns(rel_q, k_pos, rel_max)
        tl.atomic_add(drel_rows[:, None] + columns, ds, mask=ds != 0.0)
    return dq + _dot(ds.to(k.dtype), k, PRECISION)


@triton.jit
def attention_backward_dq_kernel(
    Q,
    K,
    V,
    DOut,
    DQ,
    Lse,
    Delta,
    Lengths,
    Slopes,
    QueryLengths,
    BlockRows,
    BlockCols,
    BlockMasks,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads,
    group,
    L_q,
    L_k,
    head_dim,
    scale_log2,
    left,
    right,
    sinks,
    future,
    RelBias,
    DRelBias,
    rel_stride_b,
    rel_stride_h,
    rel_stride_m,
    rel_max,
    rel_shift,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIBI: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE: tl.constexpr = False,
    HAS_QUERY_LENGTHS: tl.constexpr = False,
    OFFSET_BIAS: tl.constexpr = False,
):
    """One program: one query block of one query head; loops over the visible key blocks."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    kv_head = head // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    row_mask = offs_m < L_q
    key_len = L_k
    if HAS_LENGTHS:
        key_len = tl.load(Lengths + batch)
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(Slopes + head) * 1.4426950408889634
    offset = batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(Q + offset, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    do_offset = batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    do = tl.load(DOut + do_offset, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    lse = tl.load(Lse + pid_bh * L_q + offs_m, mask=row_mask, other=float("inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + pid_bh * L_q + offs_m, mask=row_mask, other=0.0)
    shift = _shift(QueryLengths, batch, key_len, L_q, L_k, HAS_QUERY_LENGTHS)
    q_pos = offs_m + shift
    rel_rows = _offset_rows(RelBias, batch, head, offs_m, L_q, rel_stride_b, rel_stride_h,
                            rel_stride_m)  # fmt: skip
    drel_rows = _offset_rows(DRelBias, batch, head, offs_m, L_q, rel_stride_b, rel_stride_h,
                             rel_stride_m)  # fmt: skip
    rel_q = offs_m + rel_shift
    q_first = pid_m * BLOCK_M + shift
    lo, hi = _key_range(
        q_first, q_first + BLOCK_M - 1, key_len, left, right, CAUSAL, WINDOW, BLOCK_N
    )
    sink_stop = tl.minimum(lo, ((sinks + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    if SPARSE:  # the listed key blocks only; the loops below then run over nothing
        for entry in range(tl.load(BlockRows + pid_m), tl.load(BlockRows + pid_m + 1)):
            dq = _dq_tile(
                dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn,
                tl.load(BlockCols + entry) * BLOCK_N, q_pos, offs_n, d_mask, L_k, key_len, left,
                right, sinks, future, scale_log2, slope_log2,
                _tile_mask(BlockMasks, entry, BLOCK_M, BLOCK_N), rel_rows, drel_rows, rel_q,
                rel_max, CAUSAL, WINDOW, ALIBI, True, OFFSET_BIAS, PRECISION,
            )  # fmt: skip
        sink_stop, lo, hi = 0, 0, 0
    dq = _dq_block(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        0,
        sink_stop,
        q_pos,
        offs_n,
        d_mask,
        L_k,
        key_len,
        left,
        right,
        sinks,
        future,
        scale_log2,
        slope_log2,
        rel_rows,
        drel_rows,
        rel_q,
        rel_max,
        CAUSAL,
        WINDOW,
        ALIBI,
        OFFSET_BIAS,
        PRECISION,
        BLOCK_N,
    )
    dq = _dq_block(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        lo,
        hi,
        q_pos,
        offs_n,
        d_mask,
        L_k,
        key_len,
        left,
        right,
        sinks,
        future,
        scale_log2,
        slope_log2,
        rel_rows,
        drel_rows,
        rel_q,
        rel_max,
        CAUSAL,
        WINDOW,
        ALIBI,
        OFFSET_BIAS,
        PRECISION,
        BLOCK_N,
    )
    dq *= scale_log2 * LN2
    tl.store(DQ + offset, dq.to(DQ.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
