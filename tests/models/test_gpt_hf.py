"""qkv's GPT against Hugging Face transformers: GPT-2, Llama (GQA, RoPE), MQA Llama, Mistral
(sliding window), each built from a small config with a fixed seed, saved with save_pretrained
(safetensors) and loaded by qkv; then qkv's save_pretrained read back by transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from torch import nn

from qkv.models.checkpoints import CheckpointError
from qkv.models.gpt import GPT, GPTConfig

VOCAB, LENGTH, LENGTHS = 100, 12, (12, 9, 5)  # right-padded batch of 3
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
SMALL |= {"num_attention_heads": 4, "attention_dropout": 0.0}


def _gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(num_kv_heads: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=num_kv_heads, rope_theta=500.0)
    return transformers.LlamaForCausalLM(config)


def _mistral(window: int = 4) -> transformers.PreTrainedModel:
    config = transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=window)
    return transformers.MistralForCausalLM(config)


BUILDERS = {
    "gpt2": _gpt2,
    "llama-gqa": lambda: _llama(num_kv_heads=2),
    "llama-mqa": lambda: _llama(num_kv_heads=1),
    "mistral-window-4": _mistral,
}


def _reference(name: str) -> nn.Module:
    """The transformers model, with weights large enough that attention is far from uniform
    (the default N(0, 0.02^2) init would hide a wrong mask or rotation in tiny differences)."""
    torch.manual_seed(0)
    model = BUILDERS[name]()
    with torch.no_grad():
        for module in model.modules():
            for parameter_name, parameter in module.named_parameters(recurse=False):
                parameter.normal_(0.0, 0.3)
                if "Norm" in type(module).__name__ and parameter_name == "weight":
                    parameter.add_(1.0)
    return model.eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids (3, 12), attention_mask (right padding), labels (-100 on padding)."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (len(LENGTHS), LENGTH), generator=generator)
    attention_mask = (torch.arange(LENGTH) < torch.tensor(LENGTHS)[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


@pytest.fixture(scope="module", params=list(BUILDERS))
def saved(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory)."""
    reference = _reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return request.param, reference, path


def test_logits_and_loss_match_transformers(saved):
    name, reference, path = saved
    model = GPT.from_pretrained(path)
    input_ids, attention_mask, labels = _batch()
    with torch.no_grad():
        expected = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        got = model(input_ids, attention_mask=attention_mask, labels=labels)
    real = attention_mask.bool()
    assert expected.logits[real].abs().max() > 1.0  # far from the trivial near-zero regime
    torch.testing.assert_close(got.logits[real], expected.logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)


def test_round_trip_through_transformers(saved, tmp_path):
    name, reference, path = saved
    model = GPT.from_pretrained(path)
    model.save_pretrained(tmp_path)
    reloaded, info = type(reference).from_pretrained(tmp_path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing/unexpected/mismatched keys
    input_ids, attention_mask, _ = _batch()
    with torch.no_grad():
        expected = reloaded.eval()(input_ids=input_ids, attention_mask=attention_mask).logits
        got = model(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


def test_the_window_is_the_one_transformers_uses(tmp_path):
    """With the window one key wider or narrower than Mistral's, logits must differ: the parity
    test would catch an off-by-one in the window mapping."""
    reference = _reference("mistral-window-4")
    reference.save_pretrained(tmp_path)
    input_ids, _, _ = _batch()
    with torch.no_grad():
        expected = reference(input_ids=input_ids).logits
    exact = GPT.from_pretrained(tmp_path)
    assert exact.config.sliding_window == 4
    for window in (3, 5):
        shifted = GPT(dataclasses.replace(exact.config, sliding_window=window))
        shifted.load_state_dict(exact.state_dict())
        with torch.no_grad():
            got = shifted(input_ids).logits
        assert (got - expected).abs().max() > 1e-2


def test_gradients_match_transformers(saved):
    """One training step's loss gradient w.r.t. the token embedding, against transformers."""
    name, reference, path = saved
    model = GPT.from_pretrained(path)
    input_ids, attention_mask, labels = _batch()
    reference.zero_grad()
    reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    expected = reference.get_input_embeddings().weight.grad
    torch.testing.assert_close(model.token_embedding.weight.grad, expected, rtol=1e-4, atol=1e-6)


def test_gpt2_tied_head_is_the_embedding(saved):
    name, reference, path = saved
    model = GPT.from_pretrained(path)
    tied = model.lm_head.weight is model.token_embedding.weight
    assert tied == (name == "gpt2") == reference.config.tie_word_embeddings


def test_hub_style_gpt2_keys_without_prefix_and_with_mask_buffers(tmp_path):
    """The hub's "gpt2" was saved from GPT2Model: no "transformer." prefix, and older versions
    stored the causal-mask buffers attn.bias / attn.masked_bias. Both must load."""
    from safetensors.torch import load_file, save_file

    reference = _reference("gpt2")
    reference.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    input_ids, _, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            GPT.from_pretrained(tmp_path)(input_ids).logits,
            reference(input_ids=input_ids).logits,
            rtol=0,
            atol=1e-5,
        )


def test_checkpoint_errors(tmp_path):
    reference = _reference("llama-gqa")
    reference.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"(?s)missing \(1\).*blocks\.1\.ffn\.up_proj\.weight"
    ):
        GPT.from_pretrained(tmp_path)


def test_unsupported_config_options_are_refused(tmp_path):
    """RoPE on part of each head: transformers' Llama saves it, then fails in forward."""
    partial = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    config = transformers.LlamaConfig(**SMALL, rope_scaling=partial)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="rope_scaling: partial_rotary_factor"):
        GPT.from_pretrained(tmp_path)


def test_save_refuses_a_config_no_architecture_fits(tmp_path):
    config = GPTConfig.from_name("tiny-llama", norm="layernorm")  # RoPE + LayerNorm: no HF class
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*position='rope'"):
        GPT(config).save_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_left_padding_with_position_ids(name, tmp_path):
    """Left padding with position_ids counting real tokens only, as generation does it."""
    reference = _reference(name)
    reference.save_pretrained(tmp_path)
    model = GPT.from_pretrained(tmp_path)
    input_ids, right_mask, _ = _batch()
    attention_mask = right_mask.flip(1)  # (B, L): padding first
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # (B, L)
    with torch.no_grad():
        expected = reference(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits
        got = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_bf16_autocast_error_is_within_twice_that_of_transformers(name, tmp_path):
    """The low-precision rule: at most twice the error of the reference implementation
    at the same precision, both measured against the fp32 logits."""
    reference = _reference(name)
    reference.save_pretrained(tmp_path)
    model = GPT.from_pretrained(tmp_path)
    input_ids, attention_mask, _ = _batch()
    real = attention_mask.bool()
    with torch.no_grad():
        exact = reference(input_ids=input_ids, attention_mask=attention_mask).logits[real]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = reference(input_ids=input_ids, attention_mask=attention_mask).logits[real]
            ours = model(input_ids, attention_mask=attention_mask).logits[real]
    their_error = (theirs.float() - exact).abs().max()
    our_error = (ours.float() - exact).abs().max()
    assert 0 < our_error <= 2 * their_error


def test_a_config_of_another_family_is_refused_by_name(tmp_path):
    """A checkpoint whose architecture qkv does not read fails with the keys it lacks."""
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, architectures=["FalconForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"config.json: missing \[.*model_type 'bert'"):
        GPT.from_pretrained(tmp_path)
