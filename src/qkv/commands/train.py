"""`qkv train translate|bert|gpt|vit|diffusion`: train a preset on its embedded data, resumably.

The flags are generated from two frozen dataclasses: `TrainingConfig` (steps, batch size, learning
rate, ...) shared by every task, and the task's own options (`TranslateOptions`, ...), so a knob
added to either appears here with its default. `torchrun --nproc-per-node N -m qkv.cli train ...`
runs the same command on N processes (DDP).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing
from pathlib import Path

from qkv.commands import _progress, _train_report
from qkv.commands._device import check_device

_HELP = {
    "steps": "optimizer steps",
    "batch_size": "examples per step, over all processes",
    "accumulation_steps": "micro-batches per step (same gradient, less memory)",
    "learning_rate": "peak learning rate (AdamW)",
    "warmup_steps": "linear warm-up steps (None: --warmup-fraction of --steps)",
    "warmup_fraction": "warm-up as a share of the steps, when --warmup-steps is not given",
    "schedule": "decay after warm-up: linear, cosine or constant",
    "clip_norm": "clip the gradient's global norm to this",
    "bf16": "bfloat16 autocast for the forward pass",
    "eval_every": "evaluate every N steps (0: at the end only)",
    "checkpoint_every": "write checkpoint.safetensors every N steps",
    "fsdp": "with torchrun: shard parameters, gradients and optimizer state over the processes "
    "(PyTorch's fully_shard) instead of replicating them (DDP)",
    "speed_up": "swap in the CPU stand-ins for PyTorch's blocks that pay on this CPU "
    "(qkv.acceleration.speed_up_choices says which)",
    "data": "your own data file instead of the embedded one",
    "embed_dim": "model width E",
    "num_heads": "attention heads per layer",
    "ffn_dim": "feed-forward hidden width",
    "data_seed": "seed of the data split",
}  # a task's own words for its options: its options class's FLAG_HELP


def _tasks() -> dict[str, tuple[type, type]]:
    """Task name -> (task class, options dataclass), imported on demand."""
    from qkv.training.tasks import TASKS

    return TASKS


def _run(args: argparse.Namespace) -> int:
    import torch
    from safetensors import SafetensorError

    from qkv.training import LossNotFiniteError, TrainingConfig, train
    from qkv.training.distributed import OtherProcessFailedError
    from qkv.training.runlock import check_fresh_start
    from qkv.validation import check_int

    task_class, options_class = _tasks()[args.task]
    try:
        check_int("threads", args.threads, minimum=1)
        torch.set_num_threads(args.threads)
        check_device(args.device)  # before the data: preparing it can take a minute
        check_fresh_start(args.out, resume=args.resume, overwrite=args.overwrite)
        config = TrainingConfig(**_fields(args, TrainingConfig))
        options = options_class(**_fields(args, options_class))
        print(f"qkv train {args.task}: preparing data ...", file=sys.stderr, flush=True)
        _prepare_and_train(task_class, options, config, args, train)
    except LossNotFiniteError as error:
        print(f"qkv train: stopped: {error}", file=sys.stderr)
        return 3
    except (ValueError, TypeError, OSError, ImportError, SafetensorError) as error:
        print(f"qkv train: error: {error}", file=sys.stderr)
        return 1
    except OtherProcessFailedError as error:  # with torchrun: rank 0 printed the reason
        print(f"qkv train: error: {error}", file=sys.stderr)
        return 1
    return 0


def _prepare_and_train(task_class: type, options, config, args: argparse.Namespace, train):
    """The task (its data) and the training, with their progress on stderr: the tasks and the
    loop log their stages (data, tokenizer, resume), shown as lines, then the bar of the steps.
    Rank 0 writes the report while the run folder is still locked (`train`'s on_done): written
    after, a second run could take the folder and clear its temporaries meanwhile."""
    started = time.perf_counter()
    with _progress.log_lines("qkv", prefix="  "):
        task = task_class(options)
        bar = _TrainProgress(config.steps, config.log_every)

        def report(result) -> None:
            bar.close()  # the bar's last line comes before the report
            if os.environ.get("RANK", "0") != "0":  # torchrun's other ranks: rank 0 reports
                return
            seconds = time.perf_counter() - started
            _train_report.report(task, result, Path(args.out), seconds=seconds)

        try:
            train(
                task, config, out_dir=args.out, resume=args.resume, overwrite=args.overwrite,
                on_log=bar.update, device=args.device, on_done=report,
            )  # fmt: skip
        finally:  # the bar's last line comes before any error message
            bar.close()


def _fields(args: argparse.Namespace, cls: type) -> dict:
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(cls)}


class _TrainProgress:
    """The bar of the steps, drawn from the training records (`train`'s on_log); evaluations
    are lines of their own."""

    def __init__(self, total: int, log_every: int) -> None:
        self.total, self.log_every = total, log_every
        self.bar: _progress.Progress | None = None
        self.started = time.perf_counter()

    def update(self, record: dict) -> None:
        step = record["step"]
        if record["kind"] == "eval":
            shown = "  ".join(
                f"{k} {v:.4g}" for k, v in record.items() if k not in ("step", "kind")
            )
            _progress.say(f"  eval at step {step}: {shown}")
            return
        if self.bar is None:  # a resumed run's first record comes log_every steps after its start
            initial = max(0, step - self.log_every) if self.log_every > 0 else 0
            self.bar = _progress.progress(
                self.total, desc="training", unit="step", initial=initial,
                elapsed=time.perf_counter() - self.started,
            )  # fmt: skip
        self.bar.set_postfix_str(
            f"loss {record['loss']:.4f}, lr {record['lr']:.2e}, "
            f"{record['tokens_per_s']:,.0f} tok/s",
            refresh=False,
        )
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def add_parser(commands: argparse._SubParsersAction) -> None:
    from qkv.training import TrainingConfig

    train = commands.add_parser(
        "train",
        help="train a preset (translate, bert, gpt, vit, diffusion) on embedded data, resumable",
    )
    tasks = train.add_subparsers(dest="task", metavar="task")
    train.set_defaults(run=lambda args: _print_help(train))  # `qkv train` alone
    for name, (task_class, options_class) in _tasks().items():
        parser = tasks.add_parser(name, help=(options_class.__doc__ or "").splitlines()[0])
        parser.add_argument(
            "--out", default=f"runs/{name}", help="run folder (default %(default)s)"
        )
        parser.add_argument("--resume", action="store_true", help="go on from --out's checkpoint")
        parser.add_argument(
            "--overwrite", action="store_true",
            help="start again from step 0 in an --out an earlier run wrote to, replacing it",
        )  # fmt: skip
        parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
        parser.add_argument(
            "--device", default="cpu", help="cpu, cuda, cuda:N or mps (default %(default)s)"
        )
        defaults = getattr(task_class, "training_defaults", {})
        _add_dataclass_flags(parser.add_argument_group("training"), TrainingConfig, defaults)
        _add_dataclass_flags(parser.add_argument_group(f"{name} task"), options_class)
        parser.set_defaults(run=_run)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def _add_dataclass_flags(
    group: argparse._ArgumentGroup, cls: type, defaults: dict | None = None
) -> None:
    """--field-name for every field of a dataclass, typed from its annotation and its default
    (or the task's own, from `defaults`)."""
    from qkv.training.schedule import SCHEDULES

    hints = typing.get_type_hints(cls)
    words = {**_HELP, **getattr(cls, "FLAG_HELP", {})}
    for field in dataclasses.fields(cls):
        flag, kind = "--" + field.name.replace("_", "-"), hints[field.name]
        default = (defaults or {}).get(field.name, field.default)
        text = f"{words.get(field.name, field.name.replace('_', ' '))} (default %(default)s)"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=text)  # fmt: skip
        elif typing.get_origin(kind) is tuple:
            group.add_argument(flag, type=float, nargs=2, default=default, help=text)
        elif field.name == "schedule":
            group.add_argument(flag, choices=SCHEDULES, default=default, help=text)
        else:
            group.add_argument(flag, type=_scalar(kind), default=default, help=text)


def _scalar(kind: object) -> type:
    """int, float or str, unwrapping `X | None`."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return kind  # type: ignore[return-value]
