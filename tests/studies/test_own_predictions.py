"""The own-predictions study end to end at its tiny size, that its second training reads the
model's own predictions at every position from the first step, and its verdict rule."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.studies import exposure_bias_training, run_study
from qkv.studies.own_predictions import RUNS, SIZES, verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("own-predictions", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_a_row_per_training(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"own-predictions.{suffix}").stat().st_size > 0
    assert json.loads((out / "own-predictions.json").read_text())["size"] == "tiny"
    assert [row["training"] for row in result.rows] == list(RUNS)
    seeds = result.settings["seeds"]
    for label in RUNS:
        assert all(len(values) == seeds for values in result.series["measured"][label].values())
    assert len(result.verdicts) == 1


def test_the_second_training_reads_only_its_own_predictions(monkeypatch):
    """eps = 0 at every step: scheduled_sampling_loss is called each step with epsilon 0, and
    after [BOS] the decoder reads its own greedy prediction at every position."""
    seen = []
    real = exposure_bias_training.scheduled_sampling_loss

    def spy(*args, epsilon, **kwargs):
        seen.append(epsilon)
        loss, logits, read = real(*args, epsilon=epsilon, **kwargs)  # read: [BOS], then (B, L - 1)
        assert torch.equal(read[:, 1:], logits[:, :-1].argmax(-1))  # its own greedy tokens
        return loss, logits, read

    monkeypatch.setattr(exposure_bias_training, "scheduled_sampling_loss", spy)
    run_study("own-predictions", size="tiny", out=None)
    assert seen == [0.0] * SIZES["tiny"]["train_steps"] * SIZES["tiny"]["seeds"]


def _rows(teacher, own, spread=0.02):
    return [
        {"training": label, "exact match": value, "exact match range over seeds": spread}
        for label, value in zip(RUNS, (teacher, own), strict=True)
    ]


@pytest.mark.parametrize(
    "teacher, own, expected",
    [(0.9, 0.5, "supported"), (0.9, 0.89, "mixed"), (0.5, 0.9, "not supported")],
)
def test_verdict_rule(teacher, own, expected):
    assert verdicts(_rows(teacher, own))[0].verdict == expected
