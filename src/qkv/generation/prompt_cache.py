"""Prefix caching: one conversation's KV cache, kept from one decoding call to the next.

A chat's next prompt is its last prompt, the answer, and a new message. Run whole at each turn,
the prompt makes every turn wait longer than the last. A `PromptCache` keeps the keys and values
of the tokens the last call fed the model (its prompt and the tokens it generated, but the last
one, which was chosen and never fed) and, at the next call, keeps the longest prefix of them
that the new prompt starts with: only the rest of the prompt goes through the model, over the
kept cache. Reusing the cache of a shared prefix is what vLLM does across requests (Kwon et al.
2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention",
s4.4) and SGLang across a chat's turns (Zheng et al. 2024, "SGLang", s3, RadixAttention).

The prefix is matched on token ids, not text: an answer that the tokenizer would split
differently when the template renders it again shares the tokens up to there, and the rest is
recomputed. The logits are those of the whole prompt run afresh (to fp32's rounding of a
different order of sums), tested against it. One sequence (B = 1), unpadded, greedy search or
sampling; `qkv.generate(..., prompt_cache=)`, `stream` and `decode_steps` take it.

A cache belongs to one model as it was when the cache was filled: another model (or the model in
another dtype, or a call asking another `kv_dtype`) starts it afresh; a model whose weights
change in place (trained, loaded) needs `clear()`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from qkv.generation.steps import make_cache
from qkv.layers.kv_cache import StaticKVCache

__all__ = ["PromptCache"]


class PromptCache:
    """The KV cache of one sequence across decoding calls (see the module doc).

    `ids`: the token ids whose keys and values the cache holds; `reused`: how many of the last
    call's prompt tokens came from the cache rather than the model."""

    def __init__(self) -> None:
        self.cache: StaticKVCache | None = None
        self.reused = 0
        self._model: weakref.ref | None = None
        self._model_dtype: torch.dtype | None = None
        self._fed: list[torch.Tensor] = []  # the last call's prompt (L,), then its tokens (1,)

    @property
    def ids(self) -> list[int]:
        if self.cache is None:
            return []
        return torch.cat(self._fed).tolist()[: self.cache.length]

    def clear(self) -> None:
        """Forget the cached tokens and free their memory."""
        self.cache, self.reused, self._model, self._fed = None, 0, None, []

    def start(
        self, model: nn.Module, input_ids: torch.Tensor, max_length: int, dtype=None
    ) -> tuple[StaticKVCache, int]:
        """(The cache a call over `input_ids` (1, L) decodes with, at least `max_length` slots
        of `dtype` (None: the model's); how many of the prompt's first tokens it holds already,
        at most L - 1: the prompt's last token goes through the model, whose logits the first
        choice needs.) The fed tokens are recorded by `fed` from here on."""
        prompt = input_ids[0]  # (L,)
        dtype = next(model.parameters()).dtype if dtype is None else dtype
        kept = 0
        if self.cache is None or not self._holds(model, prompt, dtype):
            self.cache = make_cache(model, batch=1, max_length=max_length, dtype=dtype)
        else:  # its tensors kept, grown by doubling so that a long chat copies them rarely
            kept = _common_prefix(self.ids, prompt[:-1].tolist())
            slots = max_length
            if max_length > self.cache.max_length:
                slots = max(max_length, min(2 * self.cache.max_length, model.config.context_length))
            self.cache = self.cache.kept_prefix(kept, slots)
        self.reused, self._model, self._fed = kept, weakref.ref(model), [prompt]
        self._model_dtype = next(model.parameters()).dtype
        return self.cache, kept

    def fed(self, tokens: torch.Tensor) -> None:
        """The tokens (1,) of a step about to go through the model (recorded before it runs,
        so that an interrupted step leaves at most one token past the cache's length)."""
        self._fed.append(tokens)

    def _holds(self, model: nn.Module, prompt: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the cache was filled by `model` as it is (the same module, of the same
        dtype), in `dtype`, on the prompt's device."""
        keys = self.cache.keys[0]
        return (
            self._model is not None
            and self._model() is model
            and self._model_dtype == next(model.parameters()).dtype
            and keys.dtype == dtype
            and keys.device == prompt.device
        )


def _common_prefix(cached: list[int], prompt: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    length = 0
    for a, b in zip(cached, prompt, strict=False):
        if a != b:
            break
        length += 1
    return length
