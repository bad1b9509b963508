"""qkv's GGUF reader and writer against the outside references on the same files: transformers'
GGUF loader (config, logits, greedy tokens on SmolLM2-135M-Instruct) and the gguf package's own
reader (what qkv writes)."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from qkv.data import chat_format_from_metadata, tokenizer_from_metadata
from qkv.generation import generate
from qkv.models import GPT, GPTConfig, from_gguf, from_pretrained
from qkv.models.gguf import GGML_TYPES, read_gguf
from qkv.models.gguf.writer import save_gguf

TINY_LLAMA = GPTConfig(
    vocab_size=96, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96,
    max_positions=64, rope_base=5e4, norm_eps=1e-6, tie_embeddings=False,
)  # fmt: skip
TINY_GPT2 = GPTConfig(
    vocab_size=96, embed_dim=64, num_layers=2, num_heads=4, ffn_dim=128, max_positions=64,
    position="learned", norm="layernorm", ffn="gelu_tanh", bias=True, tie_embeddings=True,
)  # fmt: skip

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain attention in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into German.",
    "What is 12 times 7?",
    "Name a famous painting by Vermeer.",
]


def _random_model(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms away from 1, so a swap would show
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2"])
def test_a_written_file_reads_back_to_the_same_logits(tmp_path, config):
    model = _random_model(config)
    path = save_gguf(model, tmp_path / "tiny.gguf")
    loaded = from_gguf(path)
    assert loaded.config.norm_eps == np.float32(config.norm_eps)  # GGUF stores a float32
    assert replace(loaded.config, norm_eps=config.norm_eps) == config
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q8_0", "Q4_1", "Q4_0"])
def test_stored_types_round_their_weights_as_the_gguf_package_does(tmp_path, weight_type):
    model = _random_model(TINY_LLAMA)
    path = save_gguf(model, tmp_path / f"tiny-{weight_type}.gguf", weight_type=weight_type)
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    up = stored["blk.0.ffn_up.weight"]
    assert up.tensor_type.name == weight_type
    assert stored["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    expected = gguf.quants.dequantize(up.data, up.tensor_type)  # the format's own reference
    loaded = from_gguf(path)
    got = loaded.state_dict()["blocks.0.ffn.up_proj.weight"]
    assert torch.equal(got, torch.from_numpy(np.array(expected, dtype=np.float32)))
    error = (got - model.blocks[0].ffn.up_proj.weight).abs().max().item()
    assert 0 < error < (0.05 if weight_type in ("Q4_1", "Q4_0") else 0.02)  # its precision
    if weight_type in ("Q8_0", "Q4_1", "Q4_0"):  # the blocks gguf.quants.quantize writes
        weight = model.blocks[0].ffn.up_proj.weight.detach().numpy()
        blocks = gguf.quants.quantize(weight, up.tensor_type)
        assert np.array_equal(np.asarray(up.data), blocks)


def test_a_written_file_is_read_by_transformers_to_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _random_model(TINY_LLAMA)
    path = save_gguf(model, tmp_path / "tiny.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_from_pretrained_reads_a_gguf_file_as_a_gpt(tmp_path):
    path = save_gguf(_random_model(TINY_LLAMA), tmp_path / "tiny.gguf")
    assert isinstance(from_pretrained(path), GPT)
    assert isinstance(GPT.from_pretrained(path), GPT)


def test_smollm2_config_is_the_one_transformers_reads(smollm2, smollm2_hf):
    ours, theirs = smollm2.config, smollm2_hf.config
    assert (ours.vocab_size, ours.embed_dim, ours.num_layers) == (49152, 576, 30)
    assert ours.num_heads == theirs.num_attention_heads == 9
    assert ours.num_kv_heads == theirs.num_key_value_heads == 3
    assert ours.ffn_dim == theirs.intermediate_size
    assert ours.max_positions == theirs.max_position_embeddings
    assert ours.rope_base == theirs.rope_parameters["rope_theta"] == 1e5
    assert ours.norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours.tie_embeddings and theirs.tie_word_embeddings


def test_smollm2_logits_equal_transformers_on_a_multi_turn_chat(
    smollm2, smollm2_file, smollm2_hf, smollm2_hf_tokenizer
):
    """The prompt made by qkv alone (the file's chat template and tokenizer) is transformers'
    prompt, and the logits over it agree within 1e-4."""
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy? Answer in one word."},
    ]
    text = chat_format_from_metadata(smollm2_file.metadata).render(messages)
    ids = tokenizer_from_metadata(smollm2_file.metadata).encode(text).ids
    hf_text = smollm2_hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert text == hf_text and ids == smollm2_hf_tokenizer.encode(hf_text)
    with torch.no_grad():
        ours, theirs = smollm2(torch.tensor([ids])).logits, smollm2_hf(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return tokenizer.encode(text)


def test_smollm2_greedy_tokens_equal_transformers_generate(
    smollm2, smollm2_hf, smollm2_hf_tokenizer
):
    """64 new tokens, transformers' own generate loop against qkv's."""
    eos = smollm2_hf_tokenizer.eos_token_id
    ids = torch.tensor([_chat_ids(smollm2_hf_tokenizer, PROMPTS[0])])
    with torch.no_grad():
        theirs = smollm2_hf.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=eos,
                                     pad_token_id=eos)[0]  # fmt: skip
    ours = generate(smollm2, ids, max_new_tokens=64, eos_token_id=eos)[0]
    assert ours[: len(theirs)].tolist() == theirs.tolist()
    assert (ours[len(theirs) :] == eos).all()
    assert len(theirs) - ids.shape[1] > 4  # an answer, not an immediate end


def test_smollm2_greedy_tokens_are_transformers_argmax_on_eight_prompts(
    smollm2, smollm2_hf, smollm2_hf_tokenizer
):
    """qkv decodes 32 tokens for 8 prompts in one left-padded batch; transformers, given each
    prefix, predicts the same next token at every step up to the end of the answer (so its
    greedy decoding makes the same text), near-ties (top-2 margin < 1e-3) reported apart."""
    eos = smollm2_hf_tokenizer.eos_token_id
    rows = [_chat_ids(smollm2_hf_tokenizer, prompt) for prompt in PROMPTS]
    width = max(len(row) for row in rows)
    ids = torch.tensor([[eos] * (width - len(row)) + row for row in rows])  # (8, L), left-padded
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    ours = generate(smollm2, ids, attention_mask=mask, max_new_tokens=32, eos_token_id=eos)
    new = ours[:, width:]  # (8, 32)
    answering = torch.cumsum(new == eos, dim=1) - (new == eos).int() == 0  # up to the first EOS
    full_mask = torch.cat([mask, answering.int()], dim=1)
    with torch.no_grad():
        logits = smollm2_hf(ours, attention_mask=full_mask).logits[:, width - 1 : -1]  # (8, 32, V)
    top2 = logits.topk(2, dim=-1).values
    tie = (top2[..., 0] - top2[..., 1]) < 1e-3
    disagree = (logits.argmax(-1) != new) & answering
    assert not (disagree & ~tie).any(), f"steps where transformers predicts otherwise: {disagree}"
    assert answering.sum() > 8 * 8  # real answers, not rows of EOS


def test_smollm2_file_is_read_with_every_tensor_and_key(smollm2_file):
    file = smollm2_file
    kinds = {}
    for tensor in file.tensors.values():
        kinds[tensor.kind] = kinds.get(tensor.kind, 0) + 1
    assert kinds == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert file.architecture == "llama"
    assert file.metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(file.metadata["tokenizer.ggml.tokens"]) == 49152


def _gguf_package_view(path) -> tuple[dict, dict]:
    """The gguf package's own reading of a file: metadata as Python values, tensors by name."""

    def plain(value):
        if isinstance(value, list):
            return [plain(item) for item in value]
        return value.item() if isinstance(value, np.generic) else value

    reader = gguf.GGUFReader(path)
    fields = {k: plain(f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {tensor.name: tensor for tensor in reader.tensors}


def _assert_read_as_the_gguf_package_reads(file) -> None:
    fields, tensors = _gguf_package_view(file.path)
    assert file.metadata == fields
    assert set(file.tensors) == set(tensors)
    for name, theirs in tensors.items():
        ours = file.tensors[name]
        assert ours.kind == theirs.tensor_type.name
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert ours.raw.dtype == theirs.data.dtype and ours.raw.shape == theirs.data.shape
        assert np.array_equal(ours.raw, theirs.data, equal_nan=ours.raw.dtype.kind == "f")


def test_smollm2_metadata_and_tensors_are_what_the_gguf_package_reads(smollm2_file):
    _assert_read_as_the_gguf_package_reads(smollm2_file)


def test_every_value_type_is_read_as_the_gguf_package_reads_it(tmp_path):
    extra = {
        "test.flag": True, "test.count": 7, "test.big": -(2**40), "test.ratio": 0.1,
        "test.text": "héllo ✓", "test.ints": [1, 2, 3], "test.floats": [0.5, -1.25],
        "test.words": ["a", "", "ünï"], "test.flags": [True, False],
    }  # fmt: skip
    path = save_gguf(_random_model(TINY_GPT2), tmp_path / "values.gguf", weight_type="BF16",
                     extra_metadata=extra)  # fmt: skip
    file = read_gguf(path)
    _assert_read_as_the_gguf_package_reads(file)
    assert file.metadata["test.words"] == ["a", "", "ünï"]
    assert file.metadata["test.flag"] is True and file.metadata["test.big"] == -(2**40)


def test_the_ggml_type_table_is_the_gguf_package_table():
    theirs = {kind.value: (kind.name, *sizes) for kind, sizes in gguf.GGML_QUANT_SIZES.items()}
    assert {kind: theirs.get(kind) for kind in GGML_TYPES} == GGML_TYPES
    assert len(GGML_TYPES) >= 34  # every type of gguf 0.19
