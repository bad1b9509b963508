"""`built_on_meta`: a model built with no memory and no random fill, torch.nn.init restored
after, and no torch._dynamo import on the way (what a cold `from_gguf` paid before)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from qkv.models import GPT, GPTConfig
from qkv.models.building import built_on_meta

CONFIG = GPTConfig(vocab_size=64, embed_dim=16, num_layers=2, num_heads=2, ffn_dim=32)


def test_every_parameter_is_on_meta_and_the_fills_are_back_after():
    fills = {name: getattr(nn.init, name) for name in ("normal_", "uniform_", "zeros_")}
    model = built_on_meta(lambda: GPT(CONFIG))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(getattr(nn.init, name) is fill for name, fill in fills.items())
    with pytest.raises(TypeError, match="config"):
        built_on_meta(lambda: GPT("not a config"))
    assert all(getattr(nn.init, name) is fill for name, fill in fills.items())


def test_a_cold_process_builds_without_importing_torch_dynamo():
    code = (
        "import sys\n"
        "from qkv.models import GPT, GPTConfig\n"
        "from qkv.models.building import built_on_meta\n"
        "built_on_meta(lambda: GPT(GPTConfig(vocab_size=64, embed_dim=16, num_layers=2, "
        "num_heads=2, ffn_dim=32)))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, check=True)  # fmt: skip
    assert done.stdout.strip() == "False", done.stderr
