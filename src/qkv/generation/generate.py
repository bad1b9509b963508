"""`qkv.generate`: autoregressive decoding for decoder-only models with a KV cache.

Seed 002 section 6.1 / Q21 and seed 004 ("autoregressive inference"): one prefill pass over the
prompt fills every layer's cache, then each step feeds only the newest token, whose query
attends over the cache: O(t) per step instead of O(t^2).

Batches of prompts of different lengths are left-padded: the pad tokens are masked out as keys
and every row's position ids count only its real tokens, so row b's tokens get the same
positions (and RoPE angles) as if it were alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from qkv.generation.sampling import check_sampling, next_token
from qkv.layers.kv_cache import SinkKVCache, StaticKVCache


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    seed: int | None = None,
    sinks: tuple[int, int] | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Prompt followed by up to `max_new_tokens` new tokens, (B, L + new).

    input_ids (B, L), left-padded when prompts differ in length, with attention_mask (B, L)
    (1 = real token). Greedy unless temperature > 0 (then top-k / top-p sampling from a
    generator seeded with `seed`). Rows that emit `eos_token_id` are padded with it afterwards;
    decoding stops when every row has. `sinks=(num_sinks, window)` decodes with a StreamingLLM
    cache of that size, past the model's context. `on_token(tokens (B,))` streams each step.
    """
    steps = stream(
        model, input_ids, max_new_tokens=max_new_tokens, attention_mask=attention_mask,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
        seed=seed, sinks=sinks,
    )  # fmt: skip
    new_tokens = []
    for tokens in steps:
        new_tokens.append(tokens)
        if on_token is not None:
            on_token(tokens)
    return torch.cat([input_ids, *[t.unsqueeze(1) for t in new_tokens]], dim=1)


def stream(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    seed: int | None = None,
    sinks: tuple[int, int] | None = None,
) -> Iterator[torch.Tensor]:
    """The same decoding as `generate`, yielding each step's tokens (B,) as they come."""
    config = model.config
    B, L = _check_call(config, input_ids, max_new_tokens, eos_token_id, sinks)
    check_sampling(temperature, top_k, top_p, config.vocab_size)
    mask = _prompt_mask(attention_mask, B, L, input_ids.device)
    if sinks is not None and attention_mask is not None and not bool(mask.all()):
        raise ValueError("attention_mask: padded prompts are not supported with sinks")
    cache = _make_cache(model, B, L + max_new_tokens, sinks, input_ids)
    generator = _generator(seed, input_ids.device) if temperature > 0 else None
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): real tokens count
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    tokens, step_mask, step_positions = input_ids, mask, positions
    for _ in range(max_new_tokens):
        logits = _forward(model, tokens, step_mask, step_positions, cache)  # (B, V)
        chosen = next_token(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        if eos_token_id is not None:
            chosen = torch.where(finished, eos_token_id, chosen)
            finished = finished | (chosen == eos_token_id)
        yield chosen
        if eos_token_id is not None and bool(finished.all()):  # the one host sync per step
            return
        tokens = chosen.unsqueeze(1)  # (B, 1)
        step_positions = step_positions[:, -1:] + 1  # (B, 1)
        step_mask = torch.cat([step_mask, step_mask.new_ones(B, 1)], dim=1)


def _forward(model, tokens, mask, positions, cache) -> torch.Tensor:
    """Logits of the last position of each row, (B, V), in fp32."""
    if isinstance(cache, SinkKVCache):  # one token at a time; every cached token is real
        for i in range(tokens.shape[1]):
            logits = model(tokens[:, i : i + 1], cache=cache).logits
        return logits[:, -1].float()
    output = model(tokens, attention_mask=mask, position_ids=positions, cache=cache)
    return output.logits[:, -1].float()


def _make_cache(model, batch: int, length: int, sinks, input_ids) -> StaticKVCache | SinkKVCache:
    config = model.config
    dtype = next(model.parameters()).dtype
    shape = {
        "num_layers": config.num_layers, "batch": batch, "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "dtype": dtype, "device": input_ids.device,
    }  # fmt: skip
    if sinks is not None:
        return SinkKVCache(num_sinks=sinks[0], window=sinks[1], **shape)
    return StaticKVCache(max_length=length, **shape)


def _prompt_mask(attention_mask, B: int, L: int, device) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, L):
        raise ValueError(f"attention_mask: expected shape ({B}, {L}), got {attention_mask!r}")
    return attention_mask.bool()


def _generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check_call(config, input_ids, max_new_tokens: int, eos_token_id, sinks) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected a non-empty (B, L) tensor, got {input_ids!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens}")
    if eos_token_id is not None and not 0 <= eos_token_id < config.vocab_size:
        raise ValueError(
            f"eos_token_id: {eos_token_id} is outside the vocabulary [0, {config.vocab_size})"
        )
    B, L = input_ids.shape
    if sinks is None and L + max_new_tokens > config.max_positions:
        raise ValueError(
            f"input_ids: {L} prompt tokens + max_new_tokens={max_new_tokens} exceed the model's "
            f"context of {config.max_positions}; expected fewer, or sinks=(num_sinks, window) "
            f"for StreamingLLM decoding"
        )
    if sinks is not None and config.position != "rope":
        raise ValueError(
            f"sinks: StreamingLLM caches re-rotate keys by their cache position, which needs "
            f"RoPE; this model has {config.position!r} positions"
        )
    if sinks is not None and (len(sinks) != 2 or sinks[0] + sinks[1] > config.max_positions):
        raise ValueError(
            f"sinks: expected (num_sinks, window) with a total <= {config.max_positions}, "
            f"got {sinks!r}"
        )
    return B, L
