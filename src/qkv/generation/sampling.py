"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Everything stays on the device: no `.item()` per token, so decoding does not wait on the host
between steps (on an accelerator; on the CPU there is no queue to wait on, and `LogitsCheck`
reads its verdict at every step). The filters (filters.py) set what they drop to -inf; sampling
draws from a `torch.Generator` so a seed reproduces the same tokens.
"""

from __future__ import annotations

import math

import torch

from qkv.generation.filters import filter_top_k, filter_top_p


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row, (B, V) logits -> (B,) int64.

    temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then top-p,
    then one draw from the softmax. The logits are shifted by their row's maximum before the
    division (softmax does not change): a temperature as small as 1e-45 then gives the largest
    logit 0 and the others -inf, a one-hot draw, where dividing first overflows to inf - inf.
    """
    if temperature == 0.0:
        return greedy(logits)
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        scaled = filter_top_k(scaled, top_k)
    if top_p is not None:
        scaled = filter_top_p(scaled, top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, its first if several tie; a NaN counts as the
    largest (`torch.argmax`). (B, V) -> (B,) int64."""
    return logits.argmax(dim=-1)


class LogitsCheck:
    """Non-finite logits (NaN weights, an fp16 overflow) fail decoding with the first step that
    had them: greedy decoding would otherwise emit token 0 forever. A row fails when its max is
    not finite: a NaN or +inf anywhere, or -inf for every token (-inf for some tokens is a
    model's way to rule them out). One reduction over the (B, V) logits per step, read where a
    host sync costs nothing extra: at once on the CPU (no queue of kernels to stall), else at
    the sync an eos_token_id makes already, else after the last step. Until read, a failing
    row is chosen from zeros, so that sampling never draws from NaN."""

    def __init__(self, device: torch.device, *, at_once: bool | None = None) -> None:
        self.at_once = device.type == "cpu" if at_once is None else at_once
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)  # step, or -1

    def choosable(self, logits, step: int):
        """The step's `Logits` to choose from, once checked or recorded (their `top`, each
        row's largest logit, where the step computed it; else reduced here)."""
        top = logits.logits.amax(dim=-1) if logits.top is None else logits.top  # (B,)
        if self.at_once:  # B numbers read on the host: cheaper than reducing them on the device
            self.maxima(top, step)
            return logits
        finite = torch.isfinite(top)
        bad = (self.first_bad < 0) & ~finite.all()
        self.first_bad = torch.where(bad, step, self.first_bad)
        masked = logits.logits.masked_fill(~finite.unsqueeze(-1), 0.0)
        return logits._replace(logits=masked, argmax=None)

    def maxima(self, top: torch.Tensor, step: int) -> None:
        """Check each row's largest logit (B,), read on the host at once."""
        bad = [row for row, value in enumerate(top.tolist()) if not math.isfinite(value)]
        if bad:
            raise _not_finite(step, bad)

    def all_done(self, finished: torch.Tensor) -> bool:
        """Whether every row has finished, read with the check in one host sync."""
        done, first_bad = torch.stack((finished.all().long(), self.first_bad)).tolist()
        if first_bad >= 0:
            raise _not_finite(first_bad, None)
        return bool(done)

    def finish(self) -> None:
        if not self.at_once and (first_bad := int(self.first_bad)) >= 0:
            raise _not_finite(first_bad, None)


def _not_finite(step: int, rows: list[int] | None) -> ValueError:
    where = "" if rows is None else f" in rows {rows}"
    return ValueError(
        f"model: its next-token logits at decoding step {step} (0 = the prompt's forward pass) "
        f"are not finite{where} (NaN, +inf, or -inf for every token); expected finite logits: "
        f"check the weights for NaN, and an fp16 model for overflow (bf16 or fp32 keep the range)"
    )
