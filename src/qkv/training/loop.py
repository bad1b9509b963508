"""The training loop: one function, `train(task, config, out_dir=...)`, for every task.

Each optimizer step takes a global batch of `config.batch_size` examples (the data order is a
pure function of seed and step, `DataOrder`), gives each process its share (`shard`), splits that
into `accumulation_steps` micro-batches, and backpropagates

    loss = sum over loss terms k of (summed loss_k in this micro-batch) / N_k

where N_k counts what term k averages over (target tokens, masked tokens, sentence pairs) in the
WHOLE global batch, over all micro-batches and processes. So the gradient is the same as one
big batch on one process would give, whatever the accumulation and the number of processes
(DDP, and FSDP's reduce-scatter with `fsdp`, average gradients over processes; the loss is
multiplied by world_size to undo that). With `fsdp` the model is sharded over the processes
(`qkv.training.sharded`): checkpoints hold the gathered full state, and evaluation and the
result use an unsharded replica.

After backward the step's loss and the gradient's global norm are checked finite, and the
weights before an evaluation or a checkpoint (`qkv.training.divergence`): NaN or inf stops the
run with `LossNotFiniteError` before the optimizer touches the weights. Every
`checkpoint_every` steps an atomic checkpoint (`qkv.training.checkpoint`), which `resume=True`
continues from: the checkpoint on disk is always the last good state. The resumed run computes
with the kernel choices the checkpoint records (`qkv.training.resume`), so that it ends on the
weights of a run never stopped.

One run per folder: `out_dir` is locked for the run (`qkv.training.runlock`; a second run is
refused with the holder's pid), and the temporaries of checkpoints that killed runs were
writing are deleted. With several processes, rank 0 alone locks and writes, and a failure there
(a full disk) stops every process (`fail_together`) instead of leaving them waiting. What the
caller writes into the folder once training is done (the saved model, a summary) goes in
`on_done`, which rank 0 runs before it unlocks the folder: written after, it could land in a
folder a second run has taken meanwhile, which deletes temporaries it finds there.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from qkv import capabilities
from qkv.acceleration.swaps import speed_up
from qkv.training import sharded
from qkv.training.checkpoint import CHECKPOINT_NAME, save_checkpoint
from qkv.training.config import TrainingConfig
from qkv.training.distributed import (
    Distributed,
    all_reduce_sum,
    fail_together,
    setup_distributed,
    shard,
)
from qkv.training.divergence import (
    GradientNotFiniteError,
    LossNotFiniteError,
    check_loss,
    check_weights,
    clip_and_check_gradient,
)
from qkv.training.memory_check import check_step_fits
from qkv.training.metrics import METRICS_NAME, RunLogger, Throughput
from qkv.training.optim import build_optimizer
from qkv.training.resume import recorded_kernels, resume_state
from qkv.training.runlock import RunLock, check_fresh_start, remove_temporaries
from qkv.training.schedule import build_scheduler

__all__ = [
    "DataOrder",
    "GradientNotFiniteError",
    "LossNotFiniteError",
    "METRICS_NAME",
    "Task",
    "TrainingResult",
    "train",
]

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

    # Optional: `share(indices, context) -> list[int]`, this process's examples of a global
    # batch (default `shard`: every world_size-th); the gpt task gives every process all of
    # them under context parallelism, and each collates its share of every sequence.


@dataclass(frozen=True)
class TrainingResult:
    model: nn.Module  # unwrapped (no DDP), unsharded, in eval mode
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
    overwrite: bool = False,
    on_log: Callable[[dict], None] | None = None,
    on_done: Callable[[TrainingResult], None] | None = None,
    device: str | torch.device = "cpu",
) -> TrainingResult:
    """Train `task.build_model()` for `config.steps` steps; see the module docstring.

    out_dir receives checkpoint.safetensors and metrics.jsonl (one JSON record a line: training
    logs every `log_every` steps, evaluations). on_log(record) sees the same records as they
    come (the CLI draws its progress bar from them). resume: continue from out_dir's checkpoint
    when there is one (the config must be the one it was written with). A folder an earlier run
    wrote to is refused without resume (RunFolderInUseError, a ValueError) unless `overwrite`.
    on_done(result) runs on rank 0 once training is done, while out_dir is still locked: what
    the caller writes into the run folder next to the checkpoint.

    Raises LossNotFiniteError (GradientNotFiniteError) when training diverges,
    RunFolderBusyError when another run holds out_dir, CheckpointError or MetricsFileError (both
    ValueErrors) for a damaged checkpoint or metrics file on resume, and an OSError naming the
    file when one cannot be written (a full disk).
    """
    out_dir = Path(out_dir)
    check_fresh_start(out_dir, resume=resume, overwrite=overwrite)
    context = setup_distributed(device)
    device = context.device(device)
    lock = _lock(out_dir, context, device)
    try:
        with capabilities.kernels_as(recorded_kernels(out_dir) if resume else None):
            result = _train(task, config, out_dir, resume, on_log, context, device)
        if on_done is not None and context.is_main:
            on_done(result)
        return result
    finally:
        if lock is not None:
            lock.release()


def _build(task: Task, config: TrainingConfig, device: torch.device) -> tuple:
    """Model, optimizer and schedule, from config.seed."""
    torch.manual_seed(config.seed)
    model = task.build_model().to(device)
    return (model, *_optimizer_for(model, config))


def _check_batch(
    task: Task, config: TrainingConfig, context: Distributed, device: torch.device | None = None
) -> None:
    """A global batch the task's examples can fill, of at least one example per process where
    the processes share it by example, and whose step fits in the memory of `device` (default:
    the CPU's; `qkv.training.memory_check`): refused before anything is allocated for it (a
    batch of 10^8 indices grew memory for minutes; fewer examples than processes left rank 1
    none; 10^5 blocks of a language model grew until the system killed the process)."""
    if config.batch_size > len(task):
        raise ValueError(
            f"batch_size: {config.batch_size} is more than the task's {len(task)} training "
            f"examples; expected at most {len(task)}"
        )
    if getattr(task, "share", None) is None and config.batch_size < context.world_size:
        raise ValueError(
            f"batch_size: {config.batch_size} is smaller than the {context.world_size} "
            f"processes; expected at least one example per process"
        )
    fsdp = config.fsdp and getattr(context, "enabled", False)
    check_step_fits(task, config, context, device=device or torch.device("cpu"), fsdp=fsdp)


def _optimizer_for(model: nn.Module, config: TrainingConfig) -> tuple:
    """AdamW and its schedule, for a model (sharded or not)."""
    optimizer = build_optimizer(
        model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
        betas=config.betas,
    )  # fmt: skip
    scheduler = build_scheduler(
        optimizer, warmup_steps=config.warmup_steps, total_steps=config.steps,
        kind=config.schedule,
    )  # fmt: skip
    return optimizer, scheduler


def _train(
    task: Task,
    config: TrainingConfig,
    out_dir: Path,
    resume: bool,
    on_log: Callable[[dict], None] | None,
    context: Distributed,
    device: torch.device,
) -> TrainingResult:
    _check_batch(task, config, context, device)
    if config.bf16 and device.type == "cpu":
        capabilities.warn_if_bf16_is_emulated("training with bf16 autocast (bf16=True)")
    model, optimizer, scheduler = _build(task, config, device)
    run_info = {"task": task.describe(), "training": config.identity()}
    start, metrics = resume_state(out_dir, resume, model, optimizer, scheduler, run_info)
    log = RunLogger(out_dir, context, on_log, keep_up_to=start)
    fsdp = config.fsdp and context.enabled
    if fsdp:  # after resuming: the checkpoint holds the full state
        build = functools.partial(_optimizer_for, config=config)
        model, optimizer, scheduler, replica = sharded.shard_training(
            model, optimizer, scheduler, build=build
        )
        wrapped = model
    else:
        wrapped, replica = context.wrap(model), model
    order = DataOrder(len(task), seed=config.seed)
    step_timer = Throughput()
    model.train()
    with _swaps(model, config, device):
        for step in range(start, config.steps):
            loss_terms, tokens = _train_step(task, wrapped, order, step, config, context)
            check_loss(loss_terms, step, out_dir)
            clip_and_check_gradient(model, config.clip_norm, step, out_dir)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            step_timer.add(tokens)
            records = []
            if _due(done, config.log_every, config.steps):
                records.append({"step": done, "kind": "train", **loss_terms,
                                "lr": scheduler.get_last_lr()[0], **step_timer.read()})  # fmt: skip
            evaluate = _due(done, config.eval_every, config.steps)
            checkpoint = _due(done, config.checkpoint_every, config.steps)
            if evaluate or checkpoint:  # first: decoding with inf weights would fail less clearly
                check_weights(model, done, out_dir, context)
            if evaluate:
                evaluated = sharded.refresh_replica(replica, model) if fsdp else replica
                metrics = _evaluate(task, evaluated, context)
                records.append({"step": done, "kind": "eval", **metrics})
            save = None
            if checkpoint:
                extra = {**run_info, "kernels": capabilities.kernel_choices(), "metrics": metrics}
                save = functools.partial(
                    save_checkpoint, out_dir / CHECKPOINT_NAME, model=model, optimizer=optimizer,
                    scheduler=scheduler, step=done, extra=extra,
                    **(sharded.gather_state(model, optimizer) if fsdp else {}),
                )  # fmt: skip
            _write_on_main(log, records, save, context, device)
    if fsdp:
        sharded.refresh_replica(replica, model)
    replica.eval()
    return TrainingResult(
        model=replica, step=config.steps, metrics=metrics, resumed_from=start or None
    )


def _swaps(model: nn.Module, config: TrainingConfig, device: torch.device):
    """The stand-ins for PyTorch's blocks that pay on this CPU (`qkv.acceleration.speed_up`),
    swapped into `model` for the steps where `config.speed_up`: the same function, faster. Inside
    `kernels_as`, so a resumed run takes the kernels its checkpoint recorded."""
    return speed_up(model) if config.speed_up and device.type == "cpu" else nullcontext()


def _lock(out_dir: Path, context: Distributed, device: torch.device) -> RunLock | None:
    """Rank 0 locks the run folder (the other ranks of the run write nothing there) and deletes
    the temporaries killed runs left; every rank stops if that fails."""
    lock, failure = None, None
    if context.is_main:
        try:
            lock = RunLock(out_dir)
            remove_temporaries(out_dir)
        except Exception as error:  # shared with the other ranks by fail_together
            failure = error
            if lock is not None:
                lock.release()
    fail_together(failure, context, device)
    return lock


def _write_on_main(log, records: list[dict], save, context: Distributed, device) -> None:
    """Rank 0 writes the step's records, then its checkpoint; a failure there (a full disk)
    stops every rank. Also the step's barrier."""
    failure = None
    if context.is_main:
        try:
            for record in records:
                log.write(record)
            if save is not None:
                save()
        except Exception as error:  # shared with the other ranks by fail_together
            failure = error
    fail_together(failure, context, device)


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
    everyone = order.batch(step, config.batch_size)
    share = getattr(task, "share", None)  # a task may share the batch otherwise (by sequence)
    mine = shard(everyone, context) if share is None else share(everyone, context)
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
        sync = nullcontext() if last or not context.enabled else sharded.gradient_sync_off(model)
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


def _due(done: int, every: int, total: int) -> bool:
    return done == total or (every > 0 and done % every == 0)


def _to(batch: Batch, device: torch.device) -> Batch:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def _device_type(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return "cpu" if parameter is None else parameter.device.type
