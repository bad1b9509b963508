"""The NumPy-lab study end to end at its tiny size: files, table, errors at float64 rounding,
and the helpers it checks with (its masks, its nn.MultiheadAttention copy, its finite
differences) against outside references."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from qkv.analysis.numpy_lab import multi_head_forward
from qkv.studies import numpy_lab, run_study


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("numpy-lab", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"numpy-lab.{suffix}").stat().st_size > 0
    assert "numpy-lab.md" in (out / "README.md").read_text()
    record = json.loads((out / "numpy-lab.json").read_text())
    assert record["size"] == "tiny" and record["columns"] == numpy_lab.COLUMNS
    assert len(record["rows"]) == 2 * len(record["settings"]["cases"])
    assert len([f for f in record["findings"] if not f.startswith("Verdict: ")]) == 3


def test_every_quantity_matches_pytorch_to_float64_rounding(written):
    result, _ = written
    for case, modules in result.series["errors"].items():
        assert set(modules["attention"]) == {"output", "dq", "dk", "dv"}
        assert set(modules["multi-head"]) == {"output", "dx", *numpy_lab.GRADIENT_NAMES.values()}
        for module, found in modules.items():
            for name, error in found.items():
                assert 0 <= error < 1e-12, (case, module, name)
    for row in result.rows:
        assert row["finite differences (rel.)"] < 1e-6
        assert row["numpy forward (ms)"] > 0 and row["torch forward (ms)"] > 0
        ratio = row["numpy forward (ms)"] / row["torch forward (ms)"]
        assert row["numpy / torch"] == pytest.approx(ratio)
        assert (row["weight gradients"] is None) == (row["module"] == "attention")


def test_padding_mask_and_torch_module_agree_with_the_lab():
    rng = np.random.default_rng(0)
    mask = numpy_lab._mask("padding", 3, 6, rng)  # (B, 1, 1, L)
    assert mask.shape == (3, 1, 1, 6) and mask[0].all() and mask[..., 0].all()
    weights = numpy_lab._random_weights(rng, 8)
    x = rng.standard_normal((3, 6, 8))
    module = numpy_lab._torch_module(weights, 2, torch.float64)
    expected = numpy_lab._torch_forward(module, torch.from_numpy(x), mask)
    got, _ = multi_head_forward(x, weights=weights, num_heads=2, mask=mask)
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="cases"):
        numpy_lab._mask("banded", 1, 4, rng)


def test_finite_differences_measure_a_wrong_gradient():
    """f(a) = sum(sin(a)): cos is the gradient; a wrong one (sin) is caught."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4))
    settings = {"fd_probes": 5, "fd_step": 1e-6}

    def loss(arrays):
        return float(np.sin(arrays[0]).sum())

    right = numpy_lab._finite_difference_error(loss, [a], [np.cos(a)], rng, settings)
    wrong = numpy_lab._finite_difference_error(loss, [a], [np.sin(a)], rng, settings)
    assert right < 1e-8 and wrong > 0.1 and math.isfinite(wrong)
