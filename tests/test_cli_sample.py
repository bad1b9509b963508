"""`qkv train diffusion` then `qkv sample` end to end on a tiny model: the run folder, the
model folder the sampler reads, a PNG of the requested grid, the same samples for the same
seed, and clear errors."""

import json
import math

import pytest
import torch
from PIL import Image

from qkv.cli import main
from qkv.models import DiffusionTransformer
from qkv.training.tasks.diffusion import load_sampler, sample_digits

TINY_FLAGS = ["--patch-size", "4", "--embed-dim", "16", "--num-layers", "1", "--num-heads", "2",
              "--ffn-dim", "32", "--num-timesteps", "20", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    flags = [*TINY_FLAGS, "--steps", "3", "--batch-size", "8", "--conditioning", "add"]
    assert main(["train", "diffusion", *flags, "--out", str(out)]) == 0
    return out


def test_train_writes_a_model_folder_the_sampler_reads(model_dir):
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["task"] == "diffusion" and summary["steps"] == 3
    assert set(summary["metrics"]) == {"valid_loss", "valid_loss_null"}
    model, tokenizer = load_sampler(model_dir / "model")
    assert isinstance(model, DiffusionTransformer) and model.config.conditioning == "add"
    assert model.config.num_timesteps == 20
    assert tokenizer.encode("a handwritten three").tokens[2] == "handwritten"
    task = json.loads((model_dir / "model" / "task.json").read_text())
    assert task["name"] == "diffusion" and task["condition_dropout"] == 0.1


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_sample_writes_the_grid(model_dir, tmp_path, capsys, sampler):
    out = tmp_path / "grid.png"
    args = ["sample", "a handwritten three", "--model", str(model_dir / "model"), "--guidance",
            "3", "--num", "6", "--columns", "3", "--seed", "1", "--out", str(out), "--sampler",
            sampler, "--steps", "4", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    assert f"wrote {out}: 6 samples of 'a handwritten three'" in capsys.readouterr().out
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width > 50 and image.height > 50


def test_the_same_seed_draws_the_same_samples(model_dir):
    model, tokenizer = load_sampler(model_dir / "model")
    prompts = ["a handwritten three"] * 2
    first = sample_digits(model, tokenizer, prompts, guidance=3, seed=5, sampler="ddim", steps=3)
    again = sample_digits(model, tokenizer, prompts, guidance=3, seed=5, sampler="ddim", steps=3)
    other = sample_digits(model, tokenizer, prompts, guidance=3, seed=6, sampler="ddim", steps=3)
    assert first.shape == (2, 1, 8, 8) and torch.equal(first, again)
    assert not torch.equal(first, other)
    assert float(first.min()) >= 0 and float(first.max()) <= 1


def test_errors_name_the_argument(model_dir, tmp_path, capsys):
    model = str(model_dir / "model")
    assert main(["sample", "a three", "--model", model, "--guidance", "-1"]) == 1
    assert "--guidance: expected a finite number >= 0, got -1" in capsys.readouterr().err
    assert main(["sample", "a three", "--model", model, "--out", str(tmp_path / "x.jpg")]) == 1
    assert "--out: expected a .png or .svg file name" in capsys.readouterr().err
    assert main(["sample", "a three", "--model", str(tmp_path / "missing")]) == 1
    assert "qkv sample: error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--guidance", "inf"], "--guidance: expected a finite number >= 0, got inf"),
        (["--guidance", "nan"], "--guidance: expected a finite number >= 0, got nan"),
        (["--num", "100000000"], "--num 100000000 (--columns 8): the grid's image would take ~"),
        (["--num", "4", "--columns", "1000000"], "--columns: expected an int >= 1 and <= 4"),
        (["--steps", "0"], "--steps: expected an int >= 1, got 0"),
        (["--seed", str(2**70)], "--seed: expected an int >= 0 and <= 9223372036854775807"),
    ],
)
def test_what_cannot_be_drawn_is_refused_before_any_sampling(
    model_dir, capsys, monkeypatch, flags, said
):
    """No sampling starts for a grid that could not be drawn (a 536 GiB canvas, after minutes of
    sampling) or a guidance that can only give NaN images."""
    from qkv.training.tasks import diffusion

    monkeypatch.setattr(diffusion, "sample_digits", lambda *a, **k: pytest.fail("sampled"))
    assert main(["sample", "a three", "--model", str(model_dir / "model"), *flags]) == 1
    assert said in capsys.readouterr().err


def test_missing_matplotlib_is_found_before_any_sampling(model_dir, capsys, monkeypatch):
    import sys

    from qkv.training.tasks import diffusion

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(diffusion, "sample_digits", lambda *a, **k: pytest.fail("sampled"))
    assert main(["sample", "a three", "--model", str(model_dir / "model")]) == 1
    assert "qkv sample: error:" in capsys.readouterr().err


def test_samples_that_come_out_nan_are_an_error_not_an_image(model_dir, tmp_path, capsys,
                                                             monkeypatch):  # fmt: skip
    from qkv.training.tasks import diffusion

    monkeypatch.setattr(
        diffusion, "sample_digits", lambda *a, **k: torch.full((2, 1, 8, 8), math.nan)
    )
    out = tmp_path / "grid.png"
    args = ["sample", "a three", "--model", str(model_dir / "model"), "--guidance", "1e300",
            "--num", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 1
    assert "the samples came out NaN or infinite" in capsys.readouterr().err
    assert not out.exists()


def test_the_grid_tiles_images_row_major_with_gaps():
    from qkv.analysis.plots.diffusion import tile_images

    images = torch.arange(5.0)[:, None, None, None].expand(5, 1, 2, 3) / 4  # image i holds i/4
    grid = tile_images(images, columns=2, gap=1)
    assert grid.shape == (3 * 3 - 1, 2 * 4 - 1)
    assert (grid[0:2, 0:3] == 0.0).all() and (grid[0:2, 4:7] == 0.25).all()
    assert (grid[3:5, 0:3] == 0.5).all() and (grid[6:8, 0:3] == 1.0).all()
    assert (grid[6:8, 4:7] == 0).all() and (grid[2, :] == 0).all()  # an empty cell, a gap
