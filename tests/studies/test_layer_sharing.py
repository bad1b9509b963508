"""The layer-sharing study end to end at its tiny size, `share_layers` against one block applied
by hand N times, and the verdict rules on hand-made rows."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.models import GPT, GPTConfig
from qkv.studies import run_study
from qkv.studies.layer_sharing import share_layers, verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("layer-sharing", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_the_three_variants(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"layer-sharing.{suffix}").stat().st_size > 0
    assert json.loads((out / "layer-sharing.json").read_text())["size"] == "tiny"
    deep, shared, one = result.rows
    assert (deep["distinct blocks"], shared["distinct blocks"], one["distinct blocks"]) == (2, 1, 1)
    assert shared["parameters"] == one["parameters"] < deep["parameters"]
    assert shared["FLOPs per token"] == deep["FLOPs per token"] > one["FLOPs per token"]
    assert len(result.verdicts) == 2


def test_a_shared_model_applies_its_one_block_n_times():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=40, embed_dim=16, num_layers=3, num_heads=2, ffn_dim=32,
                       max_positions=16)  # fmt: skip
    model = share_layers(GPT(config)).eval()
    block = model.blocks[0]
    assert all(b is block for b in model.blocks)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        x = model.token_embedding(ids)
        for _ in range(3):  # the block by hand: RoPE positions 0 .. L - 1, causal
            x = block(x, positions=torch.arange(9))
        expected = model.lm_head(model.final_norm(x))
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-6)
    model(ids, labels=ids).loss.backward()  # the shared weight's gradient sums its 3 uses
    assert block.self_attn.q_proj.weight.grad.abs().sum() > 0


def _rows(deep, shared, one, spread=0.01):
    return [
        {"variant": label, "validation loss": loss, "loss range over seeds": spread}
        for label, loss in (("N blocks", deep), ("shared", shared), ("1 block", one))
    ]


@pytest.mark.parametrize(
    "losses, expected",
    [
        ((4.0, 4.1, 4.3), ["supported", "supported"]),
        ((4.0, 4.005, 4.3), ["mixed", "supported"]),
        ((4.1, 4.0, 3.9), ["not supported", "not supported"]),
    ],
)
def test_verdict_rules(losses, expected):
    assert [verdict.verdict for verdict in verdicts(_rows(*losses))] == expected
