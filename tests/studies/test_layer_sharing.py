"""The layer-sharing study end to end at its tiny size, `share_layers` against one block applied
by hand N times, and the verdict rules on hand-made rows."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.generation import generate
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.studies import run_study
from qkv.studies.layer_sharing import MODELS, share_layers, share_stack_layers, verdicts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("layer-sharing", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_the_three_variants_of_each_model(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"layer-sharing.{suffix}").stat().st_size > 0
    assert json.loads((out / "layer-sharing.json").read_text())["size"] == "tiny"
    for model in MODELS:
        deep, shared, one = [row for row in result.rows if row["model"] == model]
        assert [row["distinct blocks"] for row in (deep, shared, one)] == [2, 1, 1]
        assert [row["layers applied"] for row in (deep, shared, one)] == [2, 2, 1]
        assert shared["parameters"] == one["parameters"] < deep["parameters"]
    gpt = [row for row in result.rows if row["model"] == "GPT"]
    assert gpt[1]["FLOPs per token"] == gpt[0]["FLOPs per token"] > gpt[2]["FLOPs per token"]
    pair = [row for row in result.rows if row["model"] == "encoder-decoder"]
    assert all(0 <= row["exact match"] <= 1 for row in pair)
    assert len(result.verdicts) == 4


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
    """The same three losses for each model."""
    return [
        {"model": model, "variant": label, "validation loss": loss,
         "loss range over seeds": spread}
        for model in MODELS
        for label, loss in (("N blocks", deep), ("shared", shared), ("1 block", one))
    ]  # fmt: skip


@pytest.mark.parametrize(
    "losses, expected",
    [
        ((4.0, 4.1, 4.3), ["supported", "supported"]),
        ((4.0, 4.005, 4.3), ["mixed", "supported"]),
        ((4.1, 4.0, 3.9), ["not supported", "not supported"]),
    ],
)
def test_verdict_rules(losses, expected):
    found = verdicts(_rows(*losses))
    assert [verdict.verdict for verdict in found] == expected * 2
    assert [verdict.claim.split(":")[0] for verdict in found] == [m for m in MODELS for _ in "ab"]


def test_an_encoder_decoder_shares_within_each_stack_and_decodes_per_layer_caches():
    """share_stack_layers: one block per stack, fewer parameters; greedy decoding with the
    decoder's KV cache (a slot per layer, one block) picks the argmax of the teacher-forced
    logits of its own tokens, recomputed without a cache."""
    torch.manual_seed(0)
    config = TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, embed_dim=16, num_heads=2,
                               num_encoder_layers=3, num_decoder_layers=3, ffn_dim=32,
                               dropout=0.0)  # fmt: skip
    model = share_stack_layers(Transformer(config)).eval()
    for stack in (model.encoder, model.decoder):
        assert all(block is stack.blocks[0] for block in stack.blocks)
    separate = sum(p.numel() for p in Transformer(config).parameters())
    assert sum(p.numel() for p in model.parameters()) < separate
    source = torch.randint(3, 30, (2, 7))
    tokens = generate(model, source, max_new_tokens=6, eos_token_id=None)  # (2, 1 + 6), cached
    with torch.no_grad():  # every step again from scratch, no cache: the same argmax
        logits = model(source, decoder_input_ids=tokens[:, :-1]).logits  # (2, 6, V)
    assert torch.equal(logits.argmax(-1), tokens[:, 1:])
