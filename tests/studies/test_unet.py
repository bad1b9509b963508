"""The U-Net study end to end at its tiny size (each denoiser trained and scored), and its
verdict rules on hand-made rows."""

from __future__ import annotations

import json
import math

import pytest

from qkv.studies import run_study
from qkv.studies.unet import VARIANTS, verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("unet", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_a_row_per_denoiser(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"unet.{suffix}").stat().st_size > 0
    record = json.loads((out / "unet.json").read_text())
    assert record["size"] == "tiny" and record["verdict"] == result.verdict
    assert [row["variant"] for row in result.rows] == list(VARIANTS)
    assert [row["denoiser"] for row in result.rows] == ["transformer", "transformer", "unet"]
    seeds = result.settings["num_seeds"]
    for row in result.rows:
        assert math.isfinite(row["validation loss"]) and 0 <= row["ViT accuracy"] <= 1
        assert row["parameters"] > 0 and row["training seconds"] > 0
        measured = result.series["measured"][row["variant"]]
        assert [len(values) for values in measured.values()] == [seeds] * 3
    assert len(result.verdicts) == 2
    assert sum(" - U-Net, validation loss seed by seed" in f for f in result.findings) == 2


def _rows(dit_loss, unet_loss, dit_accuracy=0.8, unet_accuracy=0.8, spread=0.01):
    losses = {"DiT (adaLN-Zero)": dit_loss, "DiT (added timestep)": 0.07, "U-Net": unet_loss}
    accuracy = {"DiT (adaLN-Zero)": dit_accuracy, "DiT (added timestep)": 0.5,
                "U-Net": unet_accuracy}  # fmt: skip
    return [
        {"variant": label, "validation loss": losses[label], "loss range over seeds": spread,
         "ViT accuracy": accuracy[label], "accuracy range over seeds": spread}
        for label in VARIANTS
    ]  # fmt: skip


@pytest.mark.parametrize(
    "losses, expected",
    [((0.05, 0.06), "supported"), ((0.065, 0.06), "mixed"), ((0.08, 0.06), "not supported")],
)
def test_the_loss_verdict_weighs_the_gap_against_the_seed_ranges(losses, expected):
    assert verdicts(_rows(*losses))[0].verdict == expected


@pytest.mark.parametrize(
    "accuracy, expected",
    [((0.8, 0.8), "supported"), ((0.795, 0.8), "mixed"), ((0.6, 0.8), "not supported")],
)
def test_the_accuracy_verdict_weighs_the_lag_against_the_seed_ranges(accuracy, expected):
    verdict = verdicts(_rows(0.05, 0.06, *accuracy))[1]
    assert verdict.verdict == expected and (verdict.why != "") == (expected != "supported")
