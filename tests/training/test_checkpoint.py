"""Training checkpoints: exact round trip, atomic replacement, clear errors on bad files."""

import pytest
import torch

from qkv import models as qkv_models
from qkv.models import CheckpointError
from qkv.training import build_optimizer, build_scheduler, load_checkpoint, save_checkpoint
from qkv.training.tasks import TranslateTask

from .tiny import TINY


@pytest.fixture(scope="module")
def task():
    return TranslateTask(TINY)


def _objects(task, seed):
    torch.manual_seed(seed)
    model = task.build_model()
    optimizer = build_optimizer(model, learning_rate=1e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=10)
    return model, optimizer, scheduler


def _take_steps(task, model, optimizer, scheduler, steps):
    for step in range(steps):
        batch = task.collate(list(range(step * 8, step * 8 + 8)))
        task.loss_sums(model, batch)["tokens"].backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_round_trip_restores_model_optimizer_scheduler_and_rng_exactly(task, tmp_path):
    model, optimizer, scheduler = _objects(task, seed=0)
    _take_steps(task, model, optimizer, scheduler, 3)
    path = save_checkpoint(
        tmp_path / "ckpt.safetensors", model=model, optimizer=optimizer, scheduler=scheduler,
        step=3, extra={"note": "three steps"},
    )  # fmt: skip
    expected_draw = torch.rand(5)  # the RNG state was saved before this draw
    fresh, fresh_optimizer, fresh_scheduler = _objects(task, seed=1)
    state = load_checkpoint(path, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    assert (state.step, state.extra) == (3, {"note": "three steps"})
    torch.testing.assert_close(torch.rand(5), expected_draw, rtol=0, atol=0)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), fresh.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert fresh.lm_head.weight is fresh.source_embedding.weight  # the tie survives
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    # the next step is identical (Adam moments and step counts restored), same dropout draws
    rng = torch.get_rng_state()
    _take_steps(task, model, optimizer, scheduler, 1)
    torch.set_rng_state(rng)
    _take_steps(task, fresh, fresh_optimizer, fresh_scheduler, 1)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_crash_while_writing_leaves_the_previous_checkpoint_intact(task, tmp_path, monkeypatch):
    import safetensors.torch

    model, optimizer, scheduler = _objects(task, seed=0)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=1)
    before = path.read_bytes()

    def write_half_then_die(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as if killed mid-write

    monkeypatch.setattr(safetensors.torch, "save_file", write_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]  # no temporary left


def test_truncated_or_foreign_files_and_other_models_are_clear_errors(task, tmp_path):
    model, optimizer, scheduler = _objects(task, seed=0)
    path = save_checkpoint(
        tmp_path / "ckpt.safetensors", model=model, optimizer=optimizer, scheduler=scheduler, step=1
    )
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(truncated, model=model, optimizer=optimizer, scheduler=scheduler)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "none", model=model, optimizer=optimizer, scheduler=scheduler)
    other = torch.nn.Linear(3, 3)
    other_optimizer = build_optimizer(other, learning_rate=1e-3)
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(
            path, model=other, optimizer=other_optimizer,
            scheduler=build_scheduler(other_optimizer, warmup_steps=0, total_steps=1),
        )  # fmt: skip


def test_written_files_are_readable_as_the_umask_allows(task, tmp_path):
    """safetensors' save_file leaves 0600; qkv's checkpoints and saved models follow the umask
    like every other file (here 022: rw-r--r--), so another user can load a shared model."""
    import os
    import stat

    model, optimizer, scheduler = _objects(task, seed=0)
    old = os.umask(0o022)
    try:
        save_checkpoint(
            tmp_path / "ckpt.safetensors", model=model, optimizer=optimizer, scheduler=scheduler,
            step=0,
        )  # fmt: skip
        qkv_models.save(model, tmp_path / "qkv")
        llama = qkv_models.GPT(qkv_models.GPTConfig.from_name("tiny-llama"))
        llama.save_pretrained(tmp_path / "hf")
    finally:
        os.umask(old)
    written = [tmp_path / name / "model.safetensors" for name in ("qkv", "hf")]
    for path in (tmp_path / "ckpt.safetensors", *written):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
