"""The flash-io study end to end at its tiny size: files, record, table, sweep series, figure
from the JSON alone, and determinism. The counted column is the tiled loop's own traffic
(`count_tile_traffic`); the modelled columns come from `qkv.analysis.cost.flash_io`, checked
against literal replays of the paper's algorithms in tests/analysis/test_flash_io.py."""

from __future__ import annotations

import json

import pytest

from qkv.analysis.cost.flash_io import paper_block_sizes
from qkv.studies import flash_io, read_result, run_study


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("flash-io", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"flash-io.{suffix}").stat().st_size > 0
    assert "flash-io.md" in (out / "README.md").read_text()
    record = json.loads((out / "flash-io.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny"
    assert record["command"] and record["machine"]["torch"]
    assert record["settings"] == flash_io.SIZES["tiny"]


def test_table_counts_equal_the_model_at_the_papers_blocks(written):
    result, _ = written
    settings = result.settings
    assert len(result.rows) == len(settings["lengths"]) * len(settings["sram_elements"]) * 2
    for row in result.rows:
        assert (row["B_r"], row["B_c"]) == paper_block_sizes(
            sram_elements=row["M"], head_dim=row["d"]
        )
        assert row[flash_io.COUNTED] == row[flash_io.MODEL]
        assert row["counted / model"] == 1.0
        assert 0 < row[flash_io.Q_READS] < row[flash_io.COUNTED]
    by_shape = {(r["N"], r["M"], r["causal"]): r[flash_io.COUNTED] for r in result.rows}
    for (length, sram, causal), counted in by_shape.items():
        if causal:  # skipped tiles move nothing
            assert counted < by_shape[(length, sram, False)]
    assert "= 1 exactly" in [f for f in result.findings if not f.startswith("Verdict: ")][0]


def test_breakdown_shows_k_and_v_read_once_per_query_block(written):
    result, _ = written
    breakdown = result.series["breakdown"]
    shape, counted = breakdown["shape"], breakdown["qkv counted"]
    assert shape["N"] == max(result.settings["lengths"])
    query_blocks = -(-shape["N"] // shape["B_r"])
    assert counted["k"] == counted["v"] == query_blocks * shape["N"] * shape["d"] * 4
    assert set(breakdown["standard"]) == {"q", "k", "v", "s", "p", "o"}


def test_sweep_series_cover_every_length_and_block(written):
    result, _ = written
    sweep, settings = result.series["sweep"], result.settings
    assert sweep["blocks"] == settings["sweep_blocks"]
    d = settings["head_dim"]
    for index, length in enumerate(sweep["lengths"]):
        paper, counted = sweep["Algorithm 1"][index], sweep["qkv counted"][index]
        assert paper == sorted(paper, reverse=True)  # larger K/V blocks: fewer passes
        assert counted == sweep["qkv model"][index]  # every tiny length is counted
        for block, bound in zip(sweep["blocks"], sweep["theorem 2"][index], strict=True):
            assert (bound is None) == (not d <= 4 * d * block <= length * d)


def test_figure_is_drawn_from_the_json_alone(written):
    _, out = written
    figure = flash_io.figure(read_result(out / "flash-io.json"))
    assert len(figure.axes) == 2
    assert figure.axes[0].get_xscale() == "log" and figure.axes[0].get_yscale() == "log"


def test_same_seed_same_numbers(written):
    result, _ = written
    again = run_study("flash-io", size="tiny", out=None)
    assert again.rows == result.rows and again.series == result.series
