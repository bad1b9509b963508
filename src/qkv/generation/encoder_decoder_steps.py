"""Decoding an encoder-decoder `Transformer` (Vaswani et al. 2017): the encoder runs once; the
decoder starts from the start token and keeps a `DecoderCache`, whose cross-attention keys and
values are projected from the memory once per source and shared by every row of that source.
The step source of `qkv.generate`'s loop for such a model (steps.py has the decoder-only one).
"""

from __future__ import annotations

import torch

from qkv.generation.loop import Choice, Logits
from qkv.generation.options import DecodeOptions, check_tokens

__all__ = ["EncoderDecoderSteps", "encoder_decoder_source"]


class EncoderDecoderSteps:
    """An encoder-decoder `Transformer`: the source encoded once (here, under no_grad, which
    also checks its ids), then the target from the config's start token, cached.

    input_ids (B, L_src) with attention_mask (B, L_src) (1/True on real tokens) or None.
    """

    def __init__(self, model, input_ids, attention_mask, max_new_tokens: int) -> None:
        with torch.no_grad():
            self.memory = model.encode(input_ids, attention_mask)  # (B, L_src, E)
        B = self.memory.shape[0]
        self.model, self.memory_mask = model, attention_mask
        self.cache = model.new_decoder_cache(B, max(1, max_new_tokens))
        bos = model.config.bos_token_id
        self.start = torch.full((B, 1), bos, dtype=torch.long, device=self.memory.device)

    def first(self) -> Logits:
        return self._logits(self.start)  # (B, V)

    def next(self, choice: Choice) -> Logits:
        if choice.prompts is not None:  # rows of one source share its memory's keys/values
            self.memory = self.memory[choice.prompts]
            if self.memory_mask is not None:
                self.memory_mask = self.memory_mask[choice.prompts]
            self.cache.reorder_cross_attention(choice.prompts)
        if choice.parents is not None:
            self.cache.reorder_self_attention(choice.parents)
        return self._logits(choice.tokens.unsqueeze(1))

    def _logits(self, tokens: torch.Tensor) -> Logits:
        """Feed each row's newest token: logits of the token after it, (R, V), fp32."""
        logits = self.model.decode(
            tokens, self.memory, memory_mask=self.memory_mask, cache=self.cache
        )
        return Logits(logits[:, -1].float())


def encoder_decoder_source(model, input_ids, options: DecodeOptions, attention_mask):
    """(EncoderDecoderSteps, the start tokens, eos_token_id) of an encoder-decoder's call."""
    config = model.config
    if options.sinks is not None:
        raise ValueError(
            "sinks: StreamingLLM caches are for decoder-only models; expected sinks=None for an "
            "encoder-decoder Transformer"
        )
    eos = config.eos_token_id if options.eos_token_id is None else options.eos_token_id
    check_tokens(options, config.tgt_vocab_size, eos)
    if 1 + options.max_new_tokens > config.max_positions:
        raise ValueError(
            f"max_new_tokens: the start token + {options.max_new_tokens} new tokens exceed the "
            f"model's target context of {config.max_positions}; expected at most "
            f"{config.max_positions - 1}"
        )
    source = EncoderDecoderSteps(model, input_ids, attention_mask, options.max_new_tokens)
    return source, source.start, eos
