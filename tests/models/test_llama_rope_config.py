"""config.json's RoPE fields read by qkv as transformers 5 reads them: `rope_scaling` next to
`rope_parameters`, top-level rope_theta, original_max_position_embeddings and
partial_rotary_factor. Each case edits the config.json of a tiny saved `LlamaForCausalLM`, then
compares the logits transformers computes from that folder with those of `GPT.from_pretrained`."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers

from qkv.models.checkpoints import CheckpointError
from qkv.models.gpt import GPT

TINY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
LONGROPE = {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.1, 1.3, 2.0] * 2,
            "long_factor": [1.0, 3.0, 8.0, 20.0] * 2}  # fmt: skip

# config.json edits on top of the saved {"rope_parameters": {"rope_type": "default",
# "rope_theta": 500.0}}: (edits, the rope_theta and rope_type transformers ends up with)
CASES = {
    "rope-scaling-beside-rope-parameters": (
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 10000.0, "linear",
    ),
    "top-level-rope-theta-fills-rope-scaling": (
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_theta": 50.0},
        50.0, "dynamic",
    ),
    "rope-scaling-theta-beats-rope-parameters": (
        {"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500.0},
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 300.0,
                          "original_max_position_embeddings": 8}},
        300.0, "yarn",
    ),
    "top-level-original-length-beats-rope-scaling": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 8},
         "original_max_position_embeddings": 16},
        10000.0, "yarn",
    ),
    "phi3-longrope-original-length-at-top-level": (
        {"rope_scaling": LONGROPE, "original_max_position_embeddings": 20}, 10000.0, "longrope",
    ),
}  # fmt: skip


def _saved_tiny_llama(folder, edits: dict) -> None:
    """A tiny LlamaForCausalLM (plain RoPE, theta 500) saved to `folder`, its config.json edited."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, rope_theta=500.0))
    with torch.no_grad():  # weights large enough that a wrong rotation shows
        for parameter_name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.3)
            if "norm" in parameter_name:
                parameter.add_(1.0)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | edits))


@pytest.mark.parametrize("name", list(CASES))
def test_rope_fields_follow_transformers_precedence(name, tmp_path, caplog):
    """Logits at 48 positions: past max_position_embeddings (32) and every original length."""
    edits, theta, kind = CASES[name]
    _saved_tiny_llama(tmp_path, edits)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reference.config.rope_parameters["rope_theta"] == theta
    assert reference.config.rope_parameters["rope_type"] == kind
    with caplog.at_level(logging.WARNING, logger="qkv.models.checkpoints.llama"):
        model = GPT.from_pretrained(tmp_path).eval()
    assert model.config.rope_base == theta and model.config.rope_scaling.kind == kind
    assert "rope_parameters' {" in caplog.text  # what is set aside is said
    input_ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=input_ids).logits
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=0, atol=1e-5)


def test_top_level_partial_rotary_factor_is_refused_where_transformers_fails(tmp_path):
    """transformers moves a top-level partial_rotary_factor into the RoPE object; Llama's
    linear scaling then builds cos/sin for half the head and its forward fails."""
    _saved_tiny_llama(tmp_path, {"rope_parameters": {"rope_type": "linear", "factor": 2.0},
                                 "partial_rotary_factor": 0.5})  # fmt: skip
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="must match the size"):
        reference(input_ids=torch.tensor([[1, 2, 3]]))
    with pytest.raises(CheckpointError, match="rope_scaling: partial_rotary_factor: .* got 0.5"):
        GPT.from_pretrained(tmp_path)
