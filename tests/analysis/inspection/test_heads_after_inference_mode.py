"""`qkv report --heads` on a RoPE model (Llama-style): the report's forward pass runs in
inference mode, then head importance takes gradients through the same RotaryEmbedding."""

from __future__ import annotations

import json
import re

import pytest
import torch

from qkv.analysis.pages.report import build_report
from qkv.models import GPT, GPTConfig

pytest.importorskip("matplotlib")

WORDS = ["[PAD]", "[UNK]", "the", "food", "was", "great", "but", "service", "terrible"]
TEXT = "the food was great but the service was terrible"


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_heads_section_of_a_tiny_llama_has_the_importance_of_every_head():
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny-llama", vocab_size=len(WORDS))
    assert config.position == "rope"
    model = GPT(config).eval()
    page = build_report(model, _tokenizer(), TEXT, model_name="llama", sections=("heads",))
    data = json.loads(re.search(r'id="qkv-head-importance">(.*?)</script>', page).group(1))
    assert data["names"] == [f"blocks.{i}.self" for i in range(config.num_layers)]
    for scores in data["importance"]:  # normalised per layer: unit L2 norm
        assert len(scores) == config.num_heads
        assert abs(sum(s * s for s in scores) - 1.0) < 1e-5
