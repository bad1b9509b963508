"""A training step whose memory estimate is far beyond the machine's is refused before anything is
built, naming batch_size and the GiB; the estimate is Korthikanti et al. 2022's formula."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from qkv.models import GPTConfig
from qkv.models.sizes import config_of, parameter_count
from qkv.training import TrainingConfig, loop, memory_check, train
from qkv.training.memory_check import (
    check_step_fits,
    estimate_step,
    transformer_activation_bytes,
)
from qkv.training.tasks import GPTOptions, GPTTask

ONE_PROCESS = SimpleNamespace(world_size=1, enabled=False)
MIB = 2**20


@pytest.fixture(scope="module")
def gpt_task(tmp_path_factory):
    torch.set_num_threads(1)
    words = [f"word{i} thing{i % 7} and more{i % 11}" for i in range(60)]
    documents = [" ".join(words[i : i + 30]) for i in range(0, 60, 2)]
    text = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    text.write_text("\n\n".join(documents) + "\n")
    options = GPTOptions(
        data=str(text), vocab_size=300, block_size=16, embed_dim=32, num_layers=1,
        num_heads=2, ffn_dim=64, dropout=0.0,
    )  # fmt: skip
    return GPTTask(options)


def test_the_activations_are_korthikantis_formula():
    # GPT-3 175B's block (a=96, h=12288) at s=2048, b=1, 16-bit: s b h (34 + 5 a s / h) bytes
    s, b, h, a = 2048, 1, 12288, 96
    expected = s * b * h * (34 + 5 * a * s // h)
    assert expected == 2_868_903_936
    assert transformer_activation_bytes(tokens=s, batch=b, width=h, heads=a, layers=1) == expected
    assert transformer_activation_bytes(tokens=s, batch=b, width=h, heads=a, layers=3) == (
        3 * expected
    )
    # fp32, no dropout, scores not stored: 32 s b h + 8 s b f per block
    fp32 = transformer_activation_bytes(
        tokens=128, batch=32, width=128, heads=4, layers=2, ffn_dim=512, bytes_per_value=4,
        dropout=False, scores=False,
    )  # fmt: skip
    assert fp32 == 2 * (32 * 128 * 32 * 128 + 8 * 128 * 32 * 512) == 64 * MIB
    # a gated FFN (SwiGLU) keeps twice the f-wide values
    gated = transformer_activation_bytes(
        tokens=1, batch=1, width=1, heads=1, layers=1, ffn_dim=10, bytes_per_value=4,
        dropout=False, scores=False, gated=True,
    )  # fmt: skip
    assert gated == 32 + 4 * 4 * 10


def test_the_step_estimate_follows_the_micro_batch(gpt_task):
    model_config = config_of(gpt_task.build_model)
    assert isinstance(model_config, GPTConfig)
    two = SimpleNamespace(world_size=2, enabled=True)
    config = TrainingConfig(steps=1, batch_size=10, accumulation_steps=3)
    estimate = estimate_step(gpt_task, config, two)
    assert (estimate.micro_batch, estimate.tokens) == (2, 16)  # ceil(ceil(10 / 2) / 3)
    V = model_config.vocab_size
    activations = 2 * 16 * V * 8 + transformer_activation_bytes(
        tokens=16, batch=2, width=32, heads=2, layers=1, ffn_dim=64, bytes_per_value=4,
        dropout=False, scores=False,
    )  # fmt: skip
    assert estimate.activations == activations
    assert estimate.state == 16 * parameter_count(model_config)
    sharded = estimate_step(gpt_task, config, two, fsdp=True)
    assert sharded.state == math.ceil(estimate.state / 2)
    # context parallelism: every process holds every example, a share of each sequence
    parallel = GPTTask.__new__(GPTTask)
    parallel.__dict__.update(gpt_task.__dict__)
    parallel.options = dataclasses.replace(gpt_task.options, context_parallel=2)
    shared = estimate_step(parallel, config, two)
    assert (shared.micro_batch, shared.tokens) == (4, 8)


def test_a_task_whose_example_length_is_unknown_is_not_checked(monkeypatch):
    monkeypatch.setattr(memory_check, "memory_bytes", lambda device=None: 1)
    unknown = SimpleNamespace(build_model=lambda: pytest.fail("built"))
    config = TrainingConfig(steps=1, batch_size=10)
    assert estimate_step(unknown, config, ONE_PROCESS) is None
    check_step_fits(unknown, config, ONE_PROCESS)


def test_a_step_far_beyond_memory_is_refused_before_anything_is_built(
    gpt_task, tmp_path, monkeypatch
):
    config = TrainingConfig(steps=1, batch_size=len(gpt_task), accumulation_steps=2)
    needed = estimate_step(gpt_task, config, ONE_PROCESS).total
    monkeypatch.setattr(memory_check, "memory_bytes", lambda device=None: needed // 3)
    monkeypatch.setattr(loop, "_build", lambda *args: pytest.fail("the model was built"))
    message = (
        rf"^batch_size: {len(gpt_task)} with accumulation_steps=2 over 1 process\(es\) gives "
        rf"micro-batches of {math.ceil(len(gpt_task) / 2)} examples of 16 tokens; one training "
        r"step would need ~[\d.]+ GiB .* more than 2 times the [\d.]+ GiB of memory here; "
        r"expected a smaller batch_size or more accumulation_steps$"
    )
    with pytest.raises(ValueError, match=message):
        train(gpt_task, config, out_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()
    # within twice the memory: allowed, as the estimate stays below the real peak
    monkeypatch.setattr(memory_check, "memory_bytes", lambda device=None: math.ceil(needed / 2))
    loop._check_batch(gpt_task, config, ONE_PROCESS)


def test_a_small_step_is_not_refused(gpt_task):
    config = TrainingConfig(steps=1, batch_size=len(gpt_task))
    assert estimate_step(gpt_task, config, ONE_PROCESS).total < 64 * MIB
    loop._check_batch(gpt_task, config, ONE_PROCESS)  # the memory of this machine
