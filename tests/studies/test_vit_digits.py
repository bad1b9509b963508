"""The vit-digits study end to end at its tiny size: files, record, table, maps and determinism;
its default settings are `qkv train vit`'s defaults."""

import dataclasses
import json

import pytest
import torch

from qkv.studies import run_study, vit_digits
from qkv.training.tasks import VitOptions, VitTask


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("studies")
    return run_study("vit-digits", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"vit-digits.{suffix}").stat().st_size > 0
    assert "vit-digits.md" in (out / "README.md").read_text()
    record = json.loads((out / "vit-digits.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny" and record["machine"]["torch"]
    assert record["settings"]["steps"] == 3


def test_table_has_one_row_per_variant_with_accuracies_and_times(written):
    result, _ = written
    variants = result.settings["variants"]
    assert [[row["pooling"], row["position"]] for row in result.rows] == variants
    for row in result.rows:
        assert 0.0 <= row["test accuracy"] <= 1.0 and row["training s"] > 0
        wrong, total = map(int, row["test errors"].split(" of "))
        assert wrong == round((1 - row["test accuracy"]) * total)
    assert len([f for f in result.findings if not f.startswith("Verdict: ")]) == 3 and all(
        isinstance(text, str) for text in result.findings
    )


def test_maps_are_distributions_over_the_patches_of_the_shown_digits(written):
    result, _ = written
    series = result.series
    shown = result.settings["digits_shown"]
    assert series["labels"] == list(range(shown))  # one digit of each class, in order
    grid = 8 // result.settings["patch_size"]
    for label, maps in series["maps"].items():
        maps = torch.tensor(maps)
        assert maps.shape == (shown, grid, grid) and torch.all(maps >= 0)
        assert torch.all(maps.sum(dim=(1, 2)) <= 1 + 1e-5), label
        assert 0.0 <= series["ink_share"][label] <= 1.0


def test_default_settings_are_the_train_commands_defaults():
    default = vit_digits.SIZES["default"]
    for field in dataclasses.fields(VitOptions):
        if field.name not in ("pooling", "position"):
            assert default[field.name] == field.default, field.name
    for name, value in VitTask.training_defaults.items():
        assert default[name] == value
    assert default["variants"][0] == ["cls", "learned"]


def test_same_seed_same_numbers(written):
    result, _ = written
    again = run_study("vit-digits", size="tiny", out=None)
    assert [row["test accuracy"] for row in again.rows] == [
        row["test accuracy"] for row in result.rows
    ]
    assert again.series["maps"] == result.series["maps"]
