"""The video-attention study end to end at its tiny size: files, record, table, the cost
columns against the score and FLOP counts worked out from T, N, E and H, and determinism."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.studies import run_study


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("studies")
    return run_study("video-attention", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"video-attention.{suffix}").stat().st_size > 0
    assert "video-attention.md" in (out / "README.md").read_text()
    record = json.loads((out / "video-attention.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny" and record["machine"]["torch"]
    assert record["settings"]["steps"] == 3


def test_a_row_per_target_and_attention_with_accuracies_and_times(written):
    result, _ = written
    settings = result.settings
    expected = [[t, a] for t in settings["targets"] for a in settings["attentions"]]
    assert [[row["target"], row["attention"]] for row in result.rows] == expected
    for row in result.rows:
        assert 0.0 <= row["valid accuracy"] <= 1.0 and 0.0 <= row["test accuracy"] <= 1.0
        assert row["training s"] > 0 and row["parameters"] > 0
    assert (
        len([f for f in result.findings if not f.startswith("Verdict: ")])
        == len(settings["targets"]) + 1
    )


def test_cost_columns_are_the_score_and_flop_counts_of_the_clip(written):
    """Per clip, over all layers and heads: (T N)^2 or T N^2 + N T^2 scores, 4 D FLOPs each;
    with the projections 8 L E^2 more per attention (L tokens of its sequences)."""
    result, _ = written
    s = result.settings
    T, N = s["frames"], (s["canvas_size"] // s["patch_size"]) ** 2
    E, H, layers = s["embed_dim"], s["num_heads"], s["num_layers"]
    D, L = E // H, T * N
    scores = {"full": L * L, "factorized": T * N * N + N * T * T}
    projections = {"full": 8 * L * E * E, "factorized": 2 * 8 * L * E * E}
    for row in result.rows:
        kind = row["attention"]
        assert row["scores / clip"] == layers * H * scores[kind]
        assert row["attention MFLOP / clip"] == pytest.approx(
            layers * H * 4 * D * scores[kind] / 1e6
        )
        expected = layers * (projections[kind] + H * 4 * D * scores[kind]) / 1e6
        assert row["with projections MFLOP / clip"] == pytest.approx(expected)


def test_figure_series_hold_a_test_clip_and_the_flops_curves(written):
    result, _ = written
    series, s = result.series, result.settings
    clip = torch.tensor(series["clip"])
    assert clip.shape == (s["frames"], s["canvas_size"], s["canvas_size"])
    assert 0 <= series["clip_digit"] <= 9 and clip.sum() > 0
    curves = series["flops_vs_frames"]
    assert curves["frames"] == s["flops_frames"]
    for masked, factorised in zip(curves["masked"], curves["factorized"], strict=True):
        assert masked > factorised
    assert set(series["accuracy"]) == {f"{r['target']}/{r['attention']}" for r in result.rows}


def test_same_seed_same_numbers(written):
    result, _ = written
    again = run_study("video-attention", size="tiny", out=None)
    assert [row["test accuracy"] for row in again.rows] == [
        row["test accuracy"] for row in result.rows
    ]
