"""The ffn-width study end to end at its tiny size, its sizes against the FFN's matrices, and
its verdict rules on hand-made rows."""

from __future__ import annotations

import json
import math

import pytest

from qkv.studies import run_study
from qkv.studies.ffn_width import verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("ffn-width", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_a_row_per_width(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"ffn-width.{suffix}").stat().st_size > 0
    record = json.loads((out / "ffn-width.json").read_text())
    assert record["size"] == "tiny" and record["verdict"] in ("supported", "not supported", "mixed")
    multiples = result.settings["ffn_multiples"]
    assert [row["variant"] for row in result.rows] == [f"{k}x" for k in multiples]
    assert list(result.rows[0]) == result.columns
    assert [len(losses) for losses in result.series["losses"].values()] == [
        result.settings["num_seeds"]
    ] * len(multiples)
    assert all(math.isfinite(row["validation loss"]) for row in result.rows)
    assert [v.claim for v in result.verdicts] == [
        "a wider FFN lowers the loss",
        "with diminishing returns per parameter",
    ]


def test_each_widening_adds_two_matrices_of_parameters_and_their_flops(written):
    result, _ = written
    E, layers, L = (result.settings[key] for key in ("embed_dim", "num_layers", "block_size"))
    for row, k in zip(result.rows, result.settings["ffn_multiples"], strict=True):
        assert row["ffn dim"] == k * E and row["ffn dim / d_model"] == k
    for narrow, wide in zip(result.rows, result.rows[1:], strict=False):
        extra = wide["ffn dim"] - narrow["ffn dim"]
        assert wide["parameters"] - narrow["parameters"] == layers * 2 * E * extra  # W_1, W_2
        # 2 FLOPs per multiply-add, 2 matrices, every token of every layer
        assert wide["FLOPs per token"] - narrow["FLOPs per token"] == layers * 2 * 2 * E * extra


def _rows(losses, ranges=(0.01, 0.01, 0.01, 0.01)):
    return [
        {"variant": f"{k}x", "parameters": 100_000 + 8192 * k, "validation loss": loss,
         "loss range over seeds": spread}
        for k, loss, spread in zip((1, 2, 4, 8), losses, ranges, strict=True)
    ]  # fmt: skip


def test_rule_supported_where_every_widening_helps_less_per_parameter():
    found = verdicts(_rows([4.0, 3.8, 3.7, 3.65]))
    assert [v.verdict for v in found] == ["supported", "supported"]


def test_rule_not_supported_where_wider_does_not_lower_the_loss_past_the_seeds():
    # drops 0.1, 0.3, 0.9 against ranges of 1.0; per parameter 0.1, 0.15, 0.225: growing
    found = verdicts(_rows([4.5, 4.4, 4.1, 3.2], ranges=(1.0, 1.0, 1.0, 1.0)))
    assert [v.verdict for v in found] == ["not supported", "not supported"]
    assert all(v.why for v in found)


def test_rule_mixed_where_some_widenings_fail():
    # 1x -> 2x and 4x -> 8x lower the loss past the range; 2x -> 4x does not
    found = verdicts(_rows([4.0, 3.8, 3.795, 3.7]))
    assert found[0].verdict == "mixed" and "2x -> 4x" not in found[0].evidence.split(": ")[-1]
    # per 1,000 parameters: 0.0244, 0.0003, 0.0029: the last return grows again
    assert found[1].verdict == "mixed"


def test_training_loss_is_reported_beside_the_validation_loss(written):
    result, _ = written
    for row in result.rows:
        assert math.isfinite(row["training loss"])
        assert row["validation - training"] == pytest.approx(
            row["validation loss"] - row["training loss"]
        )
    assert not any(label.startswith("train ") for label in result.series["losses"])


def test_the_why_names_overfitting_only_where_the_gap_grows_with_the_width():
    rows = _rows([4.0, 4.0, 4.0, 4.0])
    for row, gap in zip(rows, (0.1, 0.2, 0.3, 0.4), strict=True):
        row["validation - training"] = gap
    assert "fit the training text" in verdicts(rows)[0].why
    rows[-1]["validation - training"] = 0.0
    assert "fit the training text" not in verdicts(rows)[0].why
