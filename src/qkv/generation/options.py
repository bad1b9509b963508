"""The options of one decoding call: one dataclass that `generate`, `stream`, `decode_steps`
and `stream_text` share, checked when it is made.

    options = DecodeOptions(max_new_tokens=64, temperature=0.8, top_p=0.9, seed=0)
    tokens = qkv.generate(model, input_ids, options)
    tokens = qkv.generate(model, input_ids, max_new_tokens=64)      # the same fields by name

What depends on the model (top_k against its vocabulary, eos_token_id inside it, the prompt and
the new tokens within its context, sinks needing RoPE) is checked by the call, which knows it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from qkv.validation import check_int, check_seed

__all__ = ["KV_DTYPES", "DecodeOptions", "decode_options"]

KV_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class DecodeOptions:
    """max_new_tokens: tokens to add to each prompt (fewer if every row emits eos_token_id).
    temperature: 0 = greedy; > 0 samples from softmax(logits / temperature), after top_k (keep
    the k most likely) and top_p (keep the smallest set whose probability reaches p, Holtzman
    et al. 2020), from a generator seeded with `seed` (None: torch's global generator).
    eos_token_id: a row that emits it is finished, and padded with it afterwards.
    sinks: (num_sinks, window), a StreamingLLM cache (Xiao et al. 2024) that decodes past the
    model's context.
    num_beams > 1: beam search (qkv.generation.beam_strategy.BeamSearch), deterministic
    (temperature 0); its hypotheses are ranked by sum of
    log-probabilities / new tokens ** length_penalty, and a prompt stops searching once it has
    num_beams finished ones (early_stopping) or once none of its beams can beat them.
    kv_dtype: the KV cache's dtype (None: the model's); torch.float16 or torch.bfloat16 halves
    an fp32 model's cache, and its attention then runs in that dtype (as llama.cpp's default f16
    cache does): a decoding step reads half the bytes, which pays past a few hundred tokens for
    GQA/MQA models, whose groups of queries make several rows (`qkv.attention` casts one
    low-precision query row per head, as MHA has, to fp32)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | None = None
    seed: int | None = None
    sinks: tuple[int, int] | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = True
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_sampling(self.temperature, self.top_k, self.top_p)
        if self.eos_token_id is not None and not _is_int(self.eos_token_id):
            raise TypeError(f"eos_token_id: expected an int or None, got {self.eos_token_id!r}")
        if self.seed is not None:
            check_seed("seed", self.seed)
        if self.sinks is not None:
            _check_sinks(self.sinks)
            object.__setattr__(self, "sinks", tuple(self.sinks))
        _check_beams(self)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: expected one of {KV_DTYPES}, got {self.kv_dtype!r}")

    @property
    def sampling(self) -> dict:
        """The keyword arguments of `qkv.generation.sampling.next_token`."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def decode_options(options: DecodeOptions | None, fields: dict) -> DecodeOptions:
    """`options` with `fields` replaced, or DecodeOptions(**fields) when there is none."""
    if options is not None and not isinstance(options, DecodeOptions):
        raise TypeError(f"options: expected a DecodeOptions or None, got {type(options).__name__}")
    names = {field.name for field in dataclasses.fields(DecodeOptions)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"{', '.join(unknown)}: not a decoding option; expected {sorted(names)}")
    if options is None:
        if "max_new_tokens" not in fields:
            raise TypeError("max_new_tokens: missing; expected the number of tokens to add")
        return DecodeOptions(**fields)
    return dataclasses.replace(options, **fields)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sampling(temperature: object, top_k: object, top_p: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a number >= 0, got {temperature!r}")
    if not 0 <= temperature < float("inf"):  # also refuses NaN
        raise ValueError(
            f"temperature: expected a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_k is not None and not (_is_int(top_k) and top_k >= 1):
        raise ValueError(f"top_k: expected an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p: expected a probability in (0, 1] or None, got {top_p!r}")


def _check_sinks(sinks: object) -> None:
    if not (
        isinstance(sinks, (tuple, list))
        and len(sinks) == 2
        and all(_is_int(n) for n in sinks)
        and sinks[0] >= 0
        and sinks[1] >= 1
    ):
        raise ValueError(
            f"sinks: expected (num_sinks, window), ints with num_sinks >= 0 and window >= 1, "
            f"got {sinks!r}"
        )


def _check_beams(options: DecodeOptions) -> None:
    check_int("num_beams", options.num_beams, minimum=1)
    length_penalty, early_stopping = options.length_penalty, options.early_stopping
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise TypeError(f"length_penalty: expected a float, got {type(length_penalty).__name__}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty: expected a finite float, got {length_penalty}")
    if not isinstance(early_stopping, bool):
        raise TypeError(f"early_stopping: expected a bool, got {type(early_stopping).__name__}")
    if options.num_beams == 1:
        return
    if options.temperature > 0:
        raise ValueError(
            f"num_beams: beam search is deterministic; expected temperature=0 with "
            f"num_beams={options.num_beams}, got temperature={options.temperature}"
        )


def check_tokens(options: DecodeOptions, vocab_size: int, eos: int | None) -> None:
    """eos_token_id and top_k fit a vocabulary of `vocab_size` tokens."""
    if eos is not None and not 0 <= eos < vocab_size:
        raise ValueError(f"eos_token_id: {eos} is outside the vocabulary [0, {vocab_size})")
    if options.top_k is not None and options.top_k > vocab_size:
        raise ValueError(f"top_k: {options.top_k} exceeds the vocabulary size {vocab_size}")
