"""The `qkv` command: `qkv check` runs every sanity check and fails loudly when one fails; the
command behaves as a user expects: help with no sub-command, --version, progress as plain lines
when stderr is not a terminal, a quiet stop when the reader of its output goes away, a clear
--device error before any work, and a clear error for a Hub name (nothing is downloaded)."""

import fcntl
import importlib.metadata
import io
import itertools
import logging
import subprocess
import sys
import time

import pytest
import torch

from qkv.analysis.inspection import sanity
from qkv.cli import _COMMANDS, main
from qkv.commands import _progress
from qkv.models import GPT, BertModel, CheckpointError, from_pretrained
from tests.training.tiny import TINY_FLAGS

SUBCOMMANDS = [command.__name__.rsplit(".", 1)[-1] for command in _COMMANDS]


def test_check_passes_and_prints_every_row(capsys):
    assert main(["check"]) == 0
    printed = capsys.readouterr().out
    for label in "abcdefghijklmnopqrs":
        assert f"({label})" in printed
    assert "FAIL" not in printed and "19/19 passed" in printed
    # then what this machine supports, as qkv.capabilities answers it
    assert "packed torch.bfloat16 linears: " in printed and "compiled decoding: " in printed


def test_a_failing_check_makes_the_command_fail(capsys, monkeypatch):
    monkeypatch.setattr(sanity, "_CHECKS", [*sanity._CHECKS, ("(z)", "broken", lambda: 1 / 0)])
    assert main(["check"]) == 1
    printed = capsys.readouterr().out
    assert "(z)" in printed and "raised ZeroDivisionError" in printed and "failed: (z)" in printed


def test_help_lists_every_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "check" in result.stdout and "sanity checks" in result.stdout


def test_unknown_subcommand_is_an_error():
    with pytest.raises(SystemExit):
        main(["nonsense"])


def test_qkv_alone_prints_the_full_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qkv") and "the following arguments are required" not in out
    for name in SUBCOMMANDS:
        assert f"\n    {name} " in out or f"\n    {name}\n" in out, name


@pytest.mark.parametrize("group", ["train", "bench"])
def test_a_command_group_alone_prints_its_help(capsys, group):
    assert main([group]) == 0
    assert capsys.readouterr().out.startswith(f"usage: qkv {group}")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"qkv {importlib.metadata.version('qkv')}\n"


def _tick(step: float = 1.0):
    """A clock that advances `step` seconds each time it is read."""
    counter = itertools.count()
    return lambda: next(counter) * step


def test_line_progress_prints_a_line_per_tenth_with_rate_and_eta():
    file = io.StringIO()
    bar = _progress.LineProgress(200, desc="training", unit="step", file=file, clock=_tick(0.1))
    for _ in range(200):
        bar.set_postfix_str("loss 1.2500")
        bar.update(1)
    bar.close()
    text = file.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 10
    assert lines[0].startswith("training: step 20/200 (10%) [00:")
    assert "step/s" in lines[0] and "<" in lines[0] and lines[0].endswith(", loss 1.2500]")
    assert lines[-1].startswith("training: step 200/200 (100%)")


def test_line_progress_also_prints_every_n_seconds_and_at_close():
    file = io.StringIO()
    bar = _progress.LineProgress(
        1000, desc="embedding", unit="text", file=file, every_seconds=10, clock=_tick(3.0)
    )
    for _ in range(5):
        bar.update(1)  # 0.5% of the work, but more than 10 s
    assert file.getvalue().splitlines()[0].startswith("embedding: text 4/1000 (0%)")
    bar.close()
    assert file.getvalue().splitlines()[-1].startswith("embedding: text 5/1000 (0%)")


def test_progress_is_a_tqdm_bar_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert type(_progress.progress(3, desc="x", file=io.StringIO())) is _progress.LineProgress
    bar = _progress.progress(3, desc="x", file=Terminal())
    assert type(bar).__name__ == "tqdm"
    bar.close()


def test_train_progress_on_a_pipe_is_lines(tmp_path, capsys):
    """The data preparation's stages, then one line per logged step; no carriage return."""
    flags = [*TINY_FLAGS, "--steps", "4", "--log-every", "1", "--out", str(tmp_path)]
    assert main(["train", "translate", *flags]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    stage = next(i for i, line in enumerate(lines) if "generating 480 number pairs" in line)
    tokenizer = next(i for i, line in enumerate(lines) if "training a BPE tokenizer" in line)
    steps = [line for line in lines if line.startswith("training: step ")]
    assert stage < tokenizer < lines.index(steps[0])
    assert [line.split(" (")[0] for line in steps] == [f"training: step {n}/4" for n in range(1, 5)]
    assert all("step/s" in line or "s/step" in line for line in steps)


def test_bench_on_a_pipe_prints_lines_and_no_profiler_noise():
    """A real pipe (a subprocess): progress lines, no '\\r', no kineto "USDT" lines."""
    result = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "bench", "complexity", "--lengths", "32", "64",
         "--repeats", "1", "--backends", "naive", "sdpa"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "USDT" not in result.stderr
    assert "complexity: length 2/2 (100%)" in result.stderr and "L=64: naive" in result.stderr
    assert "naive" in result.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`qkv cost --json | head -1`: exit status 141 (SIGPIPE's), no traceback. The pipe is
    made small so that the output cannot fit in it before it is closed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv.cli", "cost", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    fcntl.fcntl(process.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    assert process.stdout.readline() == "[\n"
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=600) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == ""


def test_broken_pipe_in_process_returns_141(monkeypatch):
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["cost", "--json"]) == 141


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a build or machine without CUDA")
def test_device_cuda_without_cuda_fails_at_once_before_the_data(tmp_path, capsys):
    started = time.perf_counter()
    assert main(["train", "translate", "--device", "cuda", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert time.perf_counter() - started < 5  # preparing the default data takes ~20 s
    assert err.startswith("qkv train: error: --device cuda: ") and "--device cpu" in err
    assert "preparing data" not in err and "Traceback" not in err
    assert main(["bench", "complexity", "--device", "cuda:0"]) == 1
    assert capsys.readouterr().err.startswith("qkv bench complexity: error: --device cuda:0: ")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")
def test_device_mps_without_mps_and_unknown_devices(tmp_path, capsys):
    assert main(["train", "gpt", "--device", "mps", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qkv train: error: --device mps: MPS is not available")
    assert main(["train", "gpt", "--device", "gpu", "--out", str(tmp_path)]) == 1
    assert "--device gpu: expected cpu, cuda, cuda:N or mps" in capsys.readouterr().err
    assert main(["bench", "complexity", "--device", "mps"]) == 1
    assert "--device mps: expected cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("load", "name", "auto_class"),
    [
        (from_pretrained, "gpt2", "AutoModelForCausalLM"),
        (GPT.from_pretrained, "meta-llama/Llama-2-7b-hf", "AutoModelForCausalLM"),
        (BertModel.from_pretrained, "bert-base-uncased", "AutoModel"),
    ],
)
def test_a_hub_name_says_that_only_local_folders_are_read(tmp_path, monkeypatch, load, name,
                                                          auto_class):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    with pytest.raises(FileNotFoundError) as error:
        load(name)
    assert isinstance(error.value, CheckpointError)  # and so a ValueError
    message = str(error.value)
    local = name.rsplit("/", 1)[-1] + "-local"
    assert message.startswith(f'path: there is no folder "{name}" here')
    assert "local folders only and downloads nothing" in message
    assert f'{auto_class}.from_pretrained("{name}").save_pretrained("{local}")' in message
    assert f'then pass "{local}"' in message


def test_a_missing_path_that_is_no_hub_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"path: .*/runs/gpt/model does not exist"):
        GPT.from_pretrained(tmp_path / "runs" / "gpt" / "model")


def test_progress_callback_and_log_stages_on_a_pipe():
    """embed's progress(done, total) callback and the report's sections, as lines."""
    file = io.StringIO()
    with _progress.ProgressCallback(desc="embedding", unit="text", file=file) as callback:
        for done in (4, 8, 10):
            callback(done, 10)
    assert [line.split(" [")[0] for line in file.getvalue().splitlines()] == [
        "embedding: text 8/10 (80%)",  # the first call is where the rate starts
        "embedding: text 10/10 (100%)",
    ]
    file = io.StringIO()
    logger = logging.getLogger("qkv.test_progress")
    with _progress.log_stages("qkv.test_progress", 3, desc="report", unit="section", file=file):
        for name in ("model", "cost", "figures"):
            logger.info("report: building the %s section", name)
    lines = file.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == [
        f"report: section {n}/3 ({p}%)" for n, p in ((1, 33), (2, 67), (3, 100))
    ]
    assert lines[0].endswith(", building the cost section]")  # the next one, begun
    assert "\r" not in file.getvalue()
