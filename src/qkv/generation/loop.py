"""The one decoding loop: a model's step source and a strategy that chooses tokens.

Every way qkv decodes (greedy, sampling, beam search; decoder-only and encoder-decoder models)
is this loop over two small objects:

- a *step source* (qkv.generation.steps) owns the model and its caches: `first()` returns the
  next-token logits after the prompt, `next(choice)` feeds the chosen tokens and returns the
  logits after them;
- a *strategy* (qkv.generation.strategies, beam_strategy) turns logits into a `Choice`: the
  token of every row, and, for beam search, which row each new row continues (its parent), so
  that the source can reorder its caches (Vaswani et al. 2017, section 6.1; Wu et al. 2016,
  section 7).

    logits = source.first()
    for step in range(max_new_tokens):
        choice = strategy.choose(logits)      # tokens (R',), parents (R',) or None
        yield DecodeStep(...)
        logits = source.next(choice)          # (R', V), with its argmax if the step has it
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from qkv.generation.sampling import LogitsCheck

__all__ = ["Choice", "DecodeStep", "Logits", "StepSource", "Strategy", "decode_loop"]


@dataclass(frozen=True)
class Choice:
    """What a strategy chose at one step.

    tokens (R',) int64: the new token of every row.
    parents (R',) int64 or None: the row (of the step's R rows) that each new row continues;
    None when row i continues row i (greedy, sampling).
    prompts (R',) int64 or None: the prompt each row belongs to, given only at a step where that
    changes (beam search's first step turns B prompts into B * num_beams rows): what was
    computed once per prompt (an encoder's memory) follows it.
    finished: a bool tensor whose rows are all True once decoding can stop, or None (never
    before max_new_tokens).
    """

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    prompts: torch.Tensor | None = None
    finished: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeStep:
    """One decoding step, as `qkv.generation.decode_steps` yields it.

    tokens (R,) int64: the token chosen for each row (rows already finished get the fill token).
    logits (R_prev, V) fp32: the model's next-token logits this step was chosen from, before
    temperature and filtering (what transformers' `generate(output_logits=True)` returns); one
    row per row of the previous step.
    cache: the KV cache decoding writes into, to inspect (its length, its memory); not to
    modify.
    parents (R,) int64 or None: with beam search, the row of `logits` each row continues; None
    for greedy decoding and sampling, where rows never move.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    cache: object
    parents: torch.Tensor | None = None


class Logits(NamedTuple):
    """A step's next-token logits (R, V) fp32, and each row's largest logit (R,) and its index
    (R,) int64 where the step already has them (a compiled step reduces its logits itself;
    None otherwise, and the loop reduces them)."""

    logits: torch.Tensor
    top: torch.Tensor | None = None
    argmax: torch.Tensor | None = None


class StepSource(Protocol):
    """A model being decoded: the logits after the prompt, then after each choice."""

    cache: object

    def first(self) -> Logits: ...  # (R, V)

    def next(self, choice: Choice) -> Logits: ...  # (R', V)


class Strategy(Protocol):
    """How tokens are chosen from a step's logits."""

    def choose(self, logits: Logits, step: int) -> Choice: ...


def decode_loop(
    source: StepSource, strategy: Strategy, max_new_tokens: int, device: torch.device
) -> Iterator[DecodeStep]:
    """Up to `max_new_tokens` steps; stops early once a choice says every row is finished.

    Raises ValueError naming `model` when the logits stop being finite (`LogitsCheck`).
    """
    check = LogitsCheck(device)
    choice = None
    for step in range(max_new_tokens):
        # no_grad per call, not around the loop: a grad mode set inside a generator would
        # leak into the caller's code between steps.
        with torch.no_grad():
            logits = source.first() if choice is None else source.next(choice)
            choice = strategy.choose(check.choosable(logits, step), step)
        done = choice.finished is not None and check.all_done(choice.finished)
        yield DecodeStep(choice.tokens, logits.logits, source.cache, choice.parents)
        if done:
            return
    check.finish()
