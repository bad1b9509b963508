"""`qkv train gpt --context-parallel 2` under torchrun (gloo), as a user runs it: the two
processes share every sequence through ring attention, and

- its loss trajectory equals one process's on the same global batches (fp32, 1e-5);
- a rank killed with SIGKILL brings the run down, and `--resume` on 2 processes ends on
  weights bitwise equal to the uninterrupted run's;
- its checkpoint resumes on ONE process, which ends on the weights of the 1-process run.

The blocks hold 30 tokens: 2 processes cut them in 4 zigzag chunks, so they are padded to 32.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.distributed.gpt_runs import (
    command,
    kill_one_rank_after_a_checkpoint,
    losses,
    run,
    write_documents,
)

STEPS = 30
FLAGS = [
    "--vocab-size", "300", "--block-size", "30", "--embed-dim", "32", "--num-layers", "2",
    "--num-heads", "4", "--num-kv-heads", "2", "--family", "llama", "--ffn-dim", "64",
    "--dropout", "0", "--steps", str(STEPS), "--batch-size", "4", "--warmup-steps", "2",
    "--log-every", "1", "--checkpoint-every", "5", "--threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("data"))


def _command(documents, out, *, processes=1, extra=()):
    parallel = ["--context-parallel", str(processes)]
    return command(documents, out, FLAGS, processes=processes, parallel=parallel, extra=extra)


def _weights(out):
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        step = json.loads(file.metadata()["qkv"])["step"]
        tensors = {k: file.get_tensor(k) for k in file.keys() if k.startswith("model/")}  # noqa: SIM118
    return step, tensors


@pytest.mark.slow
def test_context_parallel_training_matches_one_process_and_resumes_on_any_count(
    tmp_path, documents
):
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    run(_command(documents, one))
    run(_command(documents, two, processes=2))
    single, double = losses(one), losses(two)
    assert len(single) == len(double) == STEPS
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained

    kill_one_rank_after_a_checkpoint(_command(documents, killed, processes=2), killed)
    step_at_kill, _ = _weights(killed)
    assert 0 < step_at_kill < STEPS
    on_one = tmp_path / "on_one"
    shutil.copytree(killed, on_one)
    run(_command(documents, killed, processes=2, extra=["--resume"]))
    (final_step, resumed), (_, expected) = _weights(killed), _weights(two)
    assert final_step == STEPS
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)

    run(_command(documents, on_one, extra=["--resume"]))
    final_step, weights = _weights(on_one)
    _, reference = _weights(one)
    assert final_step == STEPS
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
