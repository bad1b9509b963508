"""qkv.masks against PyTorch's own mask builders and nn.MultiheadAttention's conventions."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from qkv import masks

lengths = st.integers(min_value=1, max_value=12)


@given(L=lengths)
def test_causal_square_is_the_lower_triangle(L):
    # The textbook causal mask: torch.tril(torch.ones(L, L, dtype=torch.bool)).
    assert torch.equal(masks.causal(L), torch.tril(torch.ones(L, L, dtype=torch.bool)))


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@given(L_q=lengths, L_k=lengths)
def test_causal_is_bottom_right_like_pytorch_causal_lower_right(L_q, L_k):
    expected = causal_lower_right(L_q, L_k)._materialize()
    assert torch.equal(masks.causal(L_q, L_k), expected)


@given(L_q=lengths, L_k=lengths, window=st.integers(min_value=1, max_value=14))
def test_int_window_sees_itself_and_the_window_minus_one_keys_before(L_q, L_k, window):
    shift = L_k - L_q
    expected = torch.tensor(
        [[0 <= (i + shift) - j < window for j in range(L_k)] for i in range(L_q)]
    )
    assert torch.equal(masks.sliding_window(L_q, L_k, window), expected)


@given(L_q=lengths, L_k=lengths, left=st.integers(0, 6), right=st.integers(0, 6))
def test_two_sided_window_matches_flash_attention_window_size(L_q, L_k, left, right):
    shift = L_k - L_q
    expected = torch.tensor(
        [[-left <= j - (i + shift) <= right for j in range(L_k)] for i in range(L_q)]
    )
    assert torch.equal(masks.sliding_window(L_q, L_k, (left, right)), expected)


def test_padding_marks_real_tokens_and_broadcasts_over_heads_and_queries():
    mask = masks.padding(torch.tensor([3, 0, 5]), max_len=5)
    assert mask.shape == (3, 1, 1, 5)
    assert mask[:, 0, 0].tolist() == [
        [True, True, True, False, False],
        [False] * 5,
        [True] * 5,
    ]
    assert masks.padding(torch.tensor([2, 4])).shape == (2, 1, 1, 4)


def test_combine_ands_bool_masks_with_broadcasting():
    combined = masks.combine(masks.causal(4), masks.padding(torch.tensor([2, 4]), 4), None)
    assert combined.shape == (2, 1, 4, 4)
    assert torch.equal(combined[1, 0], masks.causal(4))
    assert combined[0, 0, 3].tolist() == [True, True, False, False]
    assert masks.combine() is None and masks.combine(None) is None


def test_combine_with_a_float_mask_is_additive():
    bias = torch.full((3, 3), 0.5)
    combined = masks.combine(masks.causal(3), bias)
    assert combined.dtype == torch.float32
    assert combined[0, 0] == 0.5 and combined[0, 1] == float("-inf")


def test_torch_attn_mask_conversion_round_trips_and_inverts_polarity():
    ours = masks.causal(4, 6)
    theirs = masks.to_torch_attn_mask(ours)
    assert torch.equal(theirs, ~ours)  # nn.MultiheadAttention: True = blocked
    assert torch.equal(masks.from_torch_attn_mask(theirs), ours)
    per_head = torch.rand(2 * 3, 4, 6) > 0.5  # (B * H, L_q, L_k) as nn.MultiheadAttention takes
    assert torch.equal(
        masks.to_torch_attn_mask(masks.from_torch_attn_mask(per_head, num_heads=3)), per_head
    )


def test_key_padding_mask_conversion_matches_nn_multihead_attention():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    key_padding_mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    _, weights = mha(x, x, x, key_padding_mask=key_padding_mask)
    ours = masks.from_torch_key_padding_mask(key_padding_mask)
    assert torch.equal(ours, masks.padding(torch.tensor([5, 3]), 5))
    # Every key the mask blocks got weight 0 from nn.MultiheadAttention.
    assert torch.all(weights.masked_select(~ours[:, 0].expand_as(weights)) == 0)
    assert torch.equal(masks.to_torch_key_padding_mask(ours), key_padding_mask)


def test_additive_conversions():
    bool_mask = masks.causal(3)
    additive = masks.to_additive(bool_mask, torch.float16)
    assert additive.dtype == torch.float16 and torch.isneginf(additive[0, 2])
    assert torch.equal(masks.from_additive(additive), bool_mask)
    legacy = torch.zeros(3, 3).masked_fill(~bool_mask, -1e9)  # the sentinel of older code
    assert torch.equal(masks.from_additive(legacy), bool_mask)
    bert = torch.zeros(3, 3).masked_fill(~bool_mask, -10000.0)  # BERT's original value
    assert torch.equal(masks.from_additive(bert), bool_mask)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: masks.causal(-1), ValueError, "L_q: expected a non-negative length, got -1"),
        (lambda: masks.causal(2.5), TypeError, "L_q: expected an int"),
        (lambda: masks.sliding_window(3, 3, 0), ValueError, "window: expected a positive"),
        (lambda: masks.sliding_window(3, 3, (1, -1)), ValueError, "window:"),
        (lambda: masks.padding(torch.tensor([2, -1])), ValueError, r"lengths: .*\[2, -1\]"),
        (lambda: masks.padding(torch.tensor([2.0])), TypeError, "lengths: expected an integer"),
        (lambda: masks.padding(torch.tensor([4]), 3), ValueError, "max_len: 3 is shorter"),
        (lambda: masks.combine(torch.ones(2, 2, dtype=torch.int64)), TypeError, "int64"),
        (lambda: masks.from_torch_attn_mask(torch.ones(6, 2, 2).bool()), ValueError, "num_heads"),
        (lambda: masks.from_additive(torch.ones(2, 2).bool()), TypeError, "floating-point"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
