"""The activations study end to end at its tiny size, its equal parameters, and its verdict
rule on hand-made rows (separated either way, and within the seed range)."""

from __future__ import annotations

import json
import math

import pytest

from qkv.models.gpt_config import FFN_KINDS
from qkv.studies import run_study
from qkv.studies.activations import UNJUDGED, verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("activations", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_a_row_per_activation(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"activations.{suffix}").stat().st_size > 0
    record = json.loads((out / "activations.json").read_text())
    assert record["size"] == "tiny" and record["unjudged"] == UNJUDGED
    assert [row["variant"] for row in result.rows] == ["GELU", "SwiGLU"]
    assert [row["ffn"] for row in result.rows] == ["gelu_tanh", "swiglu"]
    assert all(math.isfinite(row["validation loss"]) for row in result.rows)
    assert [len(v) for v in result.series["losses"].values()] == [result.settings["num_seeds"]] * 2
    assert len(result.verdicts) == 1 and result.verdict == result.verdicts[0].verdict
    assert any(finding.startswith("Seed by seed") for finding in result.findings)


def test_swiglu_is_two_thirds_as_wide_at_equal_parameters(written):
    result, _ = written
    gelu, swiglu = result.rows
    E, layers = result.settings["embed_dim"], result.settings["num_layers"]
    assert gelu["ffn dim"] == result.settings["ffn_multiple"] * E
    assert swiglu["ffn dim"] == round(2 * gelu["ffn dim"] / 3)
    # 3 matrices of the rounded width against 2: at most half a column (3 E) apart per layer
    assert abs(swiglu["parameters"] - gelu["parameters"]) <= layers * 3 * E / 2
    assert abs(swiglu["FLOPs per token"] / gelu["FLOPs per token"] - 1) < 0.01


def test_relu_is_no_ffn_kind_of_the_gpt():
    # why GELU <= ReLU is left unjudged
    assert "relu" not in FFN_KINDS and "ReLU" in UNJUDGED[0]


def _rows(gelu, swiglu, spread=0.02):
    return [
        {"variant": "GELU", "validation loss": gelu, "loss range over seeds": spread},
        {"variant": "SwiGLU", "validation loss": swiglu, "loss range over seeds": spread / 2},
    ]


@pytest.mark.parametrize(
    "swiglu, expected",
    [(3.95, "supported"), (4.05, "not supported"), (3.99, "mixed"), (4.01, "mixed")],
)
def test_rule_separates_only_past_the_larger_seed_range(swiglu, expected):
    (found,) = verdicts(_rows(4.0, swiglu))
    assert found.verdict == expected
    assert bool(found.why) == (expected != "supported")
