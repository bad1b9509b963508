"""Resuming a run from the checkpoint in its folder (`qkv.training.loop`, resume=True).

The checkpoint records the options that shape the run (the task's and the training's) and the
kernel choices that decide its bits (`qkv.capabilities.kernel_choices`). A resumed run must have
the same options (`resume_state`), and it computes with the same kernels (`recorded_kernels`,
for `capabilities.kernels_as`), so that it ends on the weights of a run never stopped, even on
another machine where these choices can be followed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qkv.training.checkpoint import CHECKPOINT_NAME, load_checkpoint

__all__ = ["recorded_kernels", "resume_state"]

logger = logging.getLogger(__name__)


def resume_state(
    out_dir: Path, resume: bool, model, optimizer, scheduler, run_info: dict
) -> tuple[int, dict]:
    """The step to start from and the last evaluation: out_dir's checkpoint loaded into model,
    optimizer and scheduler when resuming from one, else (0, {}). ValueError when the checkpoint
    was written with other options than `run_info` (the task's and the training's)."""
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


def recorded_kernels(out_dir: Path) -> dict | None:
    """The kernel choices (`capabilities.kernel_choices`) out_dir's checkpoint was computed
    with, for the resumed run to keep; None where there is none to read (a damaged file is
    reported by `load_checkpoint`, which checks it whole)."""
    from safetensors import safe_open

    try:
        with safe_open(str(out_dir / CHECKPOINT_NAME), framework="pt") as file:
            document = json.loads((file.metadata() or {}).get("qkv", "{}"))
        kernels = document["extra"]["kernels"]
    except Exception:  # noqa: BLE001 - any unreadable file: load_checkpoint says why
        return None
    return kernels if isinstance(kernels, dict) else None
