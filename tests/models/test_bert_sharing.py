"""ALBERT-style cross-layer sharing (Lan et al. 2020): one block applied num_layers times."""

import pytest
import torch
import transformers

from qkv.layers import EncoderBlock
from qkv.models.bert import BertConfig, BertModel
from qkv.models.checkpoints import CheckpointError


def shared_model(num_layers: int = 4) -> BertModel:
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_name("tiny", num_layers=num_layers, share_layers=True))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model.eval()


def test_shared_model_has_the_parameters_of_one_block():
    shared = BertModel(BertConfig.from_name("tiny", num_layers=4, share_layers=True))
    unshared = BertModel(BertConfig.from_name("tiny", num_layers=4))
    E, F, V, P, T = 32, 64, 128, 64, 2
    # counted by hand: q, k, v, out projections; FFN up and down; two LayerNorms
    one_block = 4 * (E * E + E) + (E * F + F) + (F * E + E) + 2 * (2 * E)
    rest = V * E + P * E + T * E + 2 * E + (E * E + E)  # embeddings, their norm, the pooler
    assert sum(p.numel() for p in EncoderBlock(E, 4, F).parameters()) == one_block
    assert sum(p.numel() for p in shared.parameters()) == rest + one_block
    assert sum(p.numel() for p in unshared.parameters()) == rest + 4 * one_block
    reference = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=V,
            hidden_size=E,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=F,
            max_position_embeddings=P,
            type_vocab_size=T,
        )
    )
    assert reference.num_parameters() == rest + 4 * one_block
    assert len(shared.layers) == 1 and all(shared.layer(i) is shared.layers[0] for i in range(4))


def test_shared_model_applies_its_one_block_num_layers_times():
    model = shared_model(num_layers=4)
    ids = torch.randint(1, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        got = model(ids, mask).last_hidden_state
        x = model.embeddings(ids, torch.zeros_like(ids))
        block = model.layers[0]
        for _ in range(4):
            x = block(x, mask=mask[:, None, None, :])
    torch.testing.assert_close(got, x, rtol=0, atol=0)
    with torch.no_grad():
        once = model.embeddings(ids, torch.zeros_like(ids))
        once = block(once, mask=mask[:, None, None, :])
    assert (got - once).abs().max() > 0.1  # depth 4 is not depth 1


def test_shared_model_saves_as_an_ordinary_bert_that_transformers_runs(tmp_path):
    """The one block is written under every encoder.layer.{i}: transformers, which knows no
    sharing, loads it as a 4-layer BERT and computes the same function."""
    model = shared_model(num_layers=4)
    model.save_pretrained(tmp_path)
    theirs, info = transformers.BertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        got = model(ids).last_hidden_state
        want = theirs.eval()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    reloaded = BertModel.from_pretrained(tmp_path)
    assert reloaded.config.share_layers and len(reloaded.layers) == 1


def test_loading_different_layers_into_a_shared_model_is_refused(tmp_path):
    torch.manual_seed(0)
    BertModel(BertConfig.from_name("tiny")).save_pretrained(tmp_path)  # two distinct layers
    config_file = tmp_path / "config.json"
    config_file.write_text(
        config_file.read_text().replace('"vocab_size"', '"qkv_share_layers": true, "vocab_size"')
    )
    with pytest.raises(CheckpointError, match=r"share_layers: encoder\.layer\.1\..* differs"):
        BertModel.from_pretrained(tmp_path)
