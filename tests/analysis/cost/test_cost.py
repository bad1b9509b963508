"""`qkv cost` against outside references: figures worked out by hand (Llama-2-70B's KV cache,
score matrices at 8K/32K/128K), published parameter counts, parameters of
instantiated qkv and Hugging Face models, FLOPs counted by `torch.utils.flop_counter`, the KV
caches' own sizes, and the peak memory measured while the scores are materialised."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.estimate import cost_report
from qkv.analysis.cost.format import format_bytes, format_report
from qkv.analysis.cost.layout import AttentionLayout
from qkv.analysis.cost.memory import peak_bytes
from qkv.analysis.cost.sources import preset_names, resolve_model
from qkv.generation import make_cache
from qkv.layers import MultiHeadAttention
from qkv.models import (
    GPT,
    BertConfig,
    BertModel,
    GPTConfig,
    T5Config,
    T5Transformer,
    Transformer,
    TransformerConfig,
    ViT,
    ViTConfig,
    save,
)
from tests.analysis.cost.command import run_cost

GiB = 2**30

# Hugging Face's `model.num_parameters()` of each released checkpoint (GPT2LMHeadModel,
# LlamaForCausalLM, MistralForCausalLM, BertModel with its pooler), as on the model cards.
PUBLISHED_PARAMETERS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096,
    "bert-base-uncased": 109_482_240,
    "bert-large-uncased": 335_141_888,
}

VARIANTS = [  # configs beyond the presets: every branch of the parameter formula
    GPTConfig.from_name("tiny-gpt2", bias=False),  # LayerNorm without bias
    GPTConfig.from_name("tiny-gpt2", tie_embeddings=False),
    GPTConfig.from_name("tiny-llama", bias=True),  # SwiGLU and GQA projections with biases
    GPTConfig.from_name("tiny-llama", position="learned", tie_embeddings=True),
    BertConfig.from_name("tiny", share_layers=True),  # ALBERT: one block's weights
    TransformerConfig.from_name("transformer-tiny", share_embeddings=False),  # tied output only
    TransformerConfig.from_name(
        "transformer-tiny", share_embeddings=False, tie_output=False, tgt_vocab_size=96
    ),
    TransformerConfig.from_name("transformer-tiny", norm_first=True),
]


def _build(config) -> torch.nn.Module:
    model_class = {GPTConfig: GPT, BertConfig: BertModel, TransformerConfig: Transformer,
                   T5Config: T5Transformer, ViTConfig: ViT}  # fmt: skip
    return model_class[type(config)](config)


def _reference_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Every attention on the eager `reference` backend, whose matmuls FlopCounterMode sees (it
    does not count PyTorch's fused CPU attention kernel)."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.backend = "reference"
    return model.eval()


def _counted_flops(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


# --- figures worked out by hand ---------------------------------------------------------------


def test_llama_2_70b_kv_cache_is_1_25_gib_with_gqa_and_10_gib_with_mha():
    """80 layers, H_kv = 8, D = 128, 4096 tokens, fp16: 1.25 GB per sample with GQA (Ainslie et
    al. 2023); 10 GB with MHA (H_kv = 64); exactly 1.25 and 10 GiB."""
    report = cost_report("llama-2-70b", context=4096, dtype="fp16")
    assert (report.num_decoder_layers, report.num_heads, report.num_kv_heads) == (80, 64, 8)
    assert report.head_dim == 128
    assert report.kv_cache_bytes_per_sample == 1.25 * GiB
    by_name = {variant.name: variant for variant in report.kv_cache_variants}
    assert by_name["GQA"].bytes_per_sample == 1.25 * GiB and by_name["GQA"].is_model
    assert by_name["MHA"].bytes_per_sample == 10 * GiB and by_name["MHA"].num_kv_heads == 64
    assert by_name["MQA"].bytes_per_sample == 1.25 * GiB / 8
    assert format_bytes(report.kv_cache_bytes_per_sample) == "1.25 GiB"


def test_score_matrix_bytes_at_8k_32k_and_128k_tokens():
    """d_model 4096, 32 heads, fp16, one layer: 4.29 GB at 8K, 68.7 GB at 32K and
    1099 GB at 128K; one head in fp32 at 128,000 tokens: 128000^2 x 4 bytes (~62 GB)."""
    report = cost_report("llama-2-7b", dtype="fp16")  # E = 4096, H = 32
    per_layer = {s.length: s.per_layer_bytes for s in report.score_matrix}
    assert round(per_layer[8192] / 1e9, 2) == 4.29
    assert round(per_layer[32768] / 1e9, 1) == 68.7
    assert int(per_layer[131072] / 1e9) == 1099
    one_head = cost_report("llama-2-7b", context=128_000, dtype="fp32").score_matrix_at_context
    assert one_head.per_head_bytes == 128_000 * 128_000 * 4


def test_attention_flops_and_parameters_are_the_textbook_formulas():
    """4 D^2 projection weights whatever H; 8 B L E^2 + 4 B L^2 E FLOPs per layer; for
    d_model 768 and 12 heads, 4 x 768^2 = 2,359,296 parameters."""
    for heads in (1, 12):
        layout = AttentionLayout(embed_dim=768, num_heads=heads, num_kv_heads=heads,
                                 head_dim=768 // heads, bias=False)  # fmt: skip
        assert layout.parameters() == 2_359_296
    report = cost_report("bert-base-uncased", context=300)
    E, L = 768, 300
    assert report.attention_flops_per_layer == 8 * L * E**2 + 4 * L**2 * E


# --- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_parameters_equal_the_published_counts(preset):
    assert cost_report(preset).parameters == PUBLISHED_PARAMETERS[preset]


def test_transformer_base_is_about_the_papers_65m():
    """Vaswani et al. 2017, Table 3: base model 65 x 10^6 parameters (a rounded figure)."""
    assert cost_report("transformer-base").parameters == pytest.approx(65e6, rel=0.05)


@pytest.mark.parametrize(
    "config", [*preset_names(), *VARIANTS], ids=[*preset_names(), *map(repr, range(8))]
)
def test_parameters_equal_those_of_the_instantiated_qkv_model(config):
    """Big models are built on the meta device: shapes only, no memory."""
    _, resolved = resolve_model(config)
    with torch.device("meta"):
        model = _build(resolved)
    assert cost_report(config).parameters == sum(p.numel() for p in model.parameters())


HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "bert": lambda: transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    ),
}


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_hugging_face_config_json_gives_the_transformers_models_parameters(family, tmp_path):
    """A config.json written by transformers, read without weights; the reference is the
    parameter count of the transformers model built from the same config."""
    config = HF_CONFIGS[family]()
    config.save_pretrained(tmp_path)
    model_class = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
                   "bert": transformers.BertModel}[family]  # fmt: skip
    expected = model_class(config).num_parameters()
    assert cost_report(tmp_path).parameters == expected
    assert cost_report(tmp_path / "config.json").parameters == expected


def test_a_qkv_checkpoint_is_read_without_its_weights(tmp_path):
    model = GPT(GPTConfig.from_name("tiny-llama-mqa"))
    save(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()  # only config.json is needed
    report = cost_report(str(tmp_path))
    assert report.parameters == sum(p.numel() for p in model.parameters())
    assert report.num_kv_heads == 1


# --- FLOPs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama", "tiny-llama-mqa", "tiny-mistral"])
def test_forward_flops_equal_flop_counter_mode(preset):
    torch.manual_seed(0)
    model = _reference_attention(GPT(GPTConfig.from_name(preset)))
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        measured = _counted_flops(lambda: model(ids))
    report = cost_report(preset, context=16, batch=2)
    assert report.forward_flops == measured
    assert report.flops_per_token == measured / (2 * 16)


@pytest.mark.parametrize("preset", ["tiny", "transformer-tiny"])
def test_encoder_and_encoder_decoder_flops_equal_flop_counter_mode(preset):
    _, config = resolve_model(preset)
    model = _reference_attention(_build(config))
    ids = torch.randint(3, 100, (1, 12))
    inputs = {"decoder_input_ids": ids} if isinstance(config, TransformerConfig) else {}
    with torch.no_grad():
        measured = _counted_flops(lambda: model(ids, **inputs))
    assert cost_report(preset, context=12).flops_per_sequence == measured


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama-mqa"])
def test_decode_step_flops_equal_flop_counter_mode(preset):
    """One new token over a KV cache holding 9 tokens: 10 keys, the report's context."""
    model = _reference_attention(GPT(GPTConfig.from_name(preset)))
    cache = make_cache(model, batch=1, max_length=10)
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 9)), position_ids=torch.arange(9), cache=cache)
        new = torch.randint(0, 100, (1, 1))
        measured = _counted_flops(lambda: model(new, position_ids=torch.tensor([9]), cache=cache))
    assert cost_report(preset, context=10).decode_flops_per_token == measured


def test_training_flops_equal_flop_counter_mode_forward_and_backward():
    model = _reference_attention(GPT(GPTConfig.from_name("tiny-llama"))).train()
    ids = torch.randint(0, 100, (2, 16))
    measured = _counted_flops(lambda: model(ids).logits.sum().backward())
    assert cost_report("tiny-llama", context=16, batch=2).training_flops == measured


# --- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_kv_bytes_equal_the_caches_own_reports(dtype):
    """Every variant (MHA H_kv = 4, GQA 2, MQA 1) against the cache `generate` would build."""
    report = cost_report("tiny-llama", context=24, dtype=dtype, batch=3)
    torch_dtype = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
    assert [v.name for v in report.kv_cache_variants] == ["MHA", "GQA", "MQA"]
    for variant in report.kv_cache_variants:
        config = GPTConfig.from_name("tiny-llama", num_kv_heads=variant.num_kv_heads)
        cache = make_cache(GPT(config), batch=3, max_length=24, dtype=torch_dtype)
        assert cache.bytes_per_sample == variant.bytes_per_sample
        if variant.is_model:
            assert cache.bytes_per_sample == report.kv_cache_bytes_per_sample
            assert cache.nbytes == report.kv_cache_bytes


def test_encoder_decoder_caches_equal_the_measured_ones():
    """Self-attention cache and the cross-attention keys/values filled by one decoding step."""
    model = Transformer(TransformerConfig.from_name("transformer-tiny", dropout=0.0)).eval()
    report = cost_report("transformer-tiny", context=10, dtype="fp32")
    source = torch.randint(3, 100, (1, 10))
    cache = model.new_decoder_cache(batch_size=1, max_length=10)
    with torch.no_grad():
        model.decode(torch.ones(1, 1, dtype=torch.long), model.encode(source), cache=cache)
    assert cache.self_attention.bytes_per_sample == report.kv_cache_bytes_per_sample
    cross = sum(c.keys.nbytes + c.values.nbytes for c in cache.cross_attention)
    assert cross == report.cross_attention_cache_bytes_per_sample
    assert cost_report("tiny").kv_cache_bytes_per_sample is None  # an encoder keeps none


def test_score_matrix_bytes_equal_the_measured_peak():
    """Materialising Q K^T for L = 1024, 2 heads, fp32 allocates exactly one layer's scores;
    naive softmax(Q K^T / sqrt(D)) V peaks at about two such matrices (scores and weights)."""
    L, H, D = 1024, 2, 16
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    config = GPTConfig(vocab_size=10, embed_dim=H * D, num_layers=1, num_heads=H, ffn_dim=8)
    scores = cost_report(config, context=L, dtype="fp32").score_matrix_at_context
    assert scores.per_layer_bytes == H * scores.per_head_bytes == 8 * 2**20
    assert peak_bytes(lambda: q @ k.transpose(-1, -2)) == scores.per_layer_bytes
    naive = peak_bytes(lambda: torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1) @ v)
    assert scores.per_layer_bytes < naive <= 2.1 * scores.per_layer_bytes


# --- errors, formatting and the command --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"model": "no-such-model"}, ValueError, "model"),
        ({"model": 42}, TypeError, "model"),
        ({"model": "gpt2", "context": -5}, ValueError, "context"),
        ({"model": "gpt2", "context": 0}, ValueError, "context"),
        ({"model": "gpt2", "batch": 0}, ValueError, "batch"),
        ({"model": "gpt2", "dtype": "int3"}, ValueError, "dtype"),
        ({"model": "gpt2", "dtype": 16}, TypeError, "dtype"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, named):
    model = kwargs.pop("model")
    with pytest.raises(error, match=f"^{named}: "):
        cost_report(model, **kwargs)


def test_unreadable_or_foreign_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="model: cannot read"):
        cost_report(tmp_path)  # a folder without config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="model_type 'gpt_neox'"):
        cost_report(tmp_path)


def test_preset_names_are_unique_across_families():
    assert len(set(preset_names())) == len(preset_names())


def test_command_prints_a_column_per_model(capsys):
    code, out, _ = run_cost(capsys, "llama-2-70b", "gpt2", "--context", "4096")
    assert code == 0
    assert "1.25 GiB H_kv=8 (model)" in out and "10 GiB H_kv=64" in out
    assert "68,976,648,192" in out and "124,439,808" in out
    assert out.rstrip("\n") == format_report(
        [cost_report("llama-2-70b", context=4096), cost_report("gpt2", context=4096)]
    )


def test_command_json_parses_and_equals_the_reports(capsys):
    code, out, _ = run_cost(capsys, "tiny-llama", "tiny", "--json", "--batch", "2")
    assert code == 0
    parsed = json.loads(out)
    assert parsed == [
        json.loads(json.dumps(dataclasses.asdict(cost_report(name, batch=2))))
        for name in ("tiny-llama", "tiny")
    ]


def test_command_without_models_lists_every_preset(capsys):
    code, out, _ = run_cost(capsys, "--dtype", "bf16")
    assert code == 0
    for name in preset_names():
        assert f"\n{name} " in out
    assert "bf16" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["nope"], "model"), (["gpt2", "--context", "-1"], "context"),
     (["gpt2", "--dtype", "fp8"], "dtype"), (["gpt2", "--batch", "0"], "batch")],
)  # fmt: skip
def test_command_errors_name_the_argument(capsys, argv, named):
    code, out, err = run_cost(capsys, *argv)
    assert code == 1 and out == ""
    assert err.startswith(f"qkv cost: error: {named}: ")


# --- a real model: SmolLM2-135M-Instruct from its GGUF file -------------------------------------


def test_smollm2_from_its_gguf_header_equals_the_loaded_model_and_its_cache(smollm2):
    """`qkv cost smollm2` reads the packaged file's header only; its parameters are those of
    the loaded model (the tied head counted once), its KV cache (GQA, 3 of 9 heads) that of
    the cache generation fills, one third of the MHA variant's."""
    report = cost_report("smollm2", context=512, dtype="fp32", batch=2)
    unique = {id(p): p.numel() for p in smollm2.parameters()}
    assert report.parameters == sum(unique.values()) == 134_515_008
    cache = make_cache(smollm2, batch=2, max_length=512, dtype=torch.float32)
    model_variant = next(v for v in report.kv_cache_variants if v.is_model)
    mha = next(v for v in report.kv_cache_variants if v.name == "MHA")
    assert cache.nbytes == report.kv_cache_bytes == 2 * 30 * 2 * 512 * 3 * 64 * 4
    assert mha.bytes_per_sample == 3 * model_variant.bytes_per_sample
