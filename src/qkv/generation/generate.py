"""`qkv.generate`: autoregressive decoding for decoder-only models with a KV cache.

One prefill pass over the prompt fills every layer's cache, then each step feeds only the newest
token, whose query attends over the cache: O(t) per step instead of O(t^2).

Batches of prompts of different lengths are left-padded: the pad tokens are masked out as keys
and every row's position ids count only its real tokens, so row b's tokens get the same
positions (and RoPE angles) as if it were alone.

`compile=True` runs every step after the prefill through the model's forward compiled by
`torch.compile` (dynamic shapes, one graph for every step and cache length): the norms, RoPE, casts
and cache writes between the matrix products fuse into a few kernels, which on the CPU is most of a
step's time outside the products themselves. Compiling costs tens of seconds once per model (its
later calls, and later `packed_linears` blocks, reuse the graphs), and needs what torch.compile's
inductor needs on the CPU: a C++ compiler. Inside `qkv.acceleration.packed_linears` the products of
one row compile to streaming reductions too (see qkv.acceleration.packing), for several times
transformers' tokens/s on the CPU (benchmarks/decode.py). Once two steps have passed a graph's
guards, later steps call it without checking them again (`CompiledSteps`, through torch.compile's
ahead-of-time compilation); `compile="guarded"` keeps to torch.compile's public API and checks every
guard at every step (`GuardedSteps`), the same tokens, a little slower per step; `compile=True`
falls back to it where this torch lacks what the faster path calls.

Three entry points, one loop: `decode_steps` yields a `DecodeStep` (tokens, the logits they were
chosen from, the cache) per step; `stream` yields only the tokens; `generate` returns the whole
sequences. All three check their arguments when called, before any decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from qkv.acceleration.compiled import compiled_steps, mark_cache_dynamic
from qkv.generation.options import DecodeOptions, decode_options
from qkv.generation.sampling import LogitsCheck, next_token
from qkv.layers.kv_cache import SinkKVCache, StaticKVCache

__all__ = [
    "DecodeOptions",
    "DecodeStep",
    "decode_steps",
    "generate",
    "make_cache",
    "stream",
]


@dataclass(frozen=True)
class DecodeStep:
    """One decoding step.

    tokens (B,) int64: the token chosen for each row (`eos_token_id` for rows already done).
    logits (B, V) fp32: the model's next-token logits that step, before temperature and
    filtering (what transformers' `generate(output_logits=True)` returns).
    cache: the KV cache decoding writes into, to inspect (its length, its memory); not to
    modify.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    cache: StaticKVCache | SinkKVCache


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    options: DecodeOptions | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    **fields: object,
) -> torch.Tensor:
    """Prompt followed by up to `max_new_tokens` new tokens, (B, L + new).

    input_ids (B, L), left-padded when prompts differ in length, with attention_mask (B, L)
    (1 = real token, 0 = padding; every row's 0s before its 1s, and at least one 1). How to
    decode is a `DecodeOptions` (max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
    sinks, compile), given whole or field by field (`max_new_tokens=32`), or both (the fields
    replace the object's). Greedy unless temperature > 0. Rows that emit `eos_token_id` are
    padded with it afterwards; decoding stops when every row has. `sinks=(num_sinks, window)`
    decodes with a StreamingLLM cache of that size, past the model's context.
    `on_token(tokens (B,))` streams each step. `compile=True` decodes with the model's forward
    compiled (see the module doc): the same tokens, faster steps after a one-time compilation;
    `compile="guarded"` with torch.compile's public API alone, every guard checked every step.

    Raises ValueError naming `model` when its logits stop being finite (NaN, +inf, or -inf
    for every token), with the step where they did: see `LogitsCheck` for when it is seen.
    """
    steps = stream(model, input_ids, options, attention_mask=attention_mask, **fields)
    new_tokens = []
    for tokens in steps:
        new_tokens.append(tokens)
        if on_token is not None:
            on_token(tokens)
    return torch.cat([input_ids, *[t.unsqueeze(1) for t in new_tokens]], dim=1)


def stream(
    model: nn.Module,
    input_ids: torch.Tensor,
    options: DecodeOptions | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    **fields: object,
) -> Iterator[torch.Tensor]:
    """The same decoding as `generate`, yielding each step's tokens (B,) as they come."""
    steps = decode_steps(model, input_ids, options, attention_mask=attention_mask, **fields)
    return (step.tokens for step in steps)


def decode_steps(
    model: nn.Module,
    input_ids: torch.Tensor,
    options: DecodeOptions | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    **fields: object,
) -> Iterator[DecodeStep]:
    """The same decoding as `generate`, yielding a `DecodeStep` (tokens, logits, cache) per step.

    Arguments are checked here, when called; the decoding runs as the iterator is consumed.
    """
    options = decode_options(options, fields)
    config = model.config
    B, L = _check_call(config, input_ids, options)
    sinks, compile = options.sinks, options.compile
    step_forward = compiled_steps(model, sinks, guarded=compile == "guarded") if compile else model
    mask, padded = _prompt_mask(attention_mask, B, L, input_ids.device)
    if sinks is not None and padded:
        raise ValueError(
            "attention_mask: padded prompts are not supported with sinks (a StreamingLLM cache "
            "holds only real tokens); expected an all-ones mask, or one prompt per call"
        )
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): real tokens count
    cache = make_cache(model, batch=B, max_length=L + options.max_new_tokens, sinks=sinks)
    if compile:
        mark_cache_dynamic(cache)
    sampled = options.temperature > 0
    generator = _generator(options.seed, input_ids.device) if sampled else None
    # Without padding every key is real: the model gets no mask at all, rather than an all-ones
    # one that it would inspect (a host sync) and drop at every step.
    step_mask = mask if padded else None
    return _decode(
        model, step_forward, input_ids, step_mask, positions, cache, options.max_new_tokens,
        options.eos_token_id, options.sampling, generator,
    )  # fmt: skip


def _decode(
    model, step_forward, input_ids, mask, positions, cache, max_new_tokens, eos_token_id,
    sampling, generator,
):  # fmt: skip
    """The decoding loop of `decode_steps`, its arguments already checked. mask: (B, L) with
    padding, or None without; positions (B, L) of the prompt's tokens. The prompt goes through
    `model`, every later step through `step_forward` (the model, or its compiled forward)."""
    B = input_ids.shape[0]
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    tokens, step_mask, step_positions = input_ids, mask, positions
    check = LogitsCheck(input_ids.device)
    for step in range(max_new_tokens):
        # no_grad per call, not around the loop: a grad mode set inside a generator would leak
        # into the caller's code between steps.
        with torch.no_grad():
            # Only the prompt needs its ids checked: later tokens are this loop's own choices.
            prefill = tokens is input_ids
            forward = model if prefill else step_forward
            logits = _forward(forward, tokens, step_mask, step_positions, cache, prefill)  # (B, V)
        chosen = next_token(check.choosable(logits, step), **sampling, generator=generator)
        done = False
        if eos_token_id is not None:
            chosen = torch.where(finished, eos_token_id, chosen)
            finished = finished | (chosen == eos_token_id)
            done = check.all_done(finished)  # a host sync, with an eos only
        yield DecodeStep(tokens=chosen, logits=logits, cache=cache)
        if done:
            return
        tokens = chosen.unsqueeze(1)  # (B, 1)
        step_positions = step_positions[:, -1:] + 1  # (B, 1)
        if step_mask is not None:
            step_mask = torch.cat([step_mask, step_mask.new_ones(B, 1)], dim=1)
    check.finish()


def _forward(model, tokens, mask, positions, cache, check_ids: bool) -> torch.Tensor:
    """Logits of the last position of each row, (B, V), in fp32: the only ones computed."""
    options = {"logits_to_keep": 1, "check_ids": check_ids}
    if isinstance(cache, SinkKVCache):  # one token at a time; every cached token is real
        for i in range(tokens.shape[1]):
            logits = model(tokens[:, i : i + 1], cache=cache, **options).logits
        return logits[:, -1].float()
    output = model(tokens, attention_mask=mask, position_ids=positions, cache=cache, **options)
    return output.logits[:, -1].float()


def make_cache(
    model: nn.Module,
    *,
    batch: int,
    max_length: int,
    sinks: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> StaticKVCache | SinkKVCache:
    """The KV cache `generate` decodes `model` with: `max_length` slots per row, or a
    StreamingLLM cache of num_sinks + window slots when `sinks=(num_sinks, window)`.

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


def _prompt_mask(attention_mask, B: int, L: int, device) -> tuple[torch.Tensor, bool]:
    """The prompt's key mask (B, L) bool, and whether any row is padded (one host sync, here
    rather than in every step). A mask must be 0/1, left-padded, with a real token per row:
    decoding reads each row's last position as its newest token."""
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


def _generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check_call(config, input_ids, options: DecodeOptions) -> tuple[int, int]:
    """What the options ask of this model and prompt; (B, L)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected a non-empty (B, L) tensor, got {input_ids!r}")
    eos, top_k, max_new_tokens = options.eos_token_id, options.top_k, options.max_new_tokens
    if eos is not None and not 0 <= eos < config.vocab_size:
        raise ValueError(f"eos_token_id: {eos} is outside the vocabulary [0, {config.vocab_size})")
    if top_k is not None and top_k > config.vocab_size:
        raise ValueError(f"top_k: {top_k} exceeds the vocabulary size {config.vocab_size}")
    B, L = input_ids.shape
    if options.sinks is None and L + max_new_tokens > config.max_positions:
        raise ValueError(
            f"input_ids: {L} prompt tokens + max_new_tokens={max_new_tokens} exceed the model's "
            f"context of {config.max_positions}; expected fewer, or sinks=(num_sinks, window) "
            f"for StreamingLLM decoding"
        )
    if options.sinks is not None:
        _check_sinks(config, options.sinks)
    return B, L


def _check_sinks(config, sinks) -> None:
    if config.position != "rope":
        raise ValueError(
            f"sinks: StreamingLLM caches re-rotate keys by their cache position, which needs "
            f"RoPE; this model has {config.position!r} positions"
        )
    if sinks[0] + sinks[1] > config.max_positions:
        raise ValueError(
            f"sinks: num_sinks + window = {sinks[0] + sinks[1]} exceeds the model's context of "
            f"{config.max_positions}; expected a total <= {config.max_positions}"
        )
