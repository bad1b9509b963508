"""The norms study end to end at its tiny size; its model against PyTorch's Transformer layers
(post-norm, pre-norm, and the same layers without residuals); its unigram loss against
torch.distributions; its handling of a run whose loss stops being finite."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import EncoderBlock
from qkv.studies import run_study
from qkv.studies.norms import NORMS, CausalLM, _final, _train, _unigram_loss

V, E, H, L = 40, 16, 2, 6


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("norms", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_the_three_parts(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"norms.{suffix}").stat().st_size > 0
    assert "norms.md" in (out / "README.md").read_text()
    record = json.loads((out / "norms.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny" and record["machine"]["torch"]
    settings = result.settings
    parts = [row["part"] for row in result.rows]
    assert parts == ["padding"] * 4 + ["residuals"] * 2 * len(settings["depths"]) + ["warm-up"] * 4
    assert len([f for f in result.findings if not f.startswith("Verdict: ")]) == 4
    for label, outcome in result.series["stability"].items():
        assert len(outcome["curves"]) == settings["num_seeds"], label
        assert 0 <= outcome["diverged"] <= settings["num_seeds"]


def test_only_batchnorm_depends_on_padding_and_batchmates(written):
    changes = written[0].series["padding"]["changes"]
    assert list(changes) == list(NORMS)
    unmasked, masked, layer_norm, rms_norm = (changes[name] for name in NORMS)
    assert unmasked["more_padding"] > 1e-2  # the padding enters BatchNorm's statistics
    for change in (masked, layer_norm, rms_norm):
        assert change["more_padding"] < 1e-5
    for change in (unmasked, masked):  # real batchmates always do
        assert change["other_batchmates"] > 1e-2
    for change in (layer_norm, rms_norm):
        assert change["other_batchmates"] < 1e-5
    padding = written[0].series["padding"]
    assert 0 < padding["pad_fraction"] < 1 and len(padding["mean_real"]) == 384  # MiniLM's E


def _torch_layers(norm_first: bool, count: int = 2) -> list[nn.TransformerEncoderLayer]:
    torch.manual_seed(7)
    return [
        nn.TransformerEncoderLayer(E, H, 4 * E, dropout=0.0, activation="gelu",
                                   batch_first=True, norm_first=norm_first).eval()
        for _ in range(count)
    ]  # fmt: skip


def _model_from(layers, arrangement: str) -> CausalLM:
    model = CausalLM(vocab_size=V, embed_dim=E, num_heads=H, num_layers=len(layers),
                     block_size=L, arrangement=arrangement).eval()  # fmt: skip
    for block, layer in zip(model.blocks, layers, strict=True):
        block.load_state_dict(EncoderBlock.from_torch(layer).state_dict())
    return model


@pytest.mark.parametrize("arrangement", ["post-norm", "pre-norm", "no residual"])
def test_causal_lm_equals_pytorch_layers(arrangement):
    layers = _torch_layers(norm_first=arrangement != "post-norm")
    model = _model_from(layers, arrangement)
    ids = torch.randint(V, (3, L), generator=torch.Generator().manual_seed(1))
    blocked = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)  # PyTorch: True = masked
    x = model.token_embedding(ids) + model.position_embedding(torch.arange(L))
    with torch.no_grad():
        for layer in layers:
            if arrangement == "no residual":  # the pre-norm layer's two sub-layers, no "Add"
                h = layer.norm1(x)
                h = layer.self_attn(h, h, h, attn_mask=blocked, need_weights=False)[0]
                x = layer.linear2(F.gelu(layer.linear1(layer.norm2(h))))
            else:
                x = layer(x, src_mask=blocked)
        expected = model.lm_head(model.final_norm(x))
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)
    assert isinstance(model.final_norm, nn.Identity) == (arrangement == "post-norm")


def test_unigram_loss_is_the_entropy_of_the_token_frequencies():
    blocks = torch.tensor([[0, 1, 1, 2], [2, 2, 2, 3]])
    counts = torch.tensor([1.0, 2.0, 4.0, 1.0, 0.0], dtype=torch.float64)
    expected = torch.distributions.Categorical(probs=counts / counts.sum()).entropy()
    assert _unigram_loss(blocks, vocab_size=5) == pytest.approx(float(expected), rel=1e-12)


def test_a_run_whose_loss_is_not_finite_stops_and_counts_as_diverged():
    model = CausalLM(vocab_size=V, embed_dim=E, num_heads=H, num_layers=1, block_size=L,
                     arrangement="pre-norm")  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.fill_(math.inf)
    blocks = torch.randint(V, (8, L), generator=torch.Generator().manual_seed(2))
    losses, gradients = _train(model, blocks, torch.zeros(3, 2, dtype=torch.long),
                               learning_rate=1e-3, warmup_steps=0)  # fmt: skip
    assert losses == [None, None, None] and gradients == []
    assert _final(losses, tail=2) == math.inf
    assert _final([3.0, 2.0, 1.0], tail=2) == pytest.approx(1.5)
