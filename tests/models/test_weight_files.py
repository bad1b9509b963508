"""Sharded Hugging Face folders load: the shards transformers itself writes (with its index)
give the same model, and the same logits, as the single file."""

from __future__ import annotations

import json

import torch
import transformers

import qkv.models as models
from qkv.models.checkpoints.weight_files import INDEX_NAME, weight_files


def test_shards_written_by_transformers_load_to_the_same_logits(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    reference.save_pretrained(tmp_path / "single")

    shards = weight_files(tmp_path / "sharded")
    assert len(shards) > 1 and (tmp_path / "sharded" / INDEX_NAME).is_file()
    weight_map = json.loads((tmp_path / "sharded" / INDEX_NAME).read_text())["weight_map"]
    assert {path.name for path in shards} == set(weight_map.values())

    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        expected = reference(ids).logits
        sharded = models.from_pretrained(tmp_path / "sharded")(ids).logits
        single = models.from_pretrained(tmp_path / "single")(ids).logits
    torch.testing.assert_close(sharded, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(sharded, single)


def test_saving_over_a_sharded_folder_replaces_it(tmp_path):
    """save_pretrained into a folder that holds shards and their index (a transformers save)
    removes them: the stale index would otherwise be read instead of the new file."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="20KB")
    model = models.from_pretrained(tmp_path)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    models.save_pretrained(model, tmp_path)
    assert not (tmp_path / INDEX_NAME).exists()
    assert [path.name for path in weight_files(tmp_path)] == ["model.safetensors"]
    reloaded = models.from_pretrained(tmp_path)
    loaded = reloaded.state_dict()
    for name, saved in model.state_dict().items():
        assert torch.equal(saved, loaded[name]), name
