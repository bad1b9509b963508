"""The Hugging Face architectures qkv reads and writes, registered by the family modules.

Each supported architecture (the `architectures[0]` of a config.json, e.g. "BertModel",
"GPT2LMHeadModel", "LlamaForCausalLM") is an `Architecture`: how to build the qkv model from
config.json, how its keys map, and how to write config.json back. Checkpoint key names live
only in the family modules (`bert`, `gpt2`, `llama`, `t5`) beside this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from qkv.models.checkpoints.core import KeyMap

__all__ = ["ARCHITECTURES", "Architecture", "register"]


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture that qkv reads and writes."""

    name: str  # as in config.json's "architectures"
    model_class: type[nn.Module]
    build: Callable[[dict], nn.Module]  # config.json -> a qkv model with fresh weights
    key_map: Callable[[nn.Module], KeyMap]
    hf_config: Callable[[nn.Module], dict]  # qkv model -> config.json


ARCHITECTURES: dict[str, Architecture] = {}


def register(architecture: Architecture) -> None:
    ARCHITECTURES[architecture.name] = architecture
