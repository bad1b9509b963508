"""The before-transformer study end to end at its tiny size: files, table, bins and the two
alignment maps."""

from __future__ import annotations

import json

import pytest

from qkv.studies import before_transformer, run_study


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("before-transformer", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"before-transformer.{suffix}").stat().st_size > 0
    assert "before-transformer.md" in (out / "README.md").read_text()
    record = json.loads((out / "before-transformer.json").read_text())
    assert record["size"] == "tiny" and record["settings"]["train_steps"] == 3


def test_table_has_a_row_per_model_and_the_bins_add_up(written):
    result, _ = written
    series = result.series
    names = before_transformer.MODELS
    assert [row["model"] for row in result.rows] == [before_transformer.LABELS[n] for n in names]
    assert series["bins"] == ["<=7", ">=8"]
    counts = series["bin_counts"]
    assert sum(counts) == result.settings["num_test"] and all(counts)
    for row in result.rows:
        binned = [row[f"EM src {label}"] for label in series["bins"]]
        assert all(0.0 <= value <= 1.0 for value in binned)
        overall = sum(value * count for value, count in zip(binned, counts, strict=True))
        assert row["exact match"] == pytest.approx(overall / sum(counts))
        assert row["parameters"] > 0 and row["train s"] > 0 and row["final loss"] > 0
    assert (
        len([f for f in result.findings if not f.startswith("Verdict: ")]) == 4
        and "GRU, fixed context" in [f for f in result.findings if not f.startswith("Verdict: ")][0]
    )


def test_alignment_maps_are_distributions_over_the_source_tokens(written):
    result, _ = written
    alignment = result.series["alignment"]
    S = len(alignment["source_tokens"])
    assert S > 0 and alignment["source"] and alignment["reference"]
    for name in ("additive", "transformer"):
        part = alignment["maps"][name]
        assert len(part["weights"]) == len(part["tokens"])
        for row in part["weights"]:
            assert len(row) == S and sum(row) == pytest.approx(1.0, abs=1e-3)
