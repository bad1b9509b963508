"""Decoding as an iterator: `stream` yields each step's tokens, `decode_steps` each step's
`DecodeStep`. The same decoding as `qkv.generate` (generate.py), started the same way; the
arguments are checked when called, before any decoding."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from qkv.generation.generate import start_decoding
from qkv.generation.loop import DecodeStep
from qkv.generation.options import DecodeOptions, decode_options
from qkv.generation.prompt_cache import PromptCache

__all__ = ["decode_steps", "stream"]


def stream(
    model: nn.Module,
    input_ids: torch.Tensor,
    options: DecodeOptions | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    steps: Callable | None = None,
    prompt_cache: PromptCache | None = None,
    **fields: object,
) -> Iterator[torch.Tensor]:
    """The same decoding as `generate`, yielding each step's tokens (B,) as they come
    (greedy search or sampling: beam search knows its tokens only at the end)."""
    options = decode_options(options, fields)
    if options.num_beams > 1:
        raise ValueError(
            f"num_beams: beam search knows its tokens only at the end; expected num_beams=1 to "
            f"stream, got {options.num_beams} (generate returns the best hypotheses)"
        )
    decoding = start_decoding(model, input_ids, options, attention_mask, steps, prompt_cache)
    return (step.tokens for step in decoding.steps)


def decode_steps(
    model: nn.Module,
    input_ids: torch.Tensor,
    options: DecodeOptions | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    steps: Callable | None = None,
    prompt_cache: PromptCache | None = None,
    **fields: object,
) -> Iterator[DecodeStep]:
    """The same decoding as `generate`, yielding a `DecodeStep` (tokens, logits, cache, and with
    beam search each beam's parent row) per step.

    Arguments are checked here, when called; the decoding runs as the iterator is consumed.
    """
    options = decode_options(options, fields)
    return start_decoding(model, input_ids, options, attention_mask, steps, prompt_cache).steps
