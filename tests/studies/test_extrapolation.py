"""The extrapolation study end to end at its tiny size: files, record, table and determinism;
SmolLM2's part (the real model's losses, its RoPE rebuilt for each scaling)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.data import tokenizer_from_metadata
from qkv.models import GPT
from qkv.positional import RopeScaling
from qkv.studies import extrapolation, extrapolation_real, run_study
from qkv.studies.extrapolation_verdict import PAST, RATIO
from qkv.studies.sinks_real import SMOLLM2
from tests.generation.reference_models import qkv_model

LABELS = [*extrapolation.ENCODINGS[:4], *[f"rope + {kind}" for kind in extrapolation.SCALINGS],
          *extrapolation.ENCODINGS[4:]]  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory, smollm2, smollm2_file):
    """The tiny size, SmolLM2 included: the test run's loaded model stands in for a second load."""
    out = tmp_path_factory.mktemp("studies")
    loaded = (smollm2, tokenizer_from_metadata(smollm2_file.metadata))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(extrapolation_real, "load_smollm2", lambda: loaded)
        return run_study("extrapolation", size="tiny", out=out), out


def _trained(result):
    return [row for row in result.rows if row["model"] != SMOLLM2]


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
    assert result.settings["length_multiples"] == [1, 2]
    assert result.columns == ["model", "encoding", "L", "ppl@L", "ppl@2L", PAST, RATIO]
    assert [row["encoding"] for row in _trained(result)] == LABELS
    for row in _trained(result):
        assert row["L"] == L
        values = [row["ppl@L"], row["ppl@2L"], row[PAST]]
        assert all(math.isfinite(value) and value > 1 for value in values), row
        assert row[RATIO] == pytest.approx(row["ppl@2L"] / row["ppl@L"])
    assert result.findings and all(isinstance(text, str) for text in result.findings)


def test_smollm2_rows_score_plain_rope_and_each_scaling_past_its_length(written):
    result, _ = written
    real = [row for row in result.rows if row["model"] == SMOLLM2]
    assert [row["encoding"] for row in real] == [
        "rope",
        *[f"rope + {kind}" for kind in extrapolation.SCALINGS],
    ]
    L = result.settings["smollm2_length"]
    series = result.series["smollm2"]
    assert series["context"] == L == 32 and series["file_context"] == 8192
    for row in real:  # at L every scaling is plain RoPE: one ppl@L for all
        assert row["L"] == L and row["ppl@L"] == real[0]["ppl@L"]
        assert all(math.isfinite(row[key]) and row[key] > 1 for key in ("ppl@2L", PAST)), row
        assert row[RATIO] == pytest.approx(row["ppl@2L"] / row["ppl@L"])
    assert len({row[PAST] for row in real}) == len(real)  # each scaling changes the scores
    assert any(text.startswith(f"{SMOLLM2}, past L = 32") for text in result.findings)


def test_window_losses_are_the_cross_entropy_of_the_whole_logits(smollm2, smollm2_file):
    """Slices through the output head give the losses of the full (n, V) logits."""
    ids = torch.tensor(tokenizer_from_metadata(smollm2_file.metadata).encode(
        "The attention mass on the first token of a pretrained model.").ids)  # fmt: skip
    with torch.no_grad():
        logits = smollm2(ids[None]).logits[0, :-1]  # (n - 1, V)
    expected = F.cross_entropy(logits, ids[1:], reduction="none")
    torch.testing.assert_close(extrapolation_real.window_losses(smollm2, ids), expected)


def test_rope_scaled_is_the_model_built_with_that_scaling_and_restores_its_own():
    model = qkv_model("tiny-llama").eval()
    scaling = RopeScaling(kind="yarn", factor=2.0, original_max_positions=32)
    built = GPT(dataclasses.replace(model.config, rope_scaling=scaling)).eval()
    built.load_state_dict(model.state_dict())
    ids = torch.arange(1, 60).unsqueeze(0)  # past the 32 original positions
    with torch.no_grad():
        before = model(ids).logits
        with extrapolation_real.rope_scaled(model, scaling):
            scaled = model(ids).logits
        after = model(ids).logits
        expected = built(ids).logits
    torch.testing.assert_close(scaled, expected)
    assert not torch.allclose(scaled, before)
    assert torch.equal(after, before)


def test_scalings_at_the_training_length_are_plain_rope(written):
    # every scaling has factor 1 (or, dynamic, no growth) on windows of L tokens
    result, _ = written
    rows = {row["encoding"]: row for row in _trained(result)}
    for kind in extrapolation.SCALINGS:
        assert rows[f"rope + {kind}"]["ppl@L"] == pytest.approx(rows["rope"]["ppl@L"])


def test_same_seed_same_numbers(written, monkeypatch):
    result, _ = written
    monkeypatch.setattr(extrapolation_real, "load_smollm2", _missing)  # the trained part only
    again = run_study("extrapolation", size="tiny", out=None)
    assert again.series["perplexity"] == result.series["perplexity"]
    assert again.series["smollm2"] == {"missing": "not installed"}
    assert again.rows[-1] == {"model": f"{SMOLLM2}: not measured (not installed)"}


def _missing():
    raise FileNotFoundError("not installed")
