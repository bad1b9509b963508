"""`qkv train gpt --fsdp` under torchrun (gloo), as a user runs it: 2 processes each keep half
of every parameter, gradient and AdamW moment (PyTorch's fully_shard), and

- the loss trajectory equals one process's on the same global batches (fp32, 1e-5);
- a rank killed with SIGKILL brings the run down, and `--resume` on 2 processes ends on
  weights bitwise equal to the uninterrupted run's;
- its checkpoint (the full state, gathered) resumes on ONE process, unsharded, which ends on
  the weights of the 1-process run.

The fast tests check the pieces on one process: the checkpoint identity leaves fsdp out, and
`gather_state` of an unsharded model is its own state.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from qkv.training import TrainingConfig
from qkv.training.sharded import gather_state

STEPS = 30
FLAGS = [
    "--vocab-size", "300", "--block-size", "30", "--embed-dim", "32", "--num-layers", "2",
    "--num-heads", "4", "--family", "gpt2", "--ffn-dim", "64", "--dropout", "0",
    "--steps", str(STEPS), "--batch-size", "4", "--accumulation-steps", "2",
    "--warmup-steps", "2", "--log-every", "1", "--checkpoint-every", "5", "--threads", "1",
]  # fmt: skip
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}
DEADLINE_S = 180


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    import pydoc_data.topics

    texts = [text.strip().replace("\n\n", "\n") for text in pydoc_data.topics.topics.values()]
    path = tmp_path_factory.mktemp("data") / "documents.txt"
    path.write_text("\n\n".join(texts[:25]), encoding="utf-8")
    return path


def _command(documents, out, *, processes=1, extra=()):
    train = ["-m", "qkv.cli", "train", "gpt", "--data", str(documents), *FLAGS, "--out", str(out)]
    if processes == 1:
        return [sys.executable, *train, *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes)]  # fmt: skip
    return [*launcher, *train, "--fsdp", *extra]


def _run(command):
    result = subprocess.run(command, env=ENVIRONMENT, capture_output=True, text=True,
                            timeout=DEADLINE_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def _checkpoint(out):
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as file:
        document = json.loads(file.metadata()["qkv"])
        tensors = {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
    return document, tensors


def _losses(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["kind"] == "train"]


def _kill_one_rank_after_a_checkpoint(command, out):
    launcher = subprocess.Popen(command, env=ENVIRONMENT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    while not (out / "checkpoint.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.02)  # into a later step: 25 more steps are still to come
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    pids = [int(pid) for pid in workers.stdout.split()]
    assert len(pids) == 2, f"expected 2 workers under torchrun, found {pids}"
    os.kill(pids[-1], signal.SIGKILL)
    assert launcher.wait(timeout=DEADLINE_S) != 0, "the run ended before a rank was killed"


@pytest.mark.slow
def test_fsdp_training_matches_one_process_and_resumes_on_any_count(tmp_path, documents):
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    _run(_command(documents, one))
    _run(_command(documents, two, processes=2))
    single, double = _losses(one), _losses(two)
    assert len(single) == len(double) == STEPS
    assert double == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert single[-1] < single[0]  # it trained
    (document_one, state_one), (document_two, state_two) = _checkpoint(one), _checkpoint(two)
    assert document_two["tied_weights"] == document_one["tied_weights"] != {}  # gpt2 ties
    assert sorted(state_two) == sorted(state_one)  # the same file an unsharded run writes
    for name, tensor in state_one.items():  # weights and AdamW moments, gathered
        if name != "rng/torch":
            torch.testing.assert_close(state_two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    _kill_one_rank_after_a_checkpoint(_command(documents, killed, processes=2), killed)
    step_at_kill = _checkpoint(killed)[0]["step"]
    assert 0 < step_at_kill < STEPS
    on_one = tmp_path / "on_one"
    shutil.copytree(killed, on_one)
    _run(_command(documents, killed, processes=2, extra=["--resume"]))
    (document, resumed) = _checkpoint(killed)
    assert document["step"] == STEPS
    for name, tensor in state_two.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)

    _run(_command(documents, on_one, extra=["--resume"]))
    document, weights = _checkpoint(on_one)
    assert document["step"] == STEPS
    for name, tensor in state_one.items():
        if name.startswith("model/"):
            torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_the_checkpoint_identity_leaves_out_fsdp():
    sharded, plain = TrainingConfig(steps=5, fsdp=True), TrainingConfig(steps=5)
    assert sharded.identity() == plain.identity()
    assert "fsdp" not in plain.identity() and sharded.to_json()["fsdp"] is True
    assert TrainingConfig(steps=6).identity() != plain.identity()


def test_gather_state_of_an_unsharded_model_is_its_own_state_with_ties_kept():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    state = gather_state(model, optimizer)
    expected = model.state_dict()
    assert sorted(state["model_state"]) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state["model_state"][name], tensor, rtol=0, atol=0)
    assert state["model_state"]["0.weight"] is state["model_state"]["1.weight"]
    own = optimizer.state_dict()
    assert state["optimizer_state"]["param_groups"] == own["param_groups"]
    for key, value in own["state"][0].items():
        torch.testing.assert_close(state["optimizer_state"]["state"][0][key], value)
