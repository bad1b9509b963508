"""The one decoding loop: a model's step source and a strategy that chooses tokens.

Every way qkv decodes (greedy, sampling, beam search; decoder-only and encoder-decoder models)
is this loop over two small objects:

- a *step source* (qkv.generation.steps) owns the model and its caches: `first()` returns the
  next-token logits after the prompt, `next(choice)` feeds the chosen tokens and returns the
  logits after them;
- a *strategy* (qkv.generation.strategies) turns logits into a `Choice`: the token of every row,
  and, for beam search, which row each new row continues (its parent), so that the source can
  reorder its caches (Vaswani et al. 2017, section 6.1; Wu et al. 2016, section 7).

    logits = source.first()
    for step in range(max_new_tokens):
        choice = strategy.choose(logits)      # tokens (R',), parents (R',) or None
        yield DecodeStep(...)
        logits = source.next(choice)          # (R', V)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from qkv.generation.sampling import LogitsCheck

__all__ = ["Choice", "DecodeStep", "StepSource", "Strategy", "decode_loop"]


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


class StepSource(Protocol):
    """A model being decoded: the logits after the prompt, then after each choice."""

    cache: object

    def first(self) -> torch.Tensor: ...  # (R, V) fp32

    def next(self, choice: Choice) -> torch.Tensor: ...  # (R', V) fp32

    # Optional: `next_greedy(choice)` -> (logits (R, V), row maxima (R,), argmax (R,)) or None,
    # a step that chooses greedily too (see `decode_loop`).


class Strategy(Protocol):
    """How tokens are chosen from a step's logits. Optional: `greedy` (true where the choice is
    each row's argmax) with `chosen(tokens)`, the choice of tokens chosen elsewhere."""

    def choose(self, logits: torch.Tensor, step: int) -> Choice: ...


def decode_loop(
    source: StepSource, strategy: Strategy, max_new_tokens: int, device: torch.device
) -> Iterator[DecodeStep]:
    """Up to `max_new_tokens` steps; stops early once a choice says every row is finished.

    Raises ValueError naming `model` when the logits stop being finite (`LogitsCheck`).

    A greedy strategy (`greedy` true: its choice is each row's argmax) over a source whose step
    can choose too (`next_greedy`: compile="aot"'s library reduces its logits itself) takes
    that step's argmax and row maxima rather than reducing the logits here: the same tokens
    and checks, with less Python per step, which matters because a step's weights have evicted
    the interpreter's working set from the caches by then (as gpt-fast's decode_one_token
    chooses inside the compiled step).
    """
    check = LogitsCheck(device)
    fused = check.at_once and getattr(strategy, "greedy", False)
    next_greedy = getattr(source, "next_greedy", None) if fused else None
    choice = None
    for step in range(max_new_tokens):
        chosen = None if choice is None or next_greedy is None else next_greedy(choice)
        if chosen is not None:
            logits, top, tokens = chosen  # (R, V), (R,), (R,)
            check.maxima(top, step)
            choice = strategy.chosen(tokens)
        else:
            # no_grad per call, not around the loop: a grad mode set inside a generator would
            # leak into the caller's code between steps.
            with torch.no_grad():
                logits = source.first() if choice is None else source.next(choice)
                choice = strategy.choose(check.choosable(logits, step), step)
        done = choice.finished is not None and check.all_done(choice.finished)
        yield DecodeStep(choice.tokens, logits, source.cache, choice.parents)
        if done:
            return
    check.finish()
