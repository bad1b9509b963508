"""The conditioning study end to end at its tiny size (a model per conditioning, each on its
own configuration), and its verdict rules on hand-made rows."""

from __future__ import annotations

import json
import math

import pytest

from qkv.studies import run_study
from qkv.studies.conditioning import VARIANTS, verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("conditioning", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_a_row_per_conditioning(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"conditioning.{suffix}").stat().st_size > 0
    record = json.loads((out / "conditioning.json").read_text())
    assert record["size"] == "tiny" and record["verdict"] == result.verdict
    assert [row["conditioning"] for row in result.rows] == list(VARIANTS.values())
    seeds = result.settings["num_seeds"]
    for row in result.rows:
        assert math.isfinite(row["validation loss"]) and 0 <= row["ViT accuracy"] <= 1
        measured = result.series["measured"][row["variant"]]
        assert [len(values) for values in measured.values()] == [seeds] * 3
    # in-context conditioning has no cross-attention; adaLN-Zero adds its modulation layers
    parameters = {row["conditioning"]: row["parameters"] for row in result.rows}
    assert parameters["in_context"] < parameters["add"] < parameters["adaln_zero"]
    assert len(result.verdicts) == 2
    assert sum(finding.startswith("adaLN-Zero - ") for finding in result.findings) == 2


def _rows(ada, add, context, spread=0.01, accuracy=(0.9, 0.8, 0.7)):
    return [
        {"variant": label, "validation loss": loss, "loss range over seeds": spread,
         "ViT accuracy": share}
        for label, loss, share in zip(VARIANTS, (ada, add, context), accuracy, strict=True)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "losses, expected",
    [
        ((0.05, 0.07, 0.08), "supported"),  # below both by more than the seed range
        ((0.05, 0.055, 0.08), "mixed"),  # within the range of one
        ((0.09, 0.07, 0.095), "not supported"),  # above one by more than the range
    ],
)
def test_the_loss_verdict_needs_a_gap_beyond_the_seed_ranges(losses, expected):
    assert verdicts(_rows(*losses))[0].verdict == expected


@pytest.mark.parametrize(
    "accuracy, expected",
    [
        ((0.9, 0.9, 0.7), "supported"),
        ((0.8, 0.9, 0.7), "mixed"),
        ((0.6, 0.9, 0.7), "not supported"),
    ],
)
def test_the_accuracy_verdict_compares_adaln_zero_with_each_other_variant(accuracy, expected):
    verdict = verdicts(_rows(0.05, 0.07, 0.08, accuracy=accuracy))[1]
    assert verdict.verdict == expected and (verdict.why != "") == (expected != "supported")
