"""Learning-rate schedules: linear warm-up, then linear (or cosine) decay to zero.

BERT's pre-training warms the learning rate up over the first 10,000 steps, then decays it
linearly (Devlin et al. 2019, appendix A.2). Warm-up matters most for post-norm Transformers,
whose early gradients are large near the output (Xiong et al. 2020); the decay anneals the
noise of the last steps. The multiplier scales the optimizer's base learning rate:

    step < warmup:  (step + 1) / warmup        (never 0: the first step already learns)
    linear:         (total - step) / (total - warmup), clipped at 0
    cosine:         0.5 * (1 + cos(pi * progress)), progress = (step - warmup) / (total - warmup)

`step` counts optimizer steps taken before this one, as `LambdaLR` does. Hugging Face's
`get_linear_schedule_with_warmup` uses step / warmup during warm-up and so wastes step 0 with a
learning rate of 0; qkv shifts the warm-up by one step and is otherwise the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qkv.validation import check_int

__all__ = ["SCHEDULES", "build_scheduler", "lr_multiplier"]

SCHEDULES = ("linear", "cosine", "constant")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, kind: str = "linear") -> float:
    """The factor on the base learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, kind: str = "linear"
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` applying `lr_multiplier`; its state_dict holds only the step count."""
    if kind not in SCHEDULES:
        raise ValueError(f"kind: expected one of {SCHEDULES}, got {kind!r}")
    check_int("warmup_steps", warmup_steps, minimum=0)
    check_int("total_steps", total_steps, minimum=0)
    if warmup_steps > total_steps:
        raise ValueError(
            f"warmup_steps: {warmup_steps} is more than total_steps={total_steps}; expected at "
            f"most total_steps"
        )
    multiplier: Callable[[int], float] = lambda step: lr_multiplier(  # noqa: E731
        step, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
