"""Step sources: a model being decoded, one step at a time, with its caches.

The decoding loop (qkv.generation.loop) asks a source for the logits after the prompt
(`first()`), then hands it each step's `Choice` (`next(choice)`): the source feeds the chosen
tokens and returns the logits after them. A choice with `parents` (beam search) moves rows: the
source reorders its caches so that row i continues row parents[i].

- `DecoderOnlySteps` (GPT-2, Llama, Mistral): one prefill pass over the prompt fills every
  layer's KV cache, then each step feeds only the newest token, whose query attends over the
  cache: O(t) per step instead of O(t^2). Prompts of different lengths are left-padded: pad
  tokens are masked out as keys and each row's position ids count only its real tokens, so a
  row's tokens get the positions (and RoPE angles) they would have alone.
- `EncoderDecoderSteps` (the encoder-decoder `Transformer`, encoder_decoder_steps.py): the
  encoder runs once; the decoder starts from the start token and keeps a `DecoderCache`.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.generation.loop import Choice, Logits
from qkv.layers.kv_cache import StaticKVCache
from qkv.layers.sink_cache import SinkKVCache

__all__ = ["PROMPT_CHUNK", "DecoderOnlySteps", "make_cache", "prompt_mask"]

# Prompt tokens per pass of the model: few enough that a long prompt's activations stay small,
# enough for each product's fixed costs to amortise. SmolLM2-135M, a 4096-token prompt (Intel
# AVX-512, 2 threads; benchmarks/prompt_chunks.py): the peak rise 402 -> 220 MB in Q4_1, 342 ->
# 206 in Q8_0 (180 of them KV cache), for 8% and 12% of the prefill's speed; chunks of 256 cost
# Q8_0 ~20% (its prompt products dequantize their weights at every call).
PROMPT_CHUNK = 512


class DecoderOnlySteps:
    """A decoder-only model and its KV cache.

    input_ids (B, L); mask (B, L) bool with padding, or None without (every key real: the model
    then gets no mask, rather than an all-ones one it would inspect, a host sync, and drop at
    every step); positions (B, L) of the prompt's tokens. The prompt goes through `model` (its
    ids checked), every later step through `step` (the model, or what stands in for its
    forward: `qkv.generate`'s `steps`), called as the model is and returning a CausalLMOutput
    (its `top_logit` and `top_token` where the step reduced its logits itself).
    `cached`: how many of the prompt's first tokens the cache holds already (prefix caching,
    qkv.generation.prompt_cache): the rest of the prompt goes through the model over them.
    `on_feed(tokens (R,))`: told each step's tokens before they go through the model.
    """

    def __init__(self, model, step, input_ids, mask, positions, cache, *, cached: int = 0,
                 on_feed=None) -> None:  # fmt: skip
        self.model, self.step, self.cache = model, step, cache
        self.input_ids, self.mask, self.positions = input_ids, mask, positions
        self.cached, self.on_feed = cached, on_feed

    def first(self) -> Logits:
        """The logits after the prompt (B, V), which goes through the model in chunks of
        PROMPT_CHUNK tokens, each attending over the cache the earlier ones filled: a long
        prompt's activations are held for one chunk at a time, not for the whole prompt. A
        prompt whose first `cached` tokens are in the cache starts after them."""
        length = self.input_ids.shape[1]
        if isinstance(self.cache, SinkKVCache) or (self.cached == 0 and length <= PROMPT_CHUNK):
            return self._logits(self.model, self.input_ids, check_ids=True)
        prompt_mask, prompt_positions = self.mask, self.positions
        for start in range(self.cached, length, PROMPT_CHUNK):
            end = min(start + PROMPT_CHUNK, length)
            self.mask = None if prompt_mask is None else prompt_mask[:, :end]
            self.positions = prompt_positions[:, start:end]
            logits = self._logits(self.model, self.input_ids[:, start:end], check_ids=True)
        return logits

    def next(self, choice: Choice) -> Logits:
        if choice.parents is not None:  # rows follow their parents: keys, mask and positions
            self.cache.reorder(choice.parents)
            self.positions = self.positions[choice.parents]
            if self.mask is not None:
                self.mask = self.mask[choice.parents]
        rows = choice.tokens.shape[0]
        self.positions = self.positions[:, -1:] + 1  # (R, 1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(rows, 1)], dim=1)
        if self.on_feed is not None:
            self.on_feed(choice.tokens)
        # Only the prompt needs its ids checked: later tokens are the loop's own choices.
        return self._logits(self.step, choice.tokens.unsqueeze(1), check_ids=False)

    def _logits(self, forward, tokens, check_ids: bool) -> Logits:
        """Logits of the last position of each row, (R, V), in fp32: the only ones computed."""
        options = {"logits_to_keep": 1, "check_ids": check_ids}
        if isinstance(self.cache, SinkKVCache):  # one token at a time; every cached one is real
            for i in range(tokens.shape[1]):
                output = forward(tokens[:, i : i + 1], cache=self.cache, **options)
        else:
            output = forward(
                tokens, attention_mask=self.mask, position_ids=self.positions, cache=self.cache,
                **options,
            )  # fmt: skip
        return Logits(output.logits[:, -1].float(), output.top_logit, output.top_token)


def make_cache(
    model: nn.Module,
    *,
    batch: int,
    max_length: int,
    sinks: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> StaticKVCache | SinkKVCache:
    """The KV cache `generate` decodes a decoder-only `model` with: `max_length` slots per row,
    or a StreamingLLM cache of num_sinks + window slots when `sinks=(num_sinks, window)`.

    Sized by the model's key/value heads H_kv, not its query heads (GQA/MQA shrink it);
    dtype and device default to those of the model's parameters.
    """
    config = model.config
    parameter = next(model.parameters())
    shape = {
        "num_layers": config.num_layers, "batch": batch, "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "dtype": parameter.dtype if dtype is None else dtype,
        "device": parameter.device if device is None else device,
    }  # fmt: skip
    if sinks is not None:
        return SinkKVCache(num_sinks=sinks[0], window=sinks[1], **shape)
    return StaticKVCache(max_length=max_length, **shape)


def prompt_mask(attention_mask, B: int, L: int, device) -> tuple[torch.Tensor, bool]:
    """A decoder-only prompt's key mask (B, L) bool, and whether any row is padded (one host
    sync, here rather than in every step). A mask must be 0/1, left-padded, with a real token
    per row: decoding reads each row's last position as its newest token."""
    if attention_mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device), False
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, L):
        raise ValueError(f"attention_mask: expected shape ({B}, {L}), got {attention_mask!r}")
    if attention_mask.device != device:
        raise ValueError(
            f"attention_mask: on device {attention_mask.device}, expected input_ids' device "
            f"{device}"
        )
    mask = attention_mask.bool()
    binary = ((attention_mask == 0) | (attention_mask == 1)).all()
    empty = ~mask.any(dim=1)  # (B,): no real token
    gap = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)  # (B,): a 0 after a 1
    flags = torch.stack((binary, mask.all(), empty.any(), gap.any())).tolist()
    if not flags[0]:
        raise ValueError(
            f"attention_mask: expected 0/1 (or bool) values, 1 on real tokens, got the values "
            f"{attention_mask.unique()[:8].tolist()}"
        )
    if flags[2]:
        raise ValueError(
            f"attention_mask: rows {empty.nonzero().flatten().tolist()} are all 0 (a prompt "
            f"with no real token); expected at least one 1 in every row"
        )
    if flags[3]:
        raise ValueError(
            f"attention_mask: rows {gap.nonzero().flatten().tolist()} have a 0 after a 1 (right "
            f"padding, or a gap); expected left padding, every row's 0s before its 1s, e.g. "
            f"[0, 0, 1, 1, 1]"
        )
    return mask, not flags[1]
