"""The heads study end to end at its tiny size; its parameters, KV-cache bytes and FLOPs against
transformers' Llama and PyTorch's FLOP counter; the shared projections."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from qkv.models import GPT, GPTConfig
from qkv.studies import run_study
from qkv.studies.heads import SHARINGS, share_projections


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("heads", size="tiny", out=out), out


def _config(row, settings, vocab_size):
    return GPTConfig(
        vocab_size=vocab_size, embed_dim=row["H"] * row["head dim"],
        num_layers=settings["num_layers"], num_heads=row["H"], num_kv_heads=row["H_kv"],
        ffn_dim=row["ffn dim"], max_positions=settings["block_size"],
    )  # fmt: skip


def _llama(config: GPTConfig) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.embed_dim,
            intermediate_size=config.ffn_dim, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
            max_position_embeddings=config.max_positions, tie_word_embeddings=False,
        )
    )  # fmt: skip


def test_writes_json_markdown_figure_and_a_row_per_variant(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"heads.{suffix}").stat().st_size > 0
    assert "heads.md" in (out / "README.md").read_text()
    record = json.loads((out / "heads.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny" and record["machine"]["torch"]
    settings = result.settings
    expected = ["MHA", "GQA-2", "MQA", *[f"H={h}" for h in settings["head_counts"]], *SHARINGS]
    assert [row["variant"] for row in result.rows] == expected
    assert all(math.isfinite(row["validation loss"]) for row in result.rows)
    assert len([f for f in result.findings if not f.startswith("Verdict: ")]) == 3


def test_parameters_and_kv_cache_bytes_equal_transformers_llama(written):
    # the same sizes built as a Hugging Face Llama: its parameter count, and the elements its
    # cache holds for one token (times the bytes per element) against the table
    result, _ = written
    settings, vocab_size = result.settings, result.series["vocab_size"]
    for row in result.rows[: len(settings["kv_heads"])]:
        llama = _llama(_config(row, settings, vocab_size))
        assert sum(p.numel() for p in llama.parameters()) == row["parameters"]
        with torch.no_grad():
            cache = llama(torch.tensor([[1]]), use_cache=True).past_key_values
        elements = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
        assert elements * settings["kv_bytes_per_element"] == row["KV-cache bytes per token"]


def test_flops_per_token_equal_pytorchs_count_plus_the_score_products(written):
    result, _ = written
    settings, L = result.settings, result.settings["block_size"]
    for row in result.rows[: len(settings["kv_heads"])]:
        config = _config(row, settings, result.series["vocab_size"])
        with FlopCounterMode(display=False) as counter:
            GPT(config).eval()(torch.zeros(1, L, dtype=torch.long))
        # the counter sees the matrix products of the projections, FFN and head; add QK^T and
        # weights @ V: 2 products of L x L x D per head and layer, 2 FLOPs per multiply-add
        scores = config.num_layers * 2 * 2 * L * L * config.num_heads * config.head_dim
        assert (counter.get_total_flops() + scores) // L == row["FLOPs per token"]


def test_widened_ffn_gives_back_the_kv_parameters(written):
    result, _ = written
    kv = result.rows[: len(result.settings["kv_heads"])]
    mha = kv[0]["parameters"]
    for row in kv:
        E, layers = row["H"] * row["head dim"], result.settings["num_layers"]
        # rounding leaves at most half an FFN column (3 E parameters) per layer
        assert abs(row["parameters"] - mha) <= layers * 3 * E / 2, row
    heads = [row for row in result.rows if row["part"] == "heads at fixed width"]
    assert len({row["parameters"] for row in heads}) == 1  # H does not change the sizes
    assert len({row["KV-cache bytes per token"] for row in heads}) == 1


def test_shared_projections_tie_modules_and_drop_their_parameters():
    config = GPTConfig(vocab_size=50, embed_dim=16, num_layers=2, num_heads=4, ffn_dim=32)
    counts = {}
    for sharing in SHARINGS:
        torch.manual_seed(0)
        model = share_projections(GPT(config), sharing)
        counts[sharing] = sum(p.numel() for p in model.parameters())
        attention = model.blocks[0].self_attn
        assert (attention.k_proj is attention.q_proj) == (sharing != "separate")
        assert (attention.v_proj is attention.q_proj) == (sharing == "shared q/k/v")
    E2 = config.num_layers * 16 * 16
    assert counts["separate"] - counts["shared q/k"] == E2
    assert counts["separate"] - counts["shared q/k/v"] == 2 * E2
    # one projection: the attention sees q = k = v, so its output is softmax(q q^T) q W_o
    torch.manual_seed(0)
    model = share_projections(GPT(dataclasses.replace(config, position="none")), "shared q/k/v")
    attention = model.blocks[0].self_attn
    x = torch.randn(2, 5, 16)
    q = attention.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)  # (B, H, L, D)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    expected = attention.out_proj(expected.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(attention(x, causal=True), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="as many K/V heads"):
        share_projections(GPT(dataclasses.replace(config, num_kv_heads=2)), "shared q/k")
    with pytest.raises(ValueError, match="sharing: expected one of"):
        share_projections(GPT(config), "tied")
