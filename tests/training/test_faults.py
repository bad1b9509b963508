"""Faults injected into training runs: nothing is lost, nothing is silent.

A poisoned gradient, a kill in the middle of writing a checkpoint, a full disk (a file-size
limit, RLIMIT_FSIZE, in a subprocess), a second run into the same folder, a torn metrics file:
each ends in a clear error or a logged repair, and the last good checkpoint stays byte for byte
what it was and resumes. The long SIGKILL-at-any-moment case is test_kill_and_ddp's; the
damaged-checkpoint catalogue is test_bad_checkpoints'."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qkv.cli import main
from qkv.training import LossNotFiniteError, TrainingConfig, train
from qkv.training.checkpoint import CHECKPOINT_NAME
from qkv.training.loop import GradientNotFiniteError
from qkv.training.metrics import METRICS_NAME, MetricsFileError
from qkv.training.runlock import LOCK_NAME, RunFolderBusyError
from qkv.training.tasks import TranslateTask

from .tiny import TINY, TINY_FLAGS

CONFIG = TrainingConfig(steps=4, batch_size=8, warmup_steps=1, checkpoint_every=2, log_every=1)
CLI_FLAGS = [*TINY_FLAGS, "--steps", "4", "--batch-size", "8", "--checkpoint-every", "2",
             "--log-every", "1"]  # fmt: skip
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}
ORPHAN = ".checkpoint.safetensors.0123456789abcdef0123456789abcdef.tmp"


@pytest.fixture(scope="module")
def task():
    torch.set_num_threads(1)
    return TranslateTask(TINY)


@pytest.fixture(scope="module")
def stopped_run(task, tmp_path_factory) -> Path:
    """A run of CONFIG stopped in step 3: its checkpoint holds step 2, metrics.jsonl steps 1-3."""

    def stop_in_step_three(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    folder = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.raises(KeyboardInterrupt):
        train(task, CONFIG, out_dir=folder, on_log=stop_in_step_three)
    return folder


@pytest.fixture
def run(stopped_run, tmp_path) -> Path:
    """A fresh copy of the stopped run for one test to damage."""
    return Path(shutil.copytree(stopped_run, tmp_path / "run"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _step(path: Path) -> int:
    with safe_open(str(path), framework="pt") as file:
        return json.loads(file.metadata()["qkv"])["step"]


def _records(folder: Path) -> list[tuple[int, str]]:
    lines = (folder / METRICS_NAME).read_text().splitlines()
    return [(record["step"], record["kind"]) for record in map(json.loads, lines)]


class _NanGradient(torch.autograd.Function):
    """Zero on the way forward, NaN on the way back: a finite loss with a poisoned gradient,
    as a bad op in a custom kernel or an overflow inside a backward pass gives."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.shape = weight.shape
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full(ctx.shape, float("nan"))


def _stop_at(step: int):
    def stop(record):
        if record["step"] == step:
            raise KeyboardInterrupt

    return stop


@pytest.mark.parametrize("clip_norm", [1.0, None], ids=["clipped", "not clipped"])
def test_a_nan_gradient_with_a_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    task, tmp_path, monkeypatch, clip_norm
):
    """Step 4 is the last, which always writes a checkpoint: the NaN must never reach it."""
    config = TrainingConfig(**{**CONFIG.to_json(), "betas": CONFIG.betas, "clip_norm": clip_norm})
    with pytest.raises(KeyboardInterrupt):
        train(task, config, out_dir=tmp_path, on_log=_stop_at(3))  # checkpoint at step 2
    good = _sha256(tmp_path / CHECKPOINT_NAME)
    real_loss_sums = TranslateTask.loss_sums
    calls = []

    def poisoned_in_step_four(self, model, batch):
        sums = real_loss_sums(self, model, batch)
        calls.append(None)
        if len(calls) == 2:  # the resumed run's second step: step 4
            sums["tokens"] = sums["tokens"] + _NanGradient.apply(next(model.parameters()))
        return sums

    monkeypatch.setattr(TranslateTask, "loss_sums", poisoned_in_step_four)
    with pytest.raises(GradientNotFiniteError, match="step 4: the gradient's norm is nan"):
        train(task, config, out_dir=tmp_path, resume=True)
    assert _sha256(tmp_path / CHECKPOINT_NAME) == good and _step(tmp_path / CHECKPOINT_NAME) == 2
    monkeypatch.setattr(TranslateTask, "loss_sums", real_loss_sums)
    resumed = train(task, config, out_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 2 and _step(tmp_path / CHECKPOINT_NAME) == 4
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_non_finite_weights_are_never_written_over_the_checkpoint(task, run, monkeypatch):
    """A finite gradient can still give inf weights (an optimizer overflow); the checkpoint
    refuses them too."""
    good = _sha256(run / CHECKPOINT_NAME)
    real_step = torch.optim.AdamW.step
    calls = []

    def overflowing_step(self, *args, **kwargs):
        loss = real_step(self, *args, **kwargs)
        calls.append(None)
        if len(calls) == 2:  # the resumed run's second update: step 4, the last
            with torch.no_grad():
                self.param_groups[0]["params"][0][0, 0] = float("inf")
        return loss

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    with pytest.raises(LossNotFiniteError, match="weights after step 4 are not finite"):
        train(task, CONFIG, out_dir=run, resume=True)
    assert _sha256(run / CHECKPOINT_NAME) == good


KILLED_WHILE_WRITING = """
import os, signal, sys
from qkv.training import checkpoint
real = checkpoint.save_safetensors
def die_in_the_second_write(tensors, path, metadata):
    if die_in_the_second_write.calls == 1:
        path.write_bytes(b"half a checkpoint" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)
    die_in_the_second_write.calls += 1
    real(tensors, path, metadata)
die_in_the_second_write.calls = 0
checkpoint.save_safetensors = die_in_the_second_write
from qkv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_while_writing_a_checkpoint_leaves_a_resumable_folder(tmp_path, capsys):
    """SIGKILL half-way through the step-4 checkpoint: the step-2 checkpoint, an orphaned
    temporary and the dead run's lock file are left; the resumed run removes the temporary,
    takes the lock (the kernel released it with the process) and finishes."""
    out = tmp_path / "run"
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_WRITING, "train", "translate", *CLI_FLAGS,
         "--out", str(out)], env=ENVIRONMENT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, stderr = killed.communicate(timeout=900)
    assert killed.returncode == -signal.SIGKILL, stderr[-2000:]
    assert len(list(out.glob(".checkpoint.safetensors.*.tmp"))) == 1
    assert _step(out / CHECKPOINT_NAME) == 2
    assert (out / LOCK_NAME).read_text().strip() == str(killed.pid)
    (out / "notes.tmp").write_text("not ours")
    assert main(["train", "translate", *CLI_FLAGS, "--out", str(out), "--resume"]) == 0
    assert "qkv train: error" not in capsys.readouterr().err
    assert not list(out.glob(".checkpoint.safetensors.*.tmp")) and (out / "notes.tmp").exists()
    assert _step(out / CHECKPOINT_NAME) == 4
    assert [step for step, kind in _records(out) if kind == "train"] == [1, 2, 3, 4]


def test_only_our_temporaries_are_removed_at_start(task, run):
    ours = [ORPHAN, ".metrics.jsonl.fedcba9876543210fedcba9876543210.tmp"]
    theirs = [".checkpoint.safetensors.notes.tmp", "checkpoint.tmp", ".other.0123.tmp"]
    model_ours = [".model.safetensors.00112233445566778899aabbccddeeff.tmp"]
    model_ours += [".config.json.00112233445566778899aabbccddeeff.tmp"]
    model_theirs = [".tokenizer.json.backup.tmp", "weights.tmp"]
    (run / "model").mkdir(exist_ok=True)
    for name in ours + theirs:
        (run / name).write_bytes(b"x" * 100)
    for name in model_ours + model_theirs:
        (run / "model" / name).write_bytes(b"x" * 100)
    train(task, CONFIG, out_dir=run, resume=True)
    assert sorted(p.name for p in run.iterdir() if p.name.endswith(".tmp")) == sorted(theirs)
    left = sorted(p.name for p in (run / "model").iterdir() if p.name.endswith(".tmp"))
    assert left == sorted(model_theirs)


HOLD_THE_LOCK = """
import sys, time
from qkv.training.runlock import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_second_run_into_a_locked_folder_is_refused_until_the_holder_dies(task, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(out)], env=ENVIRONMENT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderBusyError, match=f"pid {holder.pid}"):
            train(task, CONFIG, out_dir=out)
        assert main(["train", "translate", *CLI_FLAGS, "--out", str(out)]) == 1
        error = capsys.readouterr().err
        assert f"qkv train: error: {out}" in error and f"pid {holder.pid}" in error
        assert not (out / METRICS_NAME).exists() and not (out / CHECKPOINT_NAME).exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_NAME).read_text().strip() == str(holder.pid)  # a stale pid is left ...
    train(task, CONFIG, out_dir=out)  # ... and does not hold: the kernel released the lock
    assert _step(out / CHECKPOINT_NAME) == 4


TORN = {
    "a torn last line": '{"step": 4, "kind": "tr',
    "blank lines": "\n\n",
    "a tail of NUL bytes": "\0" * 40,
}


@pytest.mark.parametrize("tail", TORN.values(), ids=TORN.keys())
def test_a_torn_or_blank_metrics_tail_is_repaired_on_resume_with_a_warning(task, run, caplog, tail):
    with open(run / METRICS_NAME, "a") as file:
        file.write(tail)
    with caplog.at_level(logging.WARNING, logger="qkv.training"):
        train(task, CONFIG, out_dir=run, resume=True)
    assert any(str(run / METRICS_NAME) in message for message in caplog.messages)
    assert _records(run) == [(1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "eval")]


def test_a_corrupt_metrics_line_in_the_middle_is_an_error_naming_file_and_line(task, run, capsys):
    lines = (run / METRICS_NAME).read_text().splitlines()
    lines[1] = lines[1][:30]
    (run / METRICS_NAME).write_text("\n".join(lines) + "\n")
    good = _sha256(run / CHECKPOINT_NAME)
    with pytest.raises(MetricsFileError, match=rf"{run / METRICS_NAME}, line 2: "):
        train(task, CONFIG, out_dir=run, resume=True)
    assert _sha256(run / CHECKPOINT_NAME) == good


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
from qkv.training import loop
real = loop.save_checkpoint
def then_the_disk_fills(*args, **kwargs):
    path = real(*args, **kwargs)
    if sys.argv[1] == "checkpoint":  # room for the metrics, not for another checkpoint
        limit = path.stat().st_size // 2
    else:  # room for no more than a few bytes of metrics
        limit = (path.parent / "metrics.jsonl").stat().st_size + 10
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return path
loop.save_checkpoint = then_the_disk_fills
from qkv.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("filled_by", ["checkpoint", "metrics"])
def test_a_full_disk_is_a_clear_error_and_the_run_resumes_once_there_is_room(
    tmp_path, capsys, filled_by
):
    out = tmp_path / "run"
    full = subprocess.run(
        [sys.executable, "-c", FULL_DISK, filled_by, "train", "translate", *CLI_FLAGS,
         "--out", str(out)], env=ENVIRONMENT, capture_output=True, text=True,
    )  # fmt: skip
    assert full.returncode == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    written = CHECKPOINT_NAME if filled_by == "checkpoint" else METRICS_NAME
    assert f"qkv train: error: [Errno 27] {out / written}" in full.stderr
    assert _step(out / CHECKPOINT_NAME) == 2 and not list(out.glob(".*.tmp"))
    records = _records(out)  # every line whole: a failed append is cut back
    assert records[:2] == [(1, "train"), (2, "train")]
    assert main(["train", "translate", *CLI_FLAGS, "--out", str(out), "--resume"]) == 0
    assert _step(out / CHECKPOINT_NAME) == 4
    assert [step for step, kind in _records(out) if kind == "train"] == [1, 2, 3, 4]


CLI_ERRORS = [
    ("--threads 0", lambda out: ["--threads", "0"], r"threads: expected an int >= 1, got 0"),
    ("--device foo", lambda out: ["--device", "foo"], r"--device foo: expected cpu, cuda"),
    ("a flipped checkpoint", lambda out: [_flip(out / CHECKPOINT_NAME)],
     r"checkpoint.safetensors does not match its SHA-256"),
    ("a corrupt metrics line", lambda out: [_cut_line(out / METRICS_NAME, 0)],
     r"metrics.jsonl, line 1: "),
]  # fmt: skip


def _flip(path: Path) -> str:
    data = bytearray(path.read_bytes())
    data[-100:-36] = bytes(255 - b for b in data[-100:-36])
    path.write_bytes(bytes(data))
    return "--resume"


def _cut_line(path: Path, index: int) -> str:
    lines = path.read_text().splitlines()
    lines[index] = lines[index][:20]
    path.write_text("\n".join(lines) + "\n")
    return "--resume"


@pytest.mark.parametrize(
    "make_flags, message", [e[1:] for e in CLI_ERRORS], ids=[e[0] for e in CLI_ERRORS]
)
def test_bad_input_to_qkv_train_is_one_error_line(run, capsys, make_flags, message):
    """The stopped run was made with CONFIG, which CLI_FLAGS spell as flags."""
    status = main(["train", "translate", *CLI_FLAGS, "--out", str(run), *make_flags(run)])
    error = capsys.readouterr().err
    assert status == 1
    lines = [line for line in error.splitlines() if line.startswith("qkv train: error: ")]
    assert len(lines) == 1 and re.search(message, lines[0]), error
