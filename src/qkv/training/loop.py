"""The training loop: one function, `train(task, config, out_dir=...)`, for every task.

Each optimizer step takes a global batch of `config.batch_size` examples (the data order is a
pure function of seed and step, `DataOrder`), gives each process its share (`shard`), splits that
into `accumulation_steps` micro-batches, and backpropagates

    loss = sum over loss terms k of (summed loss_k in this micro-batch) / N_k

where N_k counts what term k averages over (target tokens, masked tokens, sentence pairs) in the
WHOLE global batch, over all micro-batches and processes. So the gradient is the same as one
big batch on one process would give, whatever the accumulation and the number of processes
(DDP averages gradients over processes; the loss is multiplied by world_size to undo that).

After backward the step's loss is checked: NaN or inf stops the run with `LossNotFiniteError`
before the optimizer touches the weights, so the last checkpoint stays the last good state.
Then: gradient clipping, the AdamW step, the learning-rate schedule; every `checkpoint_every`
steps an atomic checkpoint (`qkv.training.checkpoint`), which `resume=True` continues from.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from qkv.training.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from qkv.training.config import TrainingConfig
from qkv.training.distributed import Distributed, all_reduce_sum, setup_distributed, shard
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler

__all__ = ["DataOrder", "Task", "LossNotFiniteError", "TrainingResult", "train"]

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
Batch = dict[str, torch.Tensor]


class Task(Protocol):
    """What `train` needs from a task (see `qkv.training.tasks` for translate, bert, gpt)."""

    name: str

    def __len__(self) -> int: ...  # training examples

    def build_model(self) -> nn.Module: ...

    def collate(self, indices: list[int], *, step: int) -> Batch: ...

    def counts(self, batch: Batch) -> dict[str, int]: ...  # what each loss term averages over

    def loss_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]: ...

    def num_tokens(self, batch: Batch) -> int: ...

    def evaluate(self, model: nn.Module) -> dict[str, float]: ...

    def describe(self) -> dict: ...  # JSON: the options that shape data and model


class LossNotFiniteError(RuntimeError):
    """The loss became NaN or inf; the weights of the failing step were not updated."""


@dataclass(frozen=True)
class TrainingResult:
    model: nn.Module  # unwrapped (no DDP), in eval mode
    step: int
    metrics: dict[str, float]  # the last evaluation
    resumed_from: int | None  # the checkpoint's step, if the run was resumed


class DataOrder:
    """Example indices for each step: epoch e visits a permutation seeded by (seed, e); a batch
    that crosses an epoch boundary takes the end of one and the start of the next."""

    def __init__(self, num_examples: int, *, seed: int) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples: expected at least 1, got {num_examples}")
        self.num_examples, self.seed = num_examples, seed
        self._epoch, self._permutation = -1, []

    def batch(self, step: int, batch_size: int) -> list[int]:
        start = step * batch_size
        return [self._at(position) for position in range(start, start + batch_size)]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_examples)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutation = torch.randperm(self.num_examples, generator=generator).tolist()
            self._epoch = epoch
        return self._permutation[offset]


def train(
    task: Task,
    config: TrainingConfig,
    *,
    out_dir: str | os.PathLike,
    resume: bool = False,
    on_log: Callable[[dict], None] | None = None,
    device: str | torch.device = "cpu",
) -> TrainingResult:
    """Train `task.build_model()` for `config.steps` steps; see the module docstring.

    out_dir receives checkpoint.safetensors and metrics.jsonl (one JSON record a line: training
    logs every `log_every` steps, evaluations). on_log(record) sees the same records as they
    come (the CLI draws its progress bar from them). resume: continue from out_dir's checkpoint
    when there is one (the config must be the one it was written with).
    """
    out_dir = Path(out_dir)
    context = setup_distributed(device)
    device = context.device(device)
    torch.manual_seed(config.seed)
    model = task.build_model().to(device)
    optimizer = build_optimizer(
        model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
        betas=config.betas,
    )  # fmt: skip
    scheduler = build_scheduler(
        optimizer, warmup_steps=config.warmup_steps, total_steps=config.steps,
        kind=config.schedule,
    )  # fmt: skip
    run_info = {"task": task.describe(), "training": config.to_json()}
    start, metrics = _maybe_resume(out_dir, resume, model, optimizer, scheduler, run_info)
    log = _Logger(out_dir, context, on_log, truncate_after=start)
    wrapped = context.wrap(model)
    order = DataOrder(len(task), seed=config.seed)
    step_timer = _Throughput()
    model.train()
    for step in range(start, config.steps):
        loss_terms, tokens = _train_step(task, wrapped, order, step, config, context)
        _check_finite(loss_terms, step, out_dir)
        if config.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        step_timer.add(tokens)
        if _due(done, config.log_every, config.steps):
            lr = scheduler.get_last_lr()[0]
            log.write({"step": done, "kind": "train", **loss_terms, "lr": lr, **step_timer.read()})
        if _due(done, config.eval_every, config.steps):
            metrics = _evaluate(task, model, context)
            log.write({"step": done, "kind": "eval", **metrics})
        if _due(done, config.checkpoint_every, config.steps) and context.is_main:
            extra = {**run_info, "metrics": metrics}
            save_checkpoint(
                out_dir / CHECKPOINT_NAME, model=model, optimizer=optimizer,
                scheduler=scheduler, step=done, extra=extra,
            )  # fmt: skip
        context.barrier()
    model.eval()
    return TrainingResult(
        model=model, step=config.steps, metrics=metrics, resumed_from=start or None
    )


def _train_step(
    task: Task,
    model: nn.Module,
    order: DataOrder,
    step: int,
    config: TrainingConfig,
    context: Distributed,
) -> tuple[dict[str, float], int]:
    """Forward and backward over this process's micro-batches; returns the step's loss terms
    (means over the global batch, summed into "loss") and the tokens this process saw."""
    mine = shard(order.batch(step, config.batch_size), context)
    chunks = [mine[i :: config.accumulation_steps] for i in range(config.accumulation_steps)]
    device = next(model.parameters()).device
    batches = [_to(task.collate(sorted(chunk), step=step), device) for chunk in chunks if chunk]
    names = sorted(task.counts(batches[0]))
    local_counts = torch.tensor([sum(task.counts(b)[n] for b in batches) for n in names])
    global_counts = all_reduce_sum(local_counts.double(), context).clamp(min=1)  # N_k
    summed = torch.zeros(len(names), dtype=torch.float64)
    autocast = torch.autocast(device_type=_device_type(model), dtype=torch.bfloat16)
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        sync = nullcontext() if last or not context.enabled else model.no_sync()
        with sync:
            with autocast if config.bf16 else nullcontext():
                sums = task.loss_sums(model, batch)
            terms = torch.stack(
                [sums[n].float() / global_counts[i].float() for i, n in enumerate(names)]
            )
            (terms.sum() * context.world_size).backward()
        summed += torch.stack([sums[n].detach().double() for n in names])
    means = (all_reduce_sum(summed, context) / global_counts).tolist()
    loss_terms = {f"loss_{n}": value for n, value in zip(names, means, strict=True)}
    loss_terms = {"loss": sum(means), **(loss_terms if len(names) > 1 else {})}
    return loss_terms, sum(task.num_tokens(b) for b in batches)


def _check_finite(loss_terms: dict[str, float], step: int, out_dir: Path) -> None:
    if not all(math.isfinite(value) for value in loss_terms.values()):
        raise LossNotFiniteError(
            f"step {step + 1}: the loss is {loss_terms['loss']} (not finite); the run stopped "
            f"before updating the weights, and {out_dir / CHECKPOINT_NAME} (if any) is the last "
            f"good state. Lower the learning rate, raise warmup_steps or set clip_norm."
        )


def _evaluate(task: Task, model: nn.Module, context: Distributed) -> dict[str, float]:
    """The task's evaluation on the main process (the others wait), model back to train mode."""
    metrics: dict[str, float] = {}
    if context.is_main:
        model.eval()
        with torch.no_grad():
            metrics = task.evaluate(model)
        model.train()
    context.barrier()
    return metrics


def _maybe_resume(out_dir, resume, model, optimizer, scheduler, run_info) -> tuple[int, dict]:
    path = out_dir / CHECKPOINT_NAME
    if not resume:
        return 0, {}
    if not path.is_file():
        logger.info("resume: no checkpoint in %s, starting from step 0", out_dir)
        return 0, {}
    state = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    saved = {key: state.extra.get(key) for key in run_info}
    if saved != json.loads(json.dumps(run_info)):
        raise ValueError(
            f"resume: {path} was written by a run with other options: {saved}; this run has "
            f"{run_info}. Use another --out folder, or the same options."
        )
    logger.info("resumed from %s at step %d", path, state.step)
    return state.step, state.extra.get("metrics", {})


def _due(done: int, every: int, total: int) -> bool:
    return done == total or (every > 0 and done % every == 0)


def _to(batch: Batch, device: torch.device) -> Batch:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def _device_type(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return "cpu" if parameter is None else parameter.device.type


class _Throughput:
    """Tokens per second since the last read."""

    def __init__(self) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> dict[str, float]:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.tokens, self.start = 0, now
        return {"tokens_per_s": rate}


class _Logger:
    """Records to metrics.jsonl (main process), to TensorBoard where it is installed, and to
    on_log. On resume, records after the checkpoint's step are dropped from the file: the
    resumed run writes them again."""

    def __init__(self, out_dir: Path, context: Distributed, on_log, *, truncate_after: int):
        self.path, self.context, self.on_log = out_dir / METRICS_NAME, context, on_log
        self.board = None
        if context.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            kept = []
            if truncate_after and self.path.is_file():
                lines = self.path.read_text().splitlines()
                kept = [line for line in lines if json.loads(line)["step"] <= truncate_after]
            self.path.write_text("".join(line + "\n" for line in kept))
            self.board = _tensorboard(out_dir / "tensorboard")

    def write(self, record: dict) -> None:
        if not self.context.is_main:
            return
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")
        if self.board is not None:
            for name, value in record.items():
                if name not in ("step", "kind"):
                    self.board.add_scalar(f"{record['kind']}/{name}", value, record["step"])
            self.board.flush()
        if self.on_log is not None:
            self.on_log(record)


def _tensorboard(folder: Path):
    """A SummaryWriter when the tensorboard package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(folder))
