"""`TrainingConfig`: the knobs of one training run, checked when built."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from qkv.training.schedule import SCHEDULES
from qkv.validation import check_int, check_seed

__all__ = ["TrainingConfig"]


@dataclass(frozen=True)
class TrainingConfig:
    """steps: optimizer steps; batch_size: examples per step over all processes (the global
    batch), split into accumulation_steps micro-batches in each process.
    learning_rate: the peak, reached after warmup_steps (None: int(warmup_fraction * steps), at
    least 1), then `schedule` ("linear", "cosine", "constant") decays it to 0 at `steps`.
    weight_decay: AdamW's, not on norms and biases.
    clip_norm: the gradient's global L2 norm is clipped to it (None: no clipping).
    bf16: forward passes under CPU/GPU autocast to bfloat16 (weights and optimizer stay fp32).
    eval_every / checkpoint_every / log_every: in steps (0 = only at the end).
    seed: model initialisation, data order and dropout follow from it (a task's data split and
    masking follow its own data_seed).
    fsdp: with several processes, shard parameters, gradients and optimizer state over them
    (`qkv.training.sharded`) instead of replicating them (DDP); the same updates either way.
    speed_up: on the CPU, the stand-ins for PyTorch's blocks that pay on this CPU
    (`qkv.acceleration.speed_up`: oneDNN's float32 products on AMD CPUs with AVX-512, the fused
    cross-entropy backward, the rolled RoPE) are swapped into the model for the run; the same
    function, the gradients equal up to float rounding.
    """

    steps: int = 400
    batch_size: int = 128
    accumulation_steps: int = 1
    learning_rate: float = 1e-3
    warmup_steps: int | None = None
    warmup_fraction: float = 0.1
    schedule: str = "linear"
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip_norm: float | None = 1.0
    bf16: bool = False
    eval_every: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    seed: int = 0
    fsdp: bool = False
    speed_up: bool = True

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=1)
        if isinstance(self.warmup_fraction, bool) or not 0 <= self.warmup_fraction <= 1:
            raise ValueError(
                f"warmup_fraction: expected a number in [0, 1], got {self.warmup_fraction!r}"
            )
        if self.warmup_steps is None:  # frozen: set the derived default once, here
            derived = max(1, int(self.steps * self.warmup_fraction))
            object.__setattr__(self, "warmup_steps", derived)
        for name in ("steps", "batch_size", "accumulation_steps"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "log_every"):
            check_int(name, getattr(self, name), minimum=0)
        check_seed("seed", self.seed)
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"warmup_steps: {self.warmup_steps} is more than steps={self.steps}; expected "
                f"at most steps"
            )
        if self.batch_size < self.accumulation_steps:
            raise ValueError(
                f"batch_size: {self.batch_size} is smaller than accumulation_steps="
                f"{self.accumulation_steps}; expected at least one example per micro-batch"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(
                f"learning_rate: expected a finite number > 0, got {self.learning_rate!r}"
            )
        if self.clip_norm is not None and not 0 < self.clip_norm < math.inf:
            raise ValueError(
                f"clip_norm: expected None or a finite number > 0, got {self.clip_norm!r}"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(
                f"weight_decay: expected a finite number >= 0, got {self.weight_decay!r}"
            )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    def identity(self) -> dict:
        """The options a checkpoint must share with the run that resumes it: all but fsdp,
        which changes how processes share the work, not the updates (a run resumes on another
        number of processes, sharded or not)."""
        return {key: value for key, value in self.to_json().items() if key != "fsdp"}
