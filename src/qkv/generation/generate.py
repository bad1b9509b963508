"""`qkv.generate`: autoregressive decoding with a KV cache, for decoder-only and
encoder-decoder models, by greedy search, sampling or beam search.

One loop does all of it (qkv.generation.loop): a step source feeds the model (steps.py: the
prefill of a decoder-only model's prompt, or the encoder and the decoder's start token), a
strategy chooses the tokens (strategies.py: greedy, sampling; beam_strategy.py). Three entry
points share that loop and one `DecodeOptions`: `generate` returns the whole sequences; in
streaming.py, `decode_steps` yields a `DecodeStep` (tokens, the logits they were chosen from,
the cache) per step and `stream` yields only the tokens. All three check their arguments when
called, before any decoding.

Decoder-only prompts of different lengths are left-padded, with an attention_mask; the output is
the prompt followed by the new tokens. An encoder-decoder `Transformer` takes the source ids
(padded on either side, with an attention_mask) and returns the target: its start token
(config.bos_token_id) followed by the new tokens; its end token defaults to config.eos_token_id.

Every step after a decoder-only model's prefill is a call of `steps`, which has the model's
decode signature: `steps(input_ids (B, 1), attention_mask=..., position_ids=..., cache=...,
logits_to_keep=1, check_ids=False)` returning a CausalLMOutput. The default is the model
itself, eager PyTorch. Faster steps come from outside, from `qkv.acceleration.decoding_steps`
(the step compiled ahead of time by AOTInductor, or by torch.compile): the same tokens, with
the one-time cost of compiling. A step that reduces its logits itself returns their row maxima
and argmax too (`CausalLMOutput.top_logit`, `top_token`), which greedy decoding then takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from qkv import capabilities
from qkv.generation.beam_strategy import BeamSearch
from qkv.generation.encoder_decoder_steps import EncoderDecoderSteps, encoder_decoder_source
from qkv.generation.loop import DecodeStep, decode_loop
from qkv.generation.options import DecodeOptions, check_tokens, decode_options
from qkv.generation.prompt_cache import PromptCache
from qkv.generation.steps import DecoderOnlySteps, make_cache, prompt_mask
from qkv.generation.strategies import TokenChoice
from qkv.models.encoder_decoder import Transformer

__all__ = [
    "DecodeOptions",
    "DecodeStep",
    "generate",
    "make_cache",
]


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    options: DecodeOptions | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    steps: Callable | None = None,
    prompt_cache: PromptCache | None = None,
    **fields: object,
) -> torch.Tensor:
    """The prompt followed by up to `max_new_tokens` new tokens, (B, L0 + new): L0 is the
    prompt's length for a decoder-only model, 1 (the start token) for an encoder-decoder.

    Decoder-only input_ids (B, L), left-padded when prompts differ in length, with
    attention_mask (B, L) (1 = real token, 0 = padding; every row's 0s before its 1s, and at
    least one 1). Encoder-decoder: the source ids (B, L_src) and their attention_mask. How to
    decode is a `DecodeOptions` (max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
    sinks, num_beams, length_penalty, early_stopping), given whole or field by field
    (`max_new_tokens=32`), or both (the fields replace the object's). Greedy unless
    temperature > 0 or num_beams > 1 (then the best hypothesis of each prompt). Rows that emit
    `eos_token_id` are padded with it afterwards; decoding stops when every row has (beam
    search: when every prompt is done). `sinks=(num_sinks, window)` decodes a decoder-only model
    with a StreamingLLM cache of that size, past its context. `on_token(tokens (B,))` streams
    each step (not with beam search, whose tokens are known only at the end). `steps` runs a
    decoder-only model's steps after its prefill (None: the model itself; see the module doc),
    e.g. `qkv.acceleration.decoding_steps(model)`: the same tokens, faster steps.
    `prompt_cache` (a `qkv.generation.PromptCache`, one unpadded prompt, no beams, no sinks)
    keeps the KV cache from one call to the next: a prompt that starts with the tokens an
    earlier call fed the model (a chat's next turn) sends only the rest through it.

    Raises ValueError naming `model` when its logits stop being finite (NaN, +inf, or -inf
    for every token), with the step where they did: see `LogitsCheck` for when it is seen.
    """
    options = decode_options(options, fields)
    if options.num_beams > 1 and on_token is not None:
        raise ValueError(
            "on_token: beam search knows its tokens only at the end; expected on_token=None "
            "with num_beams > 1 (or num_beams=1 to stream)"
        )
    decoding = start_decoding(model, input_ids, options, attention_mask, steps, prompt_cache)
    new_tokens = []  # (B,) each
    for step in decoding.steps:
        new_tokens.append(step.tokens)
        if on_token is not None:
            on_token(step.tokens)
    if isinstance(decoding.strategy, BeamSearch):
        return decoding.strategy.result(1)[0]
    prompt = decoding.prompt  # (B, L0)
    added = torch.stack(new_tokens, dim=1) if new_tokens else prompt[:, :0]  # (B, steps)
    return torch.cat([prompt, added], dim=1)


@dataclass(frozen=True)
class Prepared:
    """A decoding call's model side, checked: its step source, the prompt (B, L0) the new tokens
    follow, and the end token (None: rows end only at max_new_tokens)."""

    source: DecoderOnlySteps | EncoderDecoderSteps
    prompt: torch.Tensor
    eos_token_id: int | None

    def run(self, strategy, options: DecodeOptions) -> Iterator[DecodeStep]:
        """The decoding loop over this source with `strategy` (not yet started)."""
        return decode_loop(self.source, strategy, options.max_new_tokens, self.prompt.device)


@dataclass(frozen=True)
class Decoding:
    """A decoding call, checked and ready: its steps (the loop, not yet started), the strategy
    that chooses them, and the prompt (B, L0) the new tokens follow."""

    steps: Iterator[DecodeStep]
    strategy: TokenChoice | BeamSearch
    prompt: torch.Tensor


def start_decoding(
    model, input_ids, options: DecodeOptions, attention_mask, steps, prompt_cache=None
) -> Decoding:
    """The checked call of `decode_steps`: beam search when num_beams > 1, else greedy search or
    sampling; finished rows are filled with the end token."""
    prepared = prepare(model, input_ids, options, attention_mask, steps, prompt_cache)
    eos = prepared.eos_token_id
    fill = 0 if eos is None else eos
    if options.num_beams > 1:
        strategy = beam_strategy(prepared, options, fill)
    else:
        strategy = token_strategy(prepared, options, fill)
    return Decoding(prepared.run(strategy, options), strategy, prepared.prompt)


def prepare(
    model, input_ids, options: DecodeOptions, attention_mask, steps=None, prompt_cache=None
) -> Prepared:
    """The step source of a decoder-only or encoder-decoder model's call, its arguments checked."""
    if steps is not None and not callable(steps):
        raise TypeError(
            f"steps: expected None or a callable with the model's decode signature, got "
            f"{type(steps).__name__}"
        )
    if isinstance(model, Transformer):
        if steps is not None:
            raise ValueError(
                "steps: for decoder-only models; an encoder-decoder Transformer decodes through "
                "its own `decode`; expected steps=None"
            )
        if prompt_cache is not None:
            raise ValueError("prompt_cache: for decoder-only models; expected None for an "
                             "encoder-decoder Transformer")  # fmt: skip
        if options.kv_dtype is not None:
            raise ValueError(
                "kv_dtype: for decoder-only models; expected None for an "
                "encoder-decoder Transformer (its caches are the model's dtype)"
            )
        return Prepared(*encoder_decoder_source(model, input_ids, options, attention_mask))
    source = _decoder_only(model, input_ids, options, attention_mask, steps, prompt_cache)
    return Prepared(*source)


def beam_strategy(prepared: Prepared, options: DecodeOptions, fill_token_id: int) -> BeamSearch:
    return BeamSearch(
        prepared.prompt, num_beams=options.num_beams, length_penalty=options.length_penalty,
        early_stopping=options.early_stopping, eos_token_id=prepared.eos_token_id,
        fill_token_id=fill_token_id,
    )  # fmt: skip


def token_strategy(prepared: Prepared, options: DecodeOptions, fill_token_id: int) -> TokenChoice:
    device = prepared.prompt.device
    sampled = options.temperature > 0
    return TokenChoice(
        prepared.prompt.shape[0], device, sampling=options.sampling,
        generator=_generator(options.seed, device) if sampled else None,
        eos_token_id=prepared.eos_token_id, fill_token_id=fill_token_id,
    )  # fmt: skip


def _decoder_only(model, input_ids, options: DecodeOptions, attention_mask, steps, prompt_cache):
    """(DecoderOnlySteps, the prompt, eos_token_id) of a decoder-only model's call."""
    config = model.config
    B, L = _check_call(config, input_ids, options)
    sinks = options.sinks
    mask, padded = prompt_mask(attention_mask, B, L, input_ids.device)
    if sinks is not None and padded:
        raise ValueError(
            "attention_mask: padded prompts are not supported with sinks (a StreamingLLM cache "
            "holds only real tokens); expected an all-ones mask, or one prompt per call"
        )
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): real tokens count
    cached, on_feed = 0, None
    slots, kv_dtype = L + options.max_new_tokens, options.kv_dtype
    if prompt_cache is None:
        cache = make_cache(model, batch=B, max_length=slots, sinks=sinks, dtype=kv_dtype)
    else:
        _check_prompt_cache(prompt_cache, B, padded, options)
        cache, cached = prompt_cache.start(model, input_ids, slots, dtype=kv_dtype)
        on_feed = prompt_cache.fed
    if B * L > 1 and input_ids.device.type == "cpu" and _has_bf16_linears(model):
        capabilities.warn_if_bf16_is_emulated(
            "decoding a bf16 model's prompt",
            "inside qkv.acceleration.packed_linears(model) (as `qkv generate` does), bf16 "
            "products of several rows compute in fp32 at full speed",
        )
    step = model if steps is None else steps
    source = DecoderOnlySteps(model, step, input_ids, mask if padded else None, positions, cache,
                              cached=cached, on_feed=on_feed)  # fmt: skip
    return source, input_ids, options.eos_token_id


def _check_prompt_cache(prompt_cache, B: int, padded: bool, options: DecodeOptions) -> None:
    """What a `PromptCache` decodes: one unpadded sequence, by greedy search or sampling."""
    if not isinstance(prompt_cache, PromptCache):
        raise TypeError(f"prompt_cache: expected a qkv.generation.PromptCache or None, got "
                        f"{type(prompt_cache).__name__}")  # fmt: skip
    refused = (
        f"a batch of {B} prompts" if B != 1 else "a padded prompt" if padded
        else f"num_beams={options.num_beams}" if options.num_beams > 1
        else "sinks (a StreamingLLM cache)" if options.sinks is not None else None
    )  # fmt: skip
    if refused is not None:
        raise ValueError(f"prompt_cache: keeps one unpadded sequence's cache, decoded by greedy "
                         f"search or sampling; got {refused}")  # fmt: skip


def _has_bf16_linears(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16
               for m in model.modules())  # fmt: skip


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
    check_tokens(options, config.vocab_size, options.eos_token_id)
    B, L = input_ids.shape
    max_new_tokens = options.max_new_tokens
    context = config.context_length  # max_positions, or RoPE scaling's extended context
    if options.sinks is None and L + max_new_tokens > context:
        raise ValueError(
            f"input_ids: {L} prompt tokens + max_new_tokens={max_new_tokens} exceed the model's "
            f"context of {context}; expected fewer, or sinks=(num_sinks, window) for "
            f"StreamingLLM decoding"
        )
    if options.sinks is not None:
        _check_sinks(config, options.sinks)
    return B, L


def _check_sinks(config, sinks) -> None:
    if config.position in ("learned", "sinusoidal"):
        raise ValueError(
            f"sinks: StreamingLLM caches give keys their position within the cache, which "
            f"needs positions inside attention (rope, alibi, t5) or none; this model adds "
            f"{config.position!r} positions to its embeddings"
        )
    if sinks[0] + sinks[1] > config.max_positions:
        raise ValueError(
            f"sinks: num_sinks + window = {sinks[0] + sinks[1]} exceeds the model's context of "
            f"{config.max_positions}; expected a total <= {config.max_positions}"
        )
