"""`qkv cost --shares`, `--source-length/--target-length` and `--generate`: attention's share
of a block and its crossover length, an encoder-decoder's source and target lengths, generation
with and without a KV cache. Every figure against a direct count with `FlopCounterMode` on tiny
qkv models (attention on the eager `reference` backend: its Q K^T and weights @ V are the only
batched products, aten.bmm, of a block), and the command's output."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.estimate import cost_report
from qkv.analysis.cost.layout import layout_of
from qkv.analysis.cost.scaling import (
    attention_shares,
    crossover_length,
    encoder_decoder_flops,
    generation_flops,
)
from qkv.generation import generate, make_cache
from qkv.layers import MultiHeadAttention
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig
from tests.analysis.cost.command import run_cost


def _reference(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.backend = "reference"
    return model.eval()


def _counts(run) -> tuple[int, dict[str, dict[str, int]]]:
    """Total FLOPs and, per module, FLOPs per operator ("aten.bmm", "aten.mm", ...)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    per_module = {
        module: {str(op): flops for op, flops in ops.items()}
        for module, ops in counter.get_flop_counts().items()
    }
    return counter.get_total_flops(), per_module


def _scores_and_rest(ops: dict[str, int]) -> tuple[int, int]:
    """Batched products (the scores) and the others (projections, FFN) of one module."""
    scores = ops.get("aten.bmm", 0)
    return scores, sum(ops.values()) - scores


# --- attention's share and the crossover -------------------------------------------------------


@pytest.mark.parametrize(("preset", "E"), [("gpt2", 768), ("transformer-base", 512),
                                           ("bert-base-uncased", 768)])  # fmt: skip
def test_the_standard_block_crosses_over_at_6_E(preset, E):
    """H D = E, H_kv = H, F = 4E, two FFN matrices: (4E^2 + 4E^2 + 16E^2) / 4E = 6E."""
    shares = attention_shares(preset)
    assert shares.crossover_length == 6 * E and shares.crossover_per_embed_dim == 6


def test_llama_2_7b_crosses_over_at_2_E_plus_1_5_F():
    """MHA, SwiGLU (3 matrices), F = 11008: (8 E^2 + 6 E F) / 4E = 2E + 1.5F = 24,704."""
    shares = attention_shares("llama-2-7b")
    assert shares.crossover_length == 2 * 4096 + 1.5 * 11008 == 24_704
    for row in shares.shares:
        assert row.scores_share == pytest.approx(row.length / (row.length + 24_704))
    assert [row.length for row in shares.shares] == [512, 2048, 8192, 32768, 131072]


def test_gqa_shrinks_the_rest_and_so_the_crossover():
    """Llama-2-70B: H_kv = 8 of 64, F = 28672: (4 E^2 + 4 E^2 / 8 + 6 E F) / 4E."""
    layout = layout_of(GPTConfig.from_name("llama-2-70b"))
    E, F = 8192, 28672
    expected = Fraction(4 * E * E + 4 * E * E // 8 + 6 * E * F, 4 * E)
    assert crossover_length(layout.attention, layout.decoder.ffn) == expected


def test_shares_equal_flop_counter_mode_on_one_block():
    """Block 0 of a tiny GPT-2 (biases) and a tiny Llama (GQA, SwiGLU) at a few lengths."""
    for config in (GPTConfig.from_name("tiny-gpt2"), GPTConfig.from_name("tiny-llama")):
        model = _reference(GPT(config))
        shares = attention_shares(config, lengths=(3, 16, 40))
        for row in shares.shares:
            ids = torch.randint(0, 100, (1, row.length))
            _, per_module = _counts(lambda model=model, ids=ids: model(ids))
            scores, rest = _scores_and_rest(per_module["GPT.blocks.0"])
            assert scores == row.score_flops
            assert rest == row.projection_flops + row.ffn_flops


@pytest.mark.parametrize(("config", "crossover"), [
    (GPTConfig.from_name("tiny-gpt2", max_positions=192), 192),  # 6E, E = 32
    (GPTConfig.from_name("tiny-llama"), 144),  # (4096 + 2048 + 12288) / 128: GQA, SwiGLU
])  # fmt: skip
def test_at_the_crossover_the_scores_cost_what_the_rest_of_the_block_costs(config, crossover):
    assert attention_shares(config).crossover_length == crossover
    model = _reference(GPT(config))
    ids = torch.randint(0, 100, (1, crossover))
    _, per_module = _counts(lambda: model(ids))
    scores, rest = _scores_and_rest(per_module["GPT.blocks.0"])
    assert scores == rest
    assert attention_shares(config, lengths=(crossover,)).shares[0].scores_share == 0.5


# --- source and target lengths -----------------------------------------------------------------


def _transformer() -> Transformer:
    return _reference(Transformer(TransformerConfig.from_name("transformer-tiny", dropout=0.0)))


def _encoder_decoder_counts(model: Transformer, S: int, T: int):
    source, target = torch.randint(3, 100, (1, S)), torch.randint(3, 100, (1, T))
    return _counts(lambda: model(source, decoder_input_ids=target))


@pytest.mark.parametrize(("S", "T"), [(6, 4), (3, 9), (12, 12)])
def test_encoder_decoder_flops_equal_flop_counter_mode(S, T):
    total, per_module = _encoder_decoder_counts(_transformer(), S, T)
    flops = encoder_decoder_flops("transformer-tiny", source_length=S, target_length=T)
    assert flops.forward_flops == total
    assert flops.encoder_flops == sum(per_module["Transformer.encoder"].values())
    assert flops.decoder_flops == sum(per_module["Transformer.decoder"].values())
    encoder = _scores_and_rest(per_module["Transformer.encoder.blocks.0.self_attn"])
    assert encoder == (flops.encoder_self_scores, flops.encoder_projections)
    own = _scores_and_rest(per_module["Transformer.decoder.blocks.0.self_attn"])
    assert own == (flops.decoder_self_scores, flops.decoder_self_projections)
    cross = _scores_and_rest(per_module["Transformer.decoder.blocks.0.cross_attn"])
    assert cross == (flops.cross_scores, flops.cross_projections)
    assert flops.decoder_ffn == sum(per_module["Transformer.decoder.blocks.0.ffn"].values())
    if S == T:  # the report's own count, source and target both `context` long
        assert flops.forward_flops == cost_report("transformer-tiny", context=S).flops_per_sequence


def test_doubling_the_source_multiplies_the_scores_by_4_2_and_1():
    """Per block: encoder self-attention 4x (S^2), cross-attention 2x (S T), decoder
    self-attention 1x (T^2); counted, then from the formulas at the base model's sizes."""
    model = _transformer()
    blocks = {
        "encoder": "Transformer.encoder.blocks.0.self_attn",
        "cross": "Transformer.decoder.blocks.0.cross_attn",
        "decoder": "Transformer.decoder.blocks.0.self_attn",
    }
    measured = []
    for S in (5, 10):
        _, per_module = _encoder_decoder_counts(model, S, 7)
        measured.append({k: _scores_and_rest(per_module[v])[0] for k, v in blocks.items()})
    assert {k: measured[1][k] / measured[0][k] for k in blocks} == {
        "encoder": 4, "cross": 2, "decoder": 1
    }  # fmt: skip
    short, long = (
        encoder_decoder_flops("transformer-base", source_length=S, target_length=256)
        for S in (1024, 2048)
    )
    assert long.encoder_self_scores == 4 * short.encoder_self_scores
    assert long.cross_scores == 2 * short.cross_scores
    assert long.decoder_self_scores == short.decoder_self_scores


def test_source_and_target_lengths_need_an_encoder_decoder():
    with pytest.raises(ValueError, match="^model: .*needs? an encoder-decoder"):
        encoder_decoder_flops("gpt2", source_length=8, target_length=8)
    with pytest.raises(ValueError, match="^source_length: "):
        encoder_decoder_flops("transformer-tiny", source_length=0, target_length=8)


# --- generation with and without a KV cache ----------------------------------------------------


@pytest.mark.parametrize(("preset", "P", "N"), [("tiny-gpt2", 5, 4), ("tiny-llama-mqa", 7, 3)])
def test_cached_generation_equals_generate_counted(preset, P, N):
    """`generate` prefills the prompt (logits of its last position) and steps N - 1 times."""
    model = _reference(GPT(GPTConfig.from_name(preset)))
    ids = torch.randint(0, 100, (1, P))
    total, _ = _counts(lambda: generate(model, ids, max_new_tokens=N))
    flops = generation_flops(preset, prompt_length=P, new_tokens=N)
    assert flops.cached_flops == total == flops.prefill_flops + flops.step_flops


def test_both_ways_equal_their_forwards_counted():
    """With the cache: the prompt, then one token at a time; without: every prefix whole."""
    model = _reference(GPT(GPTConfig.from_name("tiny-gpt2")))
    P, N = 6, 5
    ids = torch.randint(0, 100, (1, P + N))
    cache = make_cache(model, batch=1, max_length=P + N)
    prefill, _ = _counts(
        lambda: model(ids[:, :P], position_ids=torch.arange(P), cache=cache, logits_to_keep=1)
    )
    steps = 0
    for p in range(P, P + N - 1):
        new, at = ids[:, p : p + 1], torch.tensor([p])
        steps += _counts(lambda new=new, at=at: model(new, position_ids=at, cache=cache))[0]
    recomputed = sum(
        _counts(lambda n=n: model(ids[:, : P + n], logits_to_keep=1))[0] for n in range(N)
    )
    flops = generation_flops("tiny-gpt2", prompt_length=P, new_tokens=N)
    assert (flops.prefill_flops, flops.step_flops) == (prefill, steps)
    assert flops.recomputed_flops == recomputed
    assert flops.ratio == recomputed / (prefill + steps) > 1


def test_one_new_token_costs_the_same_either_way_and_the_gap_grows_with_n():
    one = generation_flops("llama-2-7b", prompt_length=1024, new_tokens=1)
    assert one.cached_flops == one.recomputed_flops and one.ratio == 1
    ratios = [generation_flops("llama-2-7b", prompt_length=1024, new_tokens=n).ratio
              for n in (16, 256, 1024)]  # fmt: skip
    assert ratios == sorted(ratios) and ratios[-1] > 500


def test_generation_needs_a_decoder_only_model():
    with pytest.raises(ValueError, match="^model: --generate needs a decoder-only"):
        generation_flops("transformer-tiny", prompt_length=4, new_tokens=2)
    with pytest.raises(ValueError, match="^new_tokens: "):
        generation_flops("gpt2", prompt_length=4, new_tokens=0)


# --- the command -------------------------------------------------------------------------------


def test_command_prints_the_shares_under_the_column(capsys):
    code, out, _ = run_cost(capsys, "llama-2-7b", "--shares")
    assert code == 0 and "6,738,415,616" in out
    assert "projections + FFN at L = 24,704.0 = 6.03 E (E = 4096)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["512"][-2:] == ["2.0%", "34.5%"] and rows["128K"][-2] == "84.1%"


def test_command_prints_source_and_target_lengths(capsys):
    argv = ["transformer-base", "--source-length", "1024", "--target-length", "256"]
    code, out, _ = run_cost(capsys, *argv)
    assert code == 0 and "1024 source x 256 target tokens" in out
    flops = encoder_decoder_flops("transformer-base", source_length=1024, target_length=256)
    assert f"{flops.forward_flops / 1e9:.3g} GFLOP" in out.splitlines()[-1]


def test_command_prints_generation_both_ways_and_the_ratio(capsys):
    code, out, _ = run_cost(capsys, "llama-2-7b", "--context", "1024", "--generate", "256")
    flops = generation_flops("llama-2-7b", prompt_length=1024, new_tokens=256)
    assert code == 0 and "255 one-token steps" in out
    assert out.rstrip().endswith(f"without / with the cache: {flops.ratio:.3g}x")


def test_command_json_holds_the_report_and_every_section(capsys):
    argv = ["tiny-gpt2", "--context", "8", "--shares", "--generate", "3", "--json"]
    code, out, _ = run_cost(capsys, *argv)
    assert code == 0
    [document] = json.loads(out)
    report = dataclasses.asdict(cost_report("tiny-gpt2", context=8))
    assert {k: document[k] for k in report} == json.loads(json.dumps(report))
    generation = generation_flops("tiny-gpt2", prompt_length=8, new_tokens=3)
    assert document["generation"] == dataclasses.asdict(generation)
    assert document["shares"]["crossover_length"] == 6 * 32


@pytest.mark.parametrize(("argv", "named"), [
    (["gpt2", "--source-length", "8"], "model"),
    (["transformer-tiny", "--generate", "2"], "model"),
    (["gpt2", "--generate", "0"], "new_tokens"),
    (["--shares"], "model"),
])  # fmt: skip
def test_command_errors_name_the_argument(capsys, argv, named):
    code, out, err = run_cost(capsys, *argv)
    assert code == 1 and out == ""
    assert err.startswith(f"qkv cost: error: {named}: ")


def test_the_report_column_shows_the_crossover(capsys):
    for preset in ("llama-2-7b", "gpt2", "transformer-tiny", "vit-base-16"):
        report = cost_report(preset)
        assert report.attention_crossover_length == attention_shares(preset).crossover_length
    code, out, _ = run_cost(capsys, "llama-2-7b", "gpt2")
    row = next(line for line in out.splitlines() if "scores = rest of block at" in line)
    assert code == 0
    assert " ".join(row.split("at", 1)[1].split()) == "L = 24,704 (6.03 E) L = 4,608 (6 E)"
