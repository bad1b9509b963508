"""`train(..., on_done=...)`: what a caller writes into the run folder once training is done is
written while the folder is still locked, so that no second run can take the folder (and delete
the temporaries it finds there) in between; the lock is released afterwards, even when on_done
fails."""

from __future__ import annotations

import os

import pytest
import torch

from qkv.training import TrainingConfig, train
from qkv.training.runlock import RunFolderBusyError, RunLock
from qkv.training.tasks import TranslateTask

from .tiny import TINY

CONFIG = TrainingConfig(steps=2, batch_size=4, warmup_steps=1)


@pytest.fixture(scope="module")
def task():
    torch.set_num_threads(1)
    return TranslateTask(TINY)


def test_on_done_sees_the_result_while_the_folder_is_locked(task, tmp_path):
    seen = []

    def on_done(result):
        with pytest.raises(RunFolderBusyError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path)  # a second run starting now is refused
        (tmp_path / "summary.json").write_text("{}")
        seen.append(result)

    result = train(task, CONFIG, out_dir=tmp_path, on_done=on_done)
    assert seen == [result] and result.step == CONFIG.steps
    with RunLock(tmp_path):  # released once train returns
        pass


def test_a_failing_on_done_propagates_and_the_folder_is_unlocked(task, tmp_path):
    def on_done(result):
        raise OSError(28, "No space left on device", str(tmp_path / "summary.json"))

    with pytest.raises(OSError, match="No space left on device"):
        train(task, CONFIG, out_dir=tmp_path, on_done=on_done)
    with RunLock(tmp_path):
        pass
