"""Per-row query and key lengths in a padded batch: each row aligns its own last real query with
its last real key (FlashAttention's varlen rule), against each row run alone and a dense mask
written here from the definition."""

import math

import pytest
import torch

import qkv


def row_mask(query_lengths, key_lengths, L_q, L_k, *, causal, window=None, sinks=0):
    """Bool (B, 1, L_q, L_k) from the definition, pair by pair."""
    B = len(query_lengths)
    mask = torch.zeros(B, 1, L_q, L_k, dtype=torch.bool)
    for b in range(B):
        for i in range(query_lengths[b]):
            position = i + key_lengths[b] - query_lengths[b]  # aligned within the row
            for j in range(key_lengths[b]):
                structural = not causal or j <= position
                if window is not None:
                    structural = structural and position - window[0] <= j <= position + window[1]
                future = 0 if causal else (window[1] if window is not None else L_k)
                sink = window is not None and j < sinks and j <= position + future
                mask[b, 0, i, j] = structural or sink
    return mask


def eager(q, k, v, visible):
    H, H_kv = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(H // H_kv, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse.masked_fill(lse == -math.inf, 0)) @ v


def inputs(B=3, L_q=6, L_k=11, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, h, n, 8, dtype=torch.float64, generator=generator).requires_grad_()
        for h, n in ((4, L_q), (2, L_k), (2, L_k))
    ]


def test_the_row_with_fewer_keys_aligns_with_its_own_last_key():
    q, k, v = inputs(B=2, L_q=4, L_k=8)
    lengths, query_lengths = torch.tensor([8, 6]), torch.tensor([4, 4])
    output = qkv.attention(q, k, v, causal=True, lengths=lengths, query_lengths=query_lengths)
    alone = qkv.attention(q[1:], k[1:, :, :6], v[1:, :, :6], causal=True, backend="reference")
    torch.testing.assert_close(output[1:], alone)  # query 3 sees keys 0..5, query 0 keys 0..2
    padded_alignment = qkv.attention(q, k, v, causal=True, lengths=lengths)  # L_k - L_q = 4
    assert not torch.allclose(padded_alignment[1:], alone)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize(
    "options",
    [{"causal": True}, {"causal": False}, {"causal": True, "window": (3, 0)},
     {"causal": False, "window": (2, 1), "sinks": 2}],
)  # fmt: skip
def test_every_row_equals_itself_alone_and_the_definition(backend, options):
    q, k, v = inputs()
    query_lengths, key_lengths = [6, 2, 0], [11, 7, 4]
    output = qkv.attention(q, k, v, lengths=torch.tensor(key_lengths),
                           query_lengths=torch.tensor(query_lengths), backend=backend,
                           **options)  # fmt: skip
    for b, (n_q, n_k) in enumerate(zip(query_lengths, key_lengths, strict=True)):
        assert not output[b, :, n_q:].any()  # padding queries: output 0
        if n_q:
            row = slice(b, b + 1)
            alone = qkv.attention(q[row, :, :n_q], k[row, :, :n_k], v[row, :, :n_k],
                                  backend="reference", **options)  # fmt: skip
            torch.testing.assert_close(output[b : b + 1, :, :n_q], alone)
    visible = row_mask(query_lengths, key_lengths, 6, 11, **options)
    d_out = torch.randn_like(output)
    ours = torch.autograd.grad(output, (q, k, v), d_out)
    theirs = torch.autograd.grad(eager(q, k, v, visible), (q, k, v), d_out)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("blocks", [(1, 1), (2, 3), (4, 4), (16, 16)])
def test_tiles_skip_only_what_no_row_sees(blocks):
    q, k, v = inputs(B=3, L_q=9, L_k=13, seed=1)
    query_lengths, key_lengths = [9, 4, 1], [13, 5, 9]
    options = {"causal": True, "window": (4, 0), "sinks": 1}
    output = qkv.flash_attention(q, k, v, lengths=torch.tensor(key_lengths),
                                 query_lengths=torch.tensor(query_lengths),
                                 block_q=blocks[0], block_k=blocks[1], **options)  # fmt: skip
    expected = eager(q, k, v, row_mask(query_lengths, key_lengths, 9, 13, **options))
    torch.testing.assert_close(output, expected)


def test_bad_row_lengths_name_the_argument():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="query_lengths: expected values in \\[0, L_q=6\\]"):
        qkv.attention(q, k, v, query_lengths=torch.tensor([7, 1, 1]))
    with pytest.raises(ValueError, match="query_lengths: expected a tensor of shape \\(3,\\)"):
        qkv.attention(q, k, v, query_lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="query_lengths: not supported with alibi_slopes"):
        qkv.attention(q, k, v, query_lengths=torch.tensor([1, 1, 1]),
                      alibi_slopes=torch.ones(4, dtype=torch.float64))  # fmt: skip
    with pytest.raises(ValueError, match="query_lengths: not supported with a pattern"):
        qkv.attention(q, k, v, query_lengths=torch.tensor([1, 1, 1]),
                      pattern=qkv.sparse.Window(2))  # fmt: skip
