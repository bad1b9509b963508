"""The head-symmetry study end to end at its tiny size, its three tools (identical heads, the
DropHead hook, the separation), and its verdict rules on hand-made rows."""

from __future__ import annotations

import json

import pytest
import torch

from qkv import inspect
from qkv.models import GPT, GPTConfig
from qkv.studies import run_study
from qkv.studies.head_symmetry import (
    APART,
    SAME,
    drop_heads,
    head_separation,
    identical_heads,
    verdicts,
)

CONFIG = GPTConfig(vocab_size=50, embed_dim=16, num_layers=2, num_heads=4, ffn_dim=32,
                   max_positions=16)  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("head-symmetry", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_a_row_per_variant(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"head-symmetry.{suffix}").stat().st_size > 0
    record = json.loads((out / "head-symmetry.json").read_text())
    assert record["size"] == "tiny" and len(record["verdicts"]) == 3
    separation = {row["variant"]: row["head separation"] for row in result.rows}
    assert separation["identical heads"] < SAME < APART < separation["identical heads + DropHead"]
    assert separation["random init"] > APART


def test_identical_heads_get_identical_gradients_and_random_ones_do_not():
    """The symmetry itself: equal heads, equal gradients per head (a step keeps them equal)."""
    torch.manual_seed(0)
    model = identical_heads(GPT(CONFIG))
    assert head_separation(model) == 0.0
    ids = torch.randint(0, 50, (3, 12))
    model(ids, labels=ids).loss.backward()
    for block in model.blocks:
        grad = block.self_attn.q_proj.weight.grad.view(4, 4, 16)  # (H, D, E)
        assert grad.abs().sum() > 0
        torch.testing.assert_close(grad, grad[:1].expand_as(grad), rtol=1e-5, atol=1e-7)
    assert head_separation(GPT(CONFIG)) > APART


def test_drop_head_zeroes_whole_heads_with_probability_p_and_scales_the_rest():
    torch.manual_seed(1)
    p = 0.25
    head_out = torch.rand(4000, 2, 4, 3) + 1.0  # (B, L, H, D), nothing zero
    dropped = drop_heads(p)(head_out, "blocks.0.attn.head_out")
    zero = dropped == 0
    assert torch.equal(zero, zero[:, :1, :, :1].expand_as(zero))  # a head of an example, whole
    share = float(zero[:, 0, :, 0].float().mean())
    assert abs(share - p) < 6 * (p * (1 - p) / 16000) ** 0.5  # binomial, 6 sigma
    torch.testing.assert_close(dropped[~zero], (head_out / (1 - p))[~zero])


def test_drop_head_through_inspect_hooks_breaks_the_tie_in_one_step():
    torch.manual_seed(2)
    model = identical_heads(GPT(CONFIG))
    ids = torch.randint(0, 50, (6, 12))
    with inspect.hooks(model, {"blocks.*.attn.head_out": drop_heads(0.5)}):
        model(ids, labels=ids).loss.backward()
    grad = model.blocks[0].self_attn.q_proj.weight.grad.view(4, 4, 16)
    assert (grad - grad[:1]).abs().max() > 1e-4 * grad.abs().max()


def _rows(tied=(0.0, 0.0), dropped=(0.2, 0.3), gap=0.1, spread=0.02):
    return [
        {"variant": "random init", "validation loss": 4.0, "loss range over seeds": spread,
         "head separation": 1.4, "separation range over seeds": [1.3, 1.5]},
        {"variant": "identical heads", "validation loss": 4.0 + gap,
         "loss range over seeds": spread, "head separation": sum(tied) / 2,
         "separation range over seeds": list(tied)},
        {"variant": "identical heads + DropHead", "validation loss": 4.0,
         "loss range over seeds": spread, "head separation": sum(dropped) / 2,
         "separation range over seeds": list(dropped)},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "rows, expected",
    [
        (_rows(), ["supported"] * 3),
        (_rows(tied=(0.0, 1e-3)), ["not supported", "supported", "supported"]),
        (_rows(gap=0.01), ["supported", "mixed", "supported"]),
        (_rows(gap=-0.1), ["supported", "not supported", "supported"]),
        (_rows(dropped=(1e-3, 0.3)), ["supported", "supported", "not supported"]),
    ],
)
def test_verdict_rules(rows, expected):
    assert [verdict.verdict for verdict in verdicts(rows)] == expected
