"""`qkv train translate` end to end: progress, test exact match, a saved model that `qkv
translate` uses, the cross-attention heat map; bad options are clear errors."""

import dataclasses
import json
import signal
import subprocess
import sys
import time

import pytest

from qkv.cli import main

from .tiny import TINY_FLAGS


def test_train_then_translate_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "translate", *TINY_FLAGS, "--steps", "3", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "step 3/3" in captured.err and "test exact match:" in captured.out
    assert "dreihundertzwölf  ->" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["metrics"]["test_exact_match"] <= 1.0
    png = (out / "cross_attention.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "task.json"):
        assert (out / "model" / name).is_file()
    assert main(["translate", "einundzwanzig", "zwölf", "--model", str(out / "model")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    (out / "model" / "tokenizer.json").write_text('{"version": "1.0", "model": {')  # cut short
    assert main(["translate", "eins", "--model", str(out / "model")]) == 1
    error = capsys.readouterr().err
    assert (
        error.startswith("qkv translate: error: path: ") and "not a valid tokenizer.json" in error
    )


def test_a_run_folder_is_not_overwritten_without_being_asked(tmp_path, capsys, monkeypatch):
    """A second `qkv train --out DIR` without --resume is refused before any data is prepared,
    naming what the first left and the two ways on; --overwrite starts again from step 0."""
    out = tmp_path / "run"
    flags = ["train", "translate", *TINY_FLAGS, "--steps", "2", "--out", str(out)]
    assert main(flags) == 0
    first = (out / "checkpoint.safetensors").read_bytes()
    capsys.readouterr()
    assert main([*flags, "--learning-rate", "0.1"]) == 1
    error = capsys.readouterr().err
    assert (
        "holds an earlier run (checkpoint.safetensors, metrics.jsonl, summary.json, model)" in error
    )
    assert "--resume" in error and "--overwrite" in error and "preparing data" not in error
    assert (out / "checkpoint.safetensors").read_bytes() == first
    assert main([*flags, "--learning-rate", "0.1", "--overwrite"]) == 0
    assert (out / "checkpoint.safetensors").read_bytes() != first


def test_under_torchrun_only_rank_0_writes_the_report(tmp_path, capsys, monkeypatch):
    """The other ranks of a run end with their part of the training, and write nothing: rank 1
    used to replace summary.json (metrics {}) and write model/ beside rank 0."""
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "run"
    assert main(["train", "translate", *TINY_FLAGS, "--steps", "1", "--out", str(out)]) == 0
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    assert "test exact match" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("task", "flags", "said"),
    [
        ("translate", ["--vocab-size", "1000000000"], "vocab_size: expected an int >= 9 and <= "),
        ("gpt", ["--vocab-size", "1000000000"], "vocab_size: expected an int >= 257 and <= "),
        ("translate", ["--batch-size", "100000000"], "batch_size: 100000000 is more than the"),
    ],
)
def test_sizes_past_what_the_task_can_use_are_refused_by_name(tmp_path, capsys, task, flags,
                                                              said):  # fmt: skip
    """A vocabulary of 10^9 aborted the process inside the tokenizer trainer (SIGABRT); a batch
    of 10^8 grew memory for minutes. Both are one line naming the flag, before any training."""
    small = TINY_FLAGS if task == "translate" else ["--threads", "1"]
    assert main(["train", task, *small, *flags, "--out", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert f"qkv train: error: {said}" in error
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_bad_options_and_missing_models_are_clear_errors(tmp_path, capsys):
    assert main(["train", "translate", "--steps", "0", "--out", str(tmp_path)]) == 1
    assert "steps: expected an int >= 1, got 0" in capsys.readouterr().err
    assert main(["translate", "eins", "--model", str(tmp_path / "nothing")]) == 1
    assert "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["translate", "bert", "gpt"])
def test_every_flag_of_every_task_has_its_own_words(task, capsys):
    """Each option's help is the task's own (bert's --num-layers is not "encoder and decoder"),
    and every field of the task's options and of TrainingConfig is a flag."""
    from qkv.training import TrainingConfig
    from qkv.training.tasks import TASKS

    with pytest.raises(SystemExit):
        main(["train", task, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = TASKS[task][1]
    for field in (*dataclasses.fields(TrainingConfig), *dataclasses.fields(options)):
        assert "--" + field.name.replace("_", "-") in text
    if task != "translate":
        assert "source and target" not in text and "encoder and in the decoder" not in text
    for words in getattr(options, "FLAG_HELP", {}).values():
        assert " ".join(words.split()) in text


# `qkv train` as `python -m qkv.cli` runs it, which waits after its second checkpoint (step 10
# of 20) until the test's SIGINT arrives: a Ctrl-C in the middle of the run, at a known step,
# and only ten steps left to resume.
WAITS_FOR_CTRL_C = """
import sys, time
from pathlib import Path
from qkv.training import loop
real, saved = loop.save_checkpoint, []
def then_wait(*args, **kwargs):
    path = real(*args, **kwargs)
    saved.append(path)
    if len(saved) == 2:
        Path(sys.argv[1]).touch()
        time.sleep(900)  # a guard against a hang: the SIGINT ends it
    return path
loop.save_checkpoint = then_wait
from qkv.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_ctrl_c_ends_a_run_with_one_line_and_it_resumes(tmp_path):
    """SIGINT in the middle of training: no traceback, one line that says how to go on, the
    status of a process ended by SIGINT (130); --resume then finishes the run."""
    out, waiting = tmp_path / "run", tmp_path / "waiting"
    flags = [*TINY_FLAGS, "--steps", "20", "--checkpoint-every", "5", "--out", str(out)]
    command = [sys.executable, "-c", WAITS_FOR_CTRL_C, str(waiting), "train", "translate", *flags]
    run = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint,  # a background job's children start with SIGINT ignored
    )  # fmt: skip
    deadline = time.monotonic() + 900  # a guard against a hang, not a speed check
    while not waiting.exists():
        assert run.poll() is None and time.monotonic() < deadline, "no second checkpoint"
        time.sleep(0.01)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=900)
    assert run.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.rstrip().splitlines()[-1] == (
        f"qkv train translate: interrupted; resume from the last checkpoint in {out} with --resume"
    )
    assert main(["train", "translate", *flags, "--resume"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "train"][-1] == 20


def _default_sigint() -> None:
    """In the child before it starts: SIGINT's default action, so that Python turns it into
    KeyboardInterrupt (it leaves an ignored SIGINT ignored, as a shell's `&` sets it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
