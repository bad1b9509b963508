"""`qkv cost` for T5 (Raffel et al. 2020): parameters against qkv's T5Transformer built from
every preset, against `t5_parameter_count` and against transformers' T5ForConditionalGeneration
of the same sizes; forward, source/target and decoding FLOPs against `FlopCounterMode`; the
caches a decoding step fills; a saved checkpoint; the command's column."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.estimate import cost_report
from qkv.analysis.cost.format import format_report
from qkv.analysis.cost.scaling import encoder_decoder_flops
from qkv.attention import attention
from qkv.models import T5Config, T5Transformer, save
from qkv.models.t5_config import T5_PRESETS, t5_parameter_count
from tests.analysis.cost.command import run_cost

VARIANTS = {  # every branch of the formula beyond the presets
    "relu-untied": T5Config.from_name("t5-tiny", tie_word_embeddings=False),
    "gated-tied": T5Config.from_name("t5-tiny", feed_forward_proj="gated-gelu"),
    "deeper-decoder": T5Config.from_name("t5-tiny", num_decoder_layers=3, d_kv=4),
    "more-buckets": T5Config.from_name("t5-tiny", relative_attention_num_buckets=16),
}


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is yielded once


def _counted(run) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return counter.get_total_flops()


@pytest.fixture
def tiny(monkeypatch):
    """t5-tiny in eval mode, its attention on the eager `reference` backend, whose matmuls
    FlopCounterMode sees (it does not count PyTorch's fused CPU attention kernel)."""
    monkeypatch.setattr(
        "qkv.models.t5.attention", functools.partial(attention, backend="reference")
    )
    torch.manual_seed(0)
    return T5Transformer(T5Config.from_name("t5-tiny")).eval()


# --- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [*T5_PRESETS, *VARIANTS.values()], ids=[*T5_PRESETS, *VARIANTS])
def test_parameters_equal_the_built_model_and_t5_parameter_count(config):
    """Built on the meta device: shapes only (t5-base has 223M parameters)."""
    resolved = T5Config.from_name(config) if isinstance(config, str) else config
    with torch.device("meta"):
        model = T5Transformer(resolved)
    report = cost_report(config)
    assert report.parameters == _parameters(model) == t5_parameter_count(resolved)
    assert report.family == "encoder-decoder"


def test_t5_small_is_the_papers_60m_and_transformers_t5_of_the_same_shape():
    """Raffel et al. 2020, s3.7: Small, about 60 million parameters. transformers' model holds
    each stack's relative bias in its first layer and ties its lm_head to the shared table: the
    same count. T5 v1.1 Small's shape (gated GELU) too, tied: transformers 5 ties the matrix
    even for v1.1 (it only stops scaling the decoder output), where qkv unties it, V E more."""
    for name, overrides in (("t5-small", {}), ("t5-v1_1-small", {"tie_word_embeddings": True})):
        config = T5Config.from_name(name, **overrides)
        reference = transformers.T5Config(
            vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv,
            d_ff=config.d_ff, num_layers=config.num_layers,
            num_decoder_layers=config.num_decoder_layers, num_heads=config.num_heads,
            relative_attention_num_buckets=config.relative_attention_num_buckets,
            feed_forward_proj=config.feed_forward_proj,
        )  # fmt: skip
        with torch.device("meta"):
            expected = transformers.T5ForConditionalGeneration(reference).num_parameters()
        assert cost_report(config).parameters == expected
    untied = cost_report("t5-v1_1-small").parameters
    assert untied == cost_report(config).parameters + config.vocab_size * config.d_model
    assert cost_report("t5-small").parameters == pytest.approx(60e6, rel=0.01)


def test_the_report_has_no_biases_rms_weights_and_two_relative_bias_tables():
    """t5-tiny: V E + 2 x 8 buckets x 4 heads of tables; per encoder block 4 E H D + 2 E F
    + 2 E, per decoder block 8 E H D + 2 E F + 3 E, a final norm E each; lm_head tied."""
    V, E, HD, F, L = 128, 32, 32, 64, 2
    report = cost_report("t5-tiny")
    assert report.embedding_parameters == V * E + 2 * 8 * 4
    encoder = L * (4 * E * HD + 2 * E * F + 2 * E) + E
    decoder = L * (8 * E * HD + 2 * E * F + 3 * E) + E
    assert report.parameters == report.embedding_parameters + encoder + decoder
    untied = cost_report(VARIANTS["relu-untied"])
    assert untied.parameters - report.parameters == V * E
    assert (report.context, report.head_dim, report.num_kv_heads) == (512, 8, 4)


def test_a_saved_t5_checkpoint_is_read_without_its_weights(tmp_path):
    model = T5Transformer(VARIANTS["gated-tied"])
    save(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()  # only config.json is needed
    assert cost_report(tmp_path).parameters == _parameters(model)


def test_a_hugging_face_t5_config_is_read_as_transformers_reads_it(tmp_path):
    """config.json as transformers writes it for t5-small's shape: the same count as its model
    and as qkv's preset."""
    config = T5Config.from_name("t5-small")
    reference = transformers.T5Config(
        vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv, d_ff=config.d_ff,
        num_layers=config.num_layers, num_heads=config.num_heads,
    )  # fmt: skip
    reference.save_pretrained(tmp_path)
    with torch.device("meta"):
        expected = transformers.T5ForConditionalGeneration(reference).num_parameters()
    assert cost_report(tmp_path).parameters == expected == cost_report("t5-small").parameters


# --- FLOPs -------------------------------------------------------------------------------------


def test_forward_flops_equal_flop_counter_mode(tiny):
    ids = torch.randint(2, 128, (2, 12))
    measured = _counted(lambda: tiny(ids, decoder_input_ids=ids))
    report = cost_report("t5-tiny", context=12, batch=2)
    assert report.forward_flops == measured
    assert report.flops_per_token == measured / (2 * 12)


def test_source_and_target_lengths_equal_flop_counter_mode(tiny):
    """S = 12 source, T = 7 target tokens: encoder S^2, decoder T^2, cross-attention S x T."""
    source, target = torch.randint(2, 128, (1, 12)), torch.randint(2, 128, (1, 7))
    measured = _counted(lambda: tiny(source, decoder_input_ids=target))
    flops = encoder_decoder_flops("t5-tiny", source_length=12, target_length=7)
    assert flops.forward_flops == measured
    assert flops.cross_scores == 4 * 7 * 12 * 4 * 8


def test_decode_step_flops_and_caches_equal_the_measured_ones(tiny):
    """A 10-token source, 9 target tokens cached, one more: 10 keys and a cached memory of 10,
    the report's context; the caches a decoding step fills, in fp32."""
    report = cost_report("t5-tiny", context=10, dtype="fp32")
    with torch.no_grad():
        memory = tiny.encode(torch.randint(2, 128, (1, 10)))
        cache = tiny.new_decoder_cache(batch_size=1, max_length=10)
        tiny.decode(torch.randint(2, 128, (1, 9)), memory, cache=cache)
    new = torch.randint(2, 128, (1, 1))
    measured = _counted(lambda: tiny.decode(new, memory, cache=cache))
    assert report.decode_flops_per_token == measured
    assert cache.self_attention.bytes_per_sample == report.kv_cache_bytes_per_sample
    cross = sum(c.keys.nbytes + c.values.nbytes for c in cache.cross_attention)
    assert cross == report.cross_attention_cache_bytes_per_sample


# --- the command -------------------------------------------------------------------------------


def test_command_prints_a_t5_column(capsys):
    code, out, _ = run_cost(capsys, "t5-small", "t5-v1_1-small")
    assert code == 0
    assert out.splitlines()[0].split() == ["t5-small", "t5-v1_1-small"]
    assert "60,506,624" in out and "encoder-decoder" in out and "cross-attn cache" in out
    assert out.rstrip("\n") == format_report(
        [cost_report("t5-small"), cost_report("t5-v1_1-small")]
    )


def test_command_prints_the_source_and_target_section(capsys):
    code, out, _ = run_cost(capsys, "t5-tiny", "--source-length", "12", "--target-length", "7")
    assert code == 0
    assert "t5-tiny: 12 source x 7 target tokens" in out and "cross-attention (S x T)" in out
