"""Sparse patterns (qkv.attention.sparse) against their definitions and float64 eager attention.

The outside references: each pattern's visibility written out pair by pair from its paper's
definition (Longformer, Sparse Transformer, BigBird), the dense mask's block occupancy computed
by reducing that mask, eager float64 softmax attention with the dense mask, and PyTorch's
FlexAttention with a BlockMask built by `create_block_mask` from the same definition.
"""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.attention import sparse
from qkv.attention.tiles import Tile


def definition(pattern, i: int, j: int, L_k: int) -> bool:
    """Is key j visible from (aligned) query position i? Pair by pair, from the papers."""
    if isinstance(pattern, sparse.Union):
        return any(definition(p, i, j, L_k) for p in pattern.parts)
    if isinstance(pattern, sparse.Window):
        return i - pattern.left <= j <= i + pattern.right
    if isinstance(pattern, sparse.Dilated):
        d = pattern.dilation
        return any(j == i - t * d for t in range(-pattern.right, pattern.left + 1))
    if isinstance(pattern, sparse.Strided):
        return (i - j) % pattern.stride == 0
    if isinstance(pattern, sparse.SameBlock):
        return i // pattern.size == j // pattern.size
    if isinstance(pattern, sparse.Summary):
        return j % pattern.stride in range(pattern.stride - pattern.width, pattern.stride)
    if isinstance(pattern, sparse.GlobalTokens):
        return i in pattern.positions or j in pattern.positions
    if isinstance(pattern, sparse.RandomBlocks):
        table = pattern.table(L_k)
        return bool(table[i // pattern.block, j // pattern.block])
    raise AssertionError(pattern)


def defined_mask(pattern, L_q: int, L_k: int) -> torch.Tensor:
    shift = L_k - L_q
    rows = [[definition(pattern, i + shift, j, L_k) for j in range(L_k)] for i in range(L_q)]
    return torch.tensor(rows, dtype=torch.bool).view(L_q, L_k)


@st.composite
def patterns(draw, depth: int = 0):
    kind = draw(st.sampled_from(["window", "dilated", "strided", "block", "summary", "global",
                                 "random", "union"][: 8 if depth == 0 else 7]))  # fmt: skip
    small = st.integers(0, 6)
    if kind == "window":
        return sparse.Window(draw(small), draw(small))
    if kind == "dilated":
        return sparse.Dilated(draw(small), draw(small), dilation=draw(st.integers(1, 4)))
    if kind == "strided":
        return sparse.Strided(draw(st.integers(1, 9)))
    if kind == "block":
        return sparse.SameBlock(draw(st.integers(1, 9)))
    if kind == "summary":
        stride = draw(st.integers(1, 9))
        return sparse.Summary(stride, draw(st.integers(1, stride)))
    if kind == "global":
        positions = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
        return sparse.GlobalTokens(tuple(positions))
    if kind == "random":
        return sparse.RandomBlocks(draw(st.integers(1, 3)), block=draw(st.integers(1, 8)),
                                   seed=draw(st.integers(0, 5)))  # fmt: skip
    return draw(patterns(depth + 1)) | draw(patterns(depth + 1))


@settings(max_examples=80, deadline=None)
@given(
    pattern=patterns(),
    L_k=st.integers(1, 40),
    drop=st.integers(0, 39),
    block_q=st.integers(1, 9),
    block_k=st.integers(1, 9),
)
def test_dense_mask_and_block_layout_equal_the_definition(pattern, L_k, drop, block_q, block_k):
    L_q = max(1, L_k - drop)
    expected = defined_mask(pattern, L_q, L_k)
    assert torch.equal(sparse.dense_mask(pattern, L_q, L_k), expected)
    computed, full = sparse.layout(pattern, L_q, L_k, block_q, block_k)
    n_q, n_k = math.ceil(L_q / block_q), math.ceil(L_k / block_k)
    padded = torch.zeros(n_q * block_q, n_k * block_k, dtype=torch.bool)
    padded[:L_q, :L_k] = expected
    tiles = padded.view(n_q, block_q, n_k, block_k)
    assert torch.equal(computed, tiles.any(dim=3).any(dim=1))  # exactly the occupied blocks
    inside = torch.zeros_like(padded)
    inside[:L_q, :L_k] = True
    every = (tiles | ~inside.view(n_q, block_q, n_k, block_k)).all(dim=3).all(dim=1)
    assert not (full & ~every).any()  # "full" is never claimed for a tile with a hidden pair


def test_exact_full_tiles_for_windows_and_global_tokens():
    for pattern in (sparse.Window(5, 2), sparse.GlobalTokens((0, 1, 2, 3)), sparse.SameBlock(4)):
        expected = defined_mask(pattern, 32, 32).view(8, 4, 8, 4)
        _, full = sparse.layout(pattern, 32, 32, 4, 4)
        assert torch.equal(full, expected.all(dim=3).all(dim=1))


def eager_attention(q, k, v, visible):
    """float64 softmax(q k^T / sqrt(D)) v with -inf where not visible; empty rows give 0."""
    H, H_kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // H_kv, dim=1)
    v = v.repeat_interleave(H // H_kv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(lse == -math.inf, 0).unsqueeze(-1))
    return weights @ v, lse


@settings(max_examples=25, deadline=None)
@given(
    pattern=patterns(),
    L_k=st.integers(1, 40),
    drop=st.integers(0, 39),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    blocks=st.tuples(st.integers(1, 16), st.integers(1, 16)),
    causal=st.booleans(),
    padded=st.booleans(),
)
def test_tiled_outputs_lse_and_gradients_equal_eager_float64(
    pattern, L_k, drop, heads, blocks, causal, padded
):
    L_q, (H, H_kv) = max(1, L_k - drop), heads
    generator = torch.Generator().manual_seed(L_q * 100 + L_k)
    q, k, v = (
        torch.randn(2, h, n, 8, dtype=torch.float64, generator=generator).requires_grad_()
        for h, n in ((H, L_q), (H_kv, L_k), (H_kv, L_k))
    )
    lengths = torch.tensor([L_k, max(0, L_k - 3)]) if padded else None
    visible = defined_mask(pattern, L_q, L_k)[None, None]  # (1, 1, L_q, L_k)
    if causal:
        visible = visible & torch.ones(L_q, L_k, dtype=torch.bool).tril(L_k - L_q)
    if padded:
        visible = visible & (torch.arange(L_k) < lengths.view(-1, 1, 1, 1))
    output, lse = qkv.flash_attention(
        q, k, v, pattern=pattern, causal=causal, lengths=lengths, block_q=blocks[0],
        block_k=blocks[1], return_lse=True,
    )  # fmt: skip
    expected, expected_lse = eager_attention(q, k, v, visible)
    torch.testing.assert_close(output, expected)
    assert torch.equal(lse == -math.inf, expected_lse == -math.inf)  # empty rows alike
    torch.testing.assert_close(lse.masked_fill(lse == -math.inf, 0),
                               expected_lse.masked_fill(expected_lse == -math.inf, 0))  # fmt: skip
    d_out = torch.randn_like(output)
    grads = torch.autograd.grad(output, (q, k, v), d_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), d_out)
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_every_backend_serves_a_pattern_as_its_dense_mask():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 70, 16, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(1, 2, 90, 16, dtype=torch.float64, generator=generator) for _ in "kv")
    pattern = sparse.bigbird(window=4, global_tokens=2, random_blocks=1, block=16, seed=3)
    expected, _ = eager_attention(q, k, v, defined_mask(pattern, 70, 90))
    for backend in ("reference", "sdpa", "tiled"):
        output = qkv.attention(q, k, v, pattern=pattern, backend=backend)
        torch.testing.assert_close(output, expected)
    output, weights = qkv.attention(q, k, v, pattern=pattern, return_weights=True)
    assert not weights.masked_select(~defined_mask(pattern, 70, 90)).any()


def test_only_the_computed_tiles_are_visited():
    pattern = sparse.bigbird(window=8, global_tokens=1, random_blocks=2, block=16, seed=1)
    q = k = v = torch.randn(1, 2, 256, 8)
    steps = []
    qkv.flash_attention(q, k, v, pattern=pattern, block_q=16, block_k=16, trace=steps.append)
    visited = [(step.q_block, step.k_block) for step in steps]
    computed, full = sparse.layout(pattern, 256, 256, 16, 16)
    assert sorted(visited) == [tuple(ij) for ij in computed.nonzero().tolist()]
    assert len(visited) < 0.4 * computed.numel()  # most of the 16 x 16 tiles are skipped
    assert {(s.q_block, s.k_block) for s in steps if s.tile is Tile.VISIBLE} == {
        tuple(ij) for ij in full.nonzero().tolist()
    }


def test_random_blocks_are_seeded_and_distinct_per_row():
    table = sparse.RandomBlocks(3, block=8, seed=7).table(200)  # 25 blocks
    assert table.shape == (25, 25)
    assert (table.sum(dim=1) == 3).all()
    assert torch.equal(table, sparse.RandomBlocks(3, block=8, seed=7).table(200))
    assert not torch.equal(table, sparse.RandomBlocks(3, block=8, seed=8).table(200))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_same_output_as_flex_attention_with_its_block_mask():
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")
    L, block = 256, 32
    pattern = sparse.bigbird(window=5, global_tokens=2, random_blocks=2, block=block, seed=2)
    table = pattern.parts[2].table(L)

    def mask_mod(batch, head, q_idx, k_idx):  # BigBird, from the paper, in FlexAttention's terms
        near = (k_idx - q_idx).abs() <= 5
        is_global = (q_idx < 2) | (k_idx < 2)
        return near | is_global | table[q_idx // block, k_idx // block]

    block_mask = flex_attention.create_block_mask(mask_mod, 1, 1, L, L, device="cpu")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 16, generator=generator) for _ in "qkv")
    with torch.no_grad():
        expected = flex_attention.flex_attention(q, k, v, block_mask=block_mask)
    output = qkv.flash_attention(q, k, v, pattern=pattern, block_q=32, block_k=32)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


def test_explain_reports_the_fraction_of_tiles_computed():
    q = torch.randn(1, 2, 4096, 16)
    pattern = sparse.Window(64, 64) | sparse.GlobalTokens.first(1)
    text = qkv.explain(q, q, q, pattern=pattern)
    assert "backend 'tiled'" in text
    assert "tiles computed" in text


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: sparse.Window(-1), ValueError, "left"),
        (lambda: sparse.Dilated(2, dilation=0), ValueError, "dilation"),
        (lambda: sparse.Strided(0), ValueError, "stride"),
        (lambda: sparse.Summary(4, 5), ValueError, "width"),
        (lambda: sparse.GlobalTokens([0, 1]), TypeError, "positions"),
        (lambda: sparse.RandomBlocks(0), ValueError, "per_row"),
    ],
)
def test_bad_patterns_name_the_argument(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_bad_pattern_arguments_name_the_argument():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(TypeError, match="pattern"):
        qkv.attention(q, q, q, pattern=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="pattern: expected L_q <= L_k"):
        qkv.attention(q, q[:, :, :4], q[:, :, :4], pattern=sparse.Window(2))


def test_flex_backend_serves_patterns_with_the_same_blocks():
    pattern = sparse.bigbird(window=7, global_tokens=3, random_blocks=2, block=32, seed=4)
    pattern = pattern | sparse.Dilated(4, 0, dilation=5) | sparse.Summary(64, 2)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 300, 16, generator=generator)
    k, v = (torch.randn(1, 2, 300, 16, generator=generator) for _ in "kv")
    visible = defined_mask(pattern, 300, 300) & torch.ones(300, 300, dtype=torch.bool).tril()
    expected, _ = eager_attention(q.double(), k.double(), v.double(), visible)
    with torch.no_grad():
        output = qkv.attention(q, k, v, pattern=pattern, causal=True, backend="flex")
    torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=2e-5)


@st.composite
def packed_calls(draw):
    """Sequences of query and key lengths (each query part no longer than its keys' total),
    with causal and/or a window aligned per sequence."""
    count = draw(st.integers(1, 4))
    key_lengths = draw(st.lists(st.integers(0, 12), min_size=count, max_size=count))
    query_lengths = [draw(st.integers(0, n)) for n in key_lengths]
    if sum(query_lengths) == 0:  # at least one query
        key_lengths[0] = max(key_lengths[0], 1)
        query_lengths[0] = 1
    window = draw(st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 4))))
    pattern = sparse.Packed.from_lengths(
        query_lengths, key_lengths, causal=draw(st.booleans()), window=window
    )
    return pattern, query_lengths, key_lengths


def packed_definition(pattern, query_lengths, key_lengths) -> torch.Tensor:
    """Bool (sum L_q, sum L_k): same sequence, and causal/window aligned within it."""
    rows = []
    for s, n_q in enumerate(query_lengths):
        for i in range(n_q):
            position = i + key_lengths[s] - n_q  # aligned within sequence s
            row = []
            for t, n_k in enumerate(key_lengths):
                for j in range(n_k):
                    ok = s == t
                    if pattern.causal:
                        ok = ok and j <= position
                    if pattern.window is not None:
                        left, right = pattern.window
                        ok = ok and position - left <= j <= position + right
                    row.append(ok)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(sum(query_lengths), sum(key_lengths))


@settings(max_examples=80, deadline=None)
@given(call=packed_calls(), block_q=st.integers(1, 7), block_k=st.integers(1, 7))
def test_packed_sequences_mask_and_layout_equal_the_definition(call, block_q, block_k):
    pattern, query_lengths, key_lengths = call
    L_q, L_k = sum(query_lengths), sum(key_lengths)
    expected = packed_definition(pattern, query_lengths, key_lengths)
    assert torch.equal(qkv.masks.from_pattern(pattern, L_q, L_k), expected)
    computed, full = sparse.layout(pattern, L_q, L_k, block_q, block_k)
    n_q, n_k = math.ceil(L_q / block_q), math.ceil(L_k / block_k)
    padded = torch.zeros(n_q * block_q, n_k * block_k, dtype=torch.bool)
    padded[:L_q, :L_k] = expected
    tiles = padded.view(n_q, block_q, n_k, block_k)
    assert torch.equal(computed, tiles.any(dim=3).any(dim=1))
    inside = torch.zeros_like(padded)
    inside[:L_q, :L_k] = True
    every = (tiles | ~inside.view(n_q, block_q, n_k, block_k)).all(dim=3).all(dim=1)
    assert not (full & ~every).any()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"causal": True, "window": (3, 0)}])
def test_packed_sequences_equal_each_sequence_alone(backend, options):
    query_lengths, key_lengths = [5, 1, 0, 9], [7, 4, 3, 9]
    pattern = sparse.Packed.from_lengths(query_lengths, key_lengths, **options)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 15, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, 2, 23, 8, dtype=torch.float64, generator=generator).requires_grad_()
            for _ in "kv")  # fmt: skip
    output = qkv.attention(q, k, v, pattern=pattern, backend=backend)
    starts_q, starts_k = pattern.query_offsets, pattern.key_offsets
    for s in range(len(query_lengths)):
        rows = slice(starts_q[s], starts_q[s + 1])
        keys = slice(starts_k[s], starts_k[s + 1])
        if rows.start == rows.stop:
            continue
        alone = qkv.attention(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                              backend="reference", **options)  # fmt: skip
        torch.testing.assert_close(output[:, :, rows], alone)
    d_out = torch.randn_like(output)
    grads = torch.autograd.grad(output, (q, k, v), d_out)
    visible = packed_definition(pattern, query_lengths, key_lengths)
    expected, _ = eager_attention(q, k, v, visible)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), d_out), strict=True):
        torch.testing.assert_close(got, want)


def test_packed_sequences_equal_pytorch_nested_jagged_sdpa():
    """PyTorch's nested (jagged) tensors run SDPA per sequence without padding (non-causal
    on the CPU in torch 2.13)."""
    import torch.nn.functional as F

    lengths = [5, 9, 3, 12]
    generator = torch.Generator().manual_seed(0)
    parts = [[torch.randn(n, 2, 8, generator=generator) for n in lengths] for _ in "qkv"]
    q, k, v = (torch.cat(p).transpose(0, 1)[None] for p in parts)  # (1, H, sum L, D)
    output = qkv.attention(q, k, v, pattern=sparse.Packed.from_lengths(lengths))
    nested = [torch.nested.nested_tensor(p, layout=torch.jagged).transpose(1, 2) for p in parts]
    expected = F.scaled_dot_product_attention(*nested).transpose(1, 2)  # (B, j, H, D)
    expected = torch.cat(expected.unbind()).transpose(0, 1)[None]
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_packed_offsets_are_checked():
    with pytest.raises(ValueError, match="query_offsets"):
        sparse.Packed((0, 5, 3))
    with pytest.raises(ValueError, match="key_offsets"):
        sparse.Packed((0, 5, 8), (0, 8))
    with pytest.raises(TypeError, match="query_lengths"):
        sparse.Packed.from_lengths([])
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="L_k=8"):
        qkv.attention(q, q, q, pattern=sparse.Packed.from_lengths([3, 4]))


def test_flex_backend_serves_packed_sequences():
    pattern = sparse.Packed.from_lengths([100, 0, 212], [100, 50, 300], causal=True)
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 312, 16, generator=generator)
    k, v = (torch.randn(1, 2, 450, 16, generator=generator) for _ in "kv")
    with torch.no_grad():
        output = qkv.attention(q, k, v, pattern=pattern, backend="flex")
    visible = packed_definition(pattern, [100, 0, 212], [100, 50, 300])
    expected, _ = eager_attention(q.double(), k.double(), v.double(), visible)
    torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_runs_packed_self_attention_as_a_padded_batch(causal):
    """Packed self-attention (one offsets list, nothing else masked): SDPA gathers it into a
    padded batch of sequences; outputs and gradients equal each sequence alone."""
    lengths = [5, 0, 9, 1, 12]
    pattern = sparse.Packed.from_lengths(lengths, causal=causal)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 27, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 27, 8, dtype=torch.float64, generator=generator).requires_grad_()
            for _ in "kv")  # fmt: skip
    assert "padded batch of sequences" in qkv.explain(q, k, v, pattern=pattern)
    output = qkv.attention(q, k, v, pattern=pattern)
    visible = packed_definition(pattern, lengths, lengths)
    expected, _ = eager_attention(q, k, v, visible)
    torch.testing.assert_close(output, expected)
    d_out = torch.randn_like(output)
    for got, want in zip(torch.autograd.grad(output, (q, k, v), d_out),
                         torch.autograd.grad(expected, (q, k, v), d_out), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want)


def test_qkv_sparse_is_a_module_as_the_readme_shows_it():
    """`import qkv.sparse` and `from qkv.sparse import bigbird`, in a fresh interpreter (in
    this one, `import qkv` has already set the attribute), give the patterns of
    qkv.attention.sparse."""
    script = (
        "import qkv.sparse\n"
        "from qkv.sparse import Window, bigbird\n"
        "from qkv.attention import sparse as inner\n"
        "assert bigbird is inner.bigbird and Window is inner.Window\n"
        "assert set(qkv.sparse.__all__) <= set(dir(qkv.sparse))\n"
        "print(qkv.sparse.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "qkv.sparse"
