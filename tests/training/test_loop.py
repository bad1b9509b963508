"""The loop: it learns, accumulation and resume change nothing, a NaN loss stops it cleanly."""

import json
import math
from collections import Counter

import pytest
import torch

from qkv import capabilities
from qkv.acceleration import FastRotaryEmbedding, OneDNNLinear, fused_loss, speed_up_choices
from qkv.training import LossNotFiniteError, TrainingConfig, train
from qkv.training.checkpoint import CHECKPOINT_NAME
from qkv.training.runlock import RunFolderInUseError
from qkv.training.tasks import GPTOptions, GPTTask, TranslateTask

from .tiny import TINY


@pytest.fixture(scope="module")
def task():
    torch.set_num_threads(1)
    return TranslateTask(TINY)


def _weights(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_a_small_model_overfits_one_batch(tmp_path):
    import dataclasses

    task = TranslateTask(dataclasses.replace(TINY, num_train=16, dropout=0.0, label_smoothing=0.0))
    config = TrainingConfig(
        steps=150, batch_size=16, learning_rate=3e-3, warmup_steps=10, log_every=150,
        checkpoint_every=0,
    )  # fmt: skip
    result = train(task, config, out_dir=tmp_path)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] < 0.05  # memorised: cross-entropy near 0
    batch = task.collate(list(range(16)))
    logits = result.model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
    predicted = logits.logits.argmax(-1)
    labelled = batch["labels"] != -100
    assert torch.equal(predicted[labelled], batch["labels"][labelled])


def test_gradient_accumulation_gives_the_same_weights(task, tmp_path):
    import dataclasses

    no_dropout = TranslateTask(dataclasses.replace(TINY, dropout=0.0))
    base = dict(steps=4, batch_size=16, warmup_steps=1, checkpoint_every=0)
    one = train(no_dropout, TrainingConfig(**base), out_dir=tmp_path / "one")
    four = train(
        no_dropout, TrainingConfig(**base, accumulation_steps=4), out_dir=tmp_path / "four"
    )
    for (name, a), b in zip(
        _weights(one.model).items(), _weights(four.model).values(), strict=True
    ):
        if name.endswith("k_proj.bias"):
            # softmax is blind to a key bias: its true gradient is 0, and Adam turns the
            # rounding noise left in it into a step of lr in a random direction
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_resuming_from_a_checkpoint_reaches_the_same_weights_bitwise(task, tmp_path):
    config = TrainingConfig(steps=6, batch_size=8, warmup_steps=2, checkpoint_every=2, log_every=1)
    straight = train(task, config, out_dir=tmp_path / "straight")

    # crash in step 4, after its update but before its checkpoint: resume redoes steps 3 and 4
    def stop_at_four(record):
        if record["step"] == 4 and record["kind"] == "train":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(task, config, out_dir=tmp_path / "resumed", on_log=stop_at_four)
    torch.manual_seed(1234)  # the resumed run must not depend on the RNG state it starts with
    resumed = train(task, config, out_dir=tmp_path / "resumed", resume=True)
    assert resumed.resumed_from == 2
    for (name, a), b in zip(
        _weights(straight.model).items(), _weights(resumed.model).values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    records = [
        (json.loads(line)["step"], json.loads(line)["kind"])
        for line in (tmp_path / "resumed/metrics.jsonl").open()
    ]
    assert len(records) == len(set(records))  # steps 3-4 were not logged twice


def test_a_resumed_run_computes_with_the_kernels_its_checkpoint_records(task, tmp_path):
    """A run made with the other float32 linear kernel than this machine chooses (oneDNN's or
    F.linear's: they round differently) records it; resumed here with nothing pinned, it keeps
    that kernel and ends on the straight run's weights, bit for bit."""
    if not capabilities.onednn_linear(torch.float32):
        pytest.skip("one float32 linear kernel only: oneDNN is missing here")
    other = {"onednn_fp32_linears": not capabilities.kernel_choices()["onednn_fp32_linears"]}
    config = TrainingConfig(steps=4, batch_size=8, warmup_steps=1, checkpoint_every=2, log_every=1)
    with capabilities.kernels_as(other):
        straight = train(task, config, out_dir=tmp_path / "straight")

        def stop_at_three(record):
            if record["step"] == 3:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            train(task, config, out_dir=tmp_path / "resumed", on_log=stop_at_three)
    seen = []

    def kernels_in_use(record):
        seen.append(capabilities.kernel_choices()["onednn_fp32_linears"])

    resumed = train(task, config, out_dir=tmp_path / "resumed", resume=True, on_log=kernels_in_use)
    assert resumed.resumed_from == 2 and seen and set(seen) == set(other.values())
    for (name, a), b in zip(
        _weights(straight.model).items(), _weights(resumed.model).values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert capabilities.kernel_choices()["onednn_fp32_linears"] is not other["onednn_fp32_linears"]


def test_a_fresh_start_in_a_used_folder_is_refused_unless_overwrite(task, tmp_path):
    config = TrainingConfig(steps=2, batch_size=4, warmup_steps=1)
    train(task, config, out_dir=tmp_path)
    before = (tmp_path / CHECKPOINT_NAME).read_bytes()
    with pytest.raises(RunFolderInUseError, match=r"^out_dir: .* holds an earlier run"):
        train(task, config, out_dir=tmp_path)
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == before
    assert train(task, config, out_dir=tmp_path, overwrite=True).resumed_from is None


def test_a_batch_the_task_cannot_fill_is_refused_before_anything_is_built(task, tmp_path):
    from types import SimpleNamespace

    from qkv.training.loop import _check_batch

    huge = TrainingConfig(steps=1, batch_size=10**8, warmup_steps=0)
    with pytest.raises(ValueError, match=r"^batch_size: 100000000 is more than the task's 400"):
        train(task, huge, out_dir=tmp_path)
    assert not (tmp_path / CHECKPOINT_NAME).exists()
    four_processes = SimpleNamespace(world_size=4)
    with pytest.raises(ValueError, match=r"^batch_size: 2 is smaller than the 4 processes"):
        _check_batch(task, TrainingConfig(steps=1, batch_size=2), four_processes)
    _check_batch(task, TrainingConfig(steps=1, batch_size=4), four_processes)


def test_resume_with_other_options_is_refused(task, tmp_path):
    train(task, TrainingConfig(steps=2, batch_size=4, warmup_steps=1), out_dir=tmp_path)
    with pytest.raises(ValueError, match="resume"):
        train(
            task, TrainingConfig(steps=2, batch_size=4, warmup_steps=1, learning_rate=0.1),
            out_dir=tmp_path, resume=True,
        )  # fmt: skip


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(task, tmp_path, monkeypatch):
    config = TrainingConfig(steps=8, batch_size=8, warmup_steps=1, checkpoint_every=2)
    real_loss_sums = TranslateTask.loss_sums
    calls = {"n": 0}

    def nan_at_step_four(self, model, batch):
        calls["n"] += 1
        sums = real_loss_sums(self, model, batch)
        return {k: v * float("nan") for k, v in sums.items()} if calls["n"] == 4 else sums

    monkeypatch.setattr(TranslateTask, "loss_sums", nan_at_step_four)
    with pytest.raises(LossNotFiniteError, match="step 4: the loss is nan"):
        train(task, config, out_dir=tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / CHECKPOINT_NAME), framework="pt") as file:
        assert json.loads(file.metadata()["qkv"])["step"] == 2  # step 3's state was never saved


def test_metrics_go_to_tensorboard_when_it_is_installed(task, tmp_path, monkeypatch):
    import sys
    import types

    written = []

    class FakeWriter:  # stands in for torch.utils.tensorboard.SummaryWriter
        def __init__(self, folder):
            written.append(("folder", folder))

        def add_scalar(self, tag, value, step):
            written.append((tag, step))

        def flush(self):
            pass

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    train(task, TrainingConfig(steps=2, batch_size=4, log_every=1, eval_every=2), out_dir=tmp_path)
    assert written[0] == ("folder", str(tmp_path / "tensorboard"))
    assert ("train/loss", 1) in written and ("train/loss", 2) in written
    assert ("eval/valid_exact_match", 2) in written


def test_bf16_autocast_trains(task, tmp_path):
    config = TrainingConfig(steps=30, batch_size=16, bf16=True, log_every=1, learning_rate=3e-3)
    train(task, config, out_dir=tmp_path)
    records = map(json.loads, (tmp_path / "metrics.jsonl").open())
    losses = [record["loss"] for record in records if record["kind"] == "train"]
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.7 * losses[0]


def test_bf16_training_says_what_it_costs_before_starting_where_bf16_is_emulated(
    task, tmp_path, monkeypatch, caplog
):
    """A CPU without native bf16 products (tens of times slower than fp32): the run warns,
    with the measured slowdown, before its first step; fp32 runs do not."""
    from qkv import capabilities

    slow = capabilities.Support(False, "bf16 matrix products take 40x the time of fp32 ones")
    monkeypatch.setattr(capabilities, "bf16_products", lambda: slow)
    monkeypatch.setattr(capabilities, "_WARNED", set())
    steps = []
    with caplog.at_level("WARNING", logger="qkv"):
        train(task, TrainingConfig(steps=1, batch_size=4), out_dir=tmp_path / "fp32")
        assert not caplog.records
        config = TrainingConfig(steps=1, batch_size=4, bf16=True, log_every=1)
        train(task, config, out_dir=tmp_path / "bf16", on_log=lambda r: steps.append(r))
    [warning] = caplog.records
    assert "training with bf16 autocast" in warning.message and "40x" in warning.message
    assert "fp32 runs at full speed here" in warning.message and steps  # and it trained


def test_the_steps_run_with_the_stand_ins_that_pay_and_end_where_plain_pytorch_does(
    tmp_path, monkeypatch
):
    """`speed_up` (the default) swaps the rolled RoPE and the fused cross-entropy backward into a
    Llama-style GPT for the steps, and oneDNN's float32 products where this CPU's choice says
    so; the model comes back with PyTorch's own classes, on the weights of the same run with
    speed_up=False (PyTorch's blocks alone) up to float rounding."""
    task = GPTTask(GPTOptions(
        family="llama", vocab_size=512, block_size=32, embed_dim=32, num_layers=1, num_heads=2,
        ffn_dim=64, dropout=0.0,
    ))  # fmt: skip
    calls = Counter()

    def counted(owner, name):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: calls.update([name]) or real(*a, **k))

    counted(FastRotaryEmbedding, "rotate")
    counted(fused_loss, "fused_cross_entropy")
    counted(OneDNNLinear, "forward")
    config = dict(steps=3, batch_size=8, warmup_steps=1, checkpoint_every=0)
    fast = train(task, TrainingConfig(**config), out_dir=tmp_path / "fast")
    assert calls["rotate"] and calls["fused_cross_entropy"] == 3  # a loss per step
    assert bool(calls["forward"]) == bool(speed_up_choices()["onednn_linears"])
    swapped = (FastRotaryEmbedding, OneDNNLinear)
    assert not [m for m in fast.model.modules() if isinstance(m, swapped)]
    calls.clear()
    plain = train(task, TrainingConfig(**config, speed_up=False), out_dir=tmp_path / "plain")
    assert not calls
    for (name, a), b in zip(
        _weights(fast.model).items(), _weights(plain.model).values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
