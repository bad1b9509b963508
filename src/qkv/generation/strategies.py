"""Decoding strategies: how each step's logits become tokens (qkv.generation.loop).

`TokenChoice`: one token per row, rows never move: greedy (argmax) or sampling (temperature,
top-k, top-p; qkv.generation.sampling). Beam search is the other strategy
(qkv.generation.beam_strategy).
"""

from __future__ import annotations

import torch

from qkv.generation.loop import Choice, Logits
from qkv.generation.sampling import next_token

__all__ = ["TokenChoice"]


class TokenChoice:
    """Greedy decoding (temperature 0) or sampling, one token per row.

    A row that emits `eos_token_id` is finished: its later tokens are `fill_token_id`, and
    decoding stops once every row has finished. sampling: `next_token`'s keyword arguments.
    """

    def __init__(
        self, rows: int, device, *, sampling: dict, generator, eos_token_id, fill_token_id
    ) -> None:
        self.sampling, self.generator = sampling, generator
        self.eos_token_id, self.fill_token_id = eos_token_id, fill_token_id
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.greedy = sampling.get("temperature", 0.0) == 0.0  # each row's argmax

    def choose(self, logits: Logits, step: int) -> Choice:
        """The tokens (B,) drawn from a step's logits (greedy: their argmax, the step's own
        where it has one); finished rows get the fill token."""
        if self.greedy and logits.argmax is not None:
            chosen = logits.argmax
        else:
            chosen = next_token(logits.logits, **self.sampling, generator=self.generator)
        if self.eos_token_id is None:
            return Choice(chosen)
        chosen = torch.where(self.finished, self.fill_token_id, chosen)
        self.finished = self.finished | (chosen == self.eos_token_id)
        return Choice(chosen, finished=self.finished)
