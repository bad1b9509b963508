"""The extrapolation study end to end at its tiny size: files, record, table and determinism."""

from __future__ import annotations

import json
import math

import pytest

from qkv.studies import extrapolation, run_study

LABELS = [*extrapolation.ENCODINGS[:4], *[f"rope + {kind}" for kind in extrapolation.SCALINGS],
          *extrapolation.ENCODINGS[4:]]  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("extrapolation", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"extrapolation.{suffix}").stat().st_size > 0
    assert "extrapolation.md" in (out / "README.md").read_text()
    record = json.loads((out / "extrapolation.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny"
    assert record["command"] and record["machine"]["torch"]
    assert record["settings"]["train_length"] == 16


def test_table_has_a_row_per_encoding_and_scaling_and_a_column_per_length(written):
    result, _ = written
    L = result.settings["train_length"]
    lengths = [L * multiple for multiple in result.settings["length_multiples"]]
    assert [row["encoding"] for row in result.rows] == LABELS
    for n in lengths:
        assert f"ppl@{n}" in result.columns
    for row in result.rows:
        values = [row[f"ppl@{n}"] for n in lengths] + [row[f"ppl@{lengths[-1]} past {L}"]]
        assert all(math.isfinite(value) and value > 1 for value in values), row
        ratio = row[f"ppl@{lengths[-1]} / ppl@{L}"]
        assert ratio == pytest.approx(row[f"ppl@{lengths[-1]}"] / row[f"ppl@{L}"])
    assert result.findings and all(isinstance(text, str) for text in result.findings)


def test_scalings_at_the_training_length_are_plain_rope(written):
    # every scaling has factor 1 (or, dynamic, no growth) on windows of L tokens
    result, _ = written
    L = result.settings["train_length"]
    rows = {row["encoding"]: row for row in result.rows}
    for kind in extrapolation.SCALINGS:
        assert rows[f"rope + {kind}"][f"ppl@{L}"] == pytest.approx(rows["rope"][f"ppl@{L}"])


def test_same_seed_same_numbers(written):
    result, _ = written
    again = run_study("extrapolation", size="tiny", out=None)
    assert again.series["perplexity"] == result.series["perplexity"]
