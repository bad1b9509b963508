"""Models and prompts shared by the generation tests.

Weights are re-drawn with a larger standard deviation than the N(0, 0.02^2) initialisation:
with the default, logits are all close to zero and nearly tied, so a wrong mask, position or
cache slot would change them by less than any tolerance could see (and greedy ties would flip
on rounding noise).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

import qkv.models as models

VOCAB = 100
_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
_SMALL |= {"num_attention_heads": 4, "attention_dropout": 0.0, "max_position_embeddings": 64}


def redraw(model: nn.Module, std: float = 0.3, seed: int = 0) -> nn.Module:
    """Every parameter ~ N(0, std^2), norm weights ~ 1 + N(0, std^2); eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                noise = torch.randn(parameter.shape, generator=generator) * std
                is_norm_weight = "Norm" in type(module).__name__ and name == "weight"
                parameter.copy_(noise + 1.0 if is_norm_weight else noise)
    return model.eval()


def qkv_model(preset: str, **overrides: object) -> models.GPT:
    """A qkv GPT from a preset (dropout off), with re-drawn weights."""
    config = models.GPTConfig.from_name(preset, dropout=0.0, attention_dropout=0.0, **overrides)
    torch.manual_seed(0)
    return redraw(models.GPT(config))


def _hf_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


HF_BUILDERS = {
    "gpt2": _hf_gpt2,
    "llama-gqa": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_SMALL, num_key_value_heads=2)
    ),
    "llama-mqa": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_SMALL, num_key_value_heads=1)
    ),
    "mistral-window-4": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**_SMALL, num_key_value_heads=2, sliding_window=4)
    ),
}


def hf_model(name: str) -> nn.Module:
    """A transformers causal LM (torch.manual_seed(0), then re-drawn weights), with no EOS
    token, so that its `generate` never stops early unless told to."""
    torch.manual_seed(0)
    model = redraw(HF_BUILDERS[name]())
    for config in (model.config, model.generation_config):
        config.eos_token_id = config.bos_token_id = None  # GPT-2's 50256 is outside VOCAB
    return model


def left_padded_prompts(length: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (3, length) and attention_mask: row 0 full, row 1 with 4 pads, row 2 with 1.

    Pad slots hold token 0, which is never attended to.
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (3, length), generator=generator)
    attention_mask = torch.ones(3, length, dtype=torch.long)
    attention_mask[1, :4] = 0
    attention_mask[2, :1] = 0
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask
