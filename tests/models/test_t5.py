"""qkv's T5Transformer against Hugging Face transformers' T5ForConditionalGeneration.

Each reference is built from a small config with a fixed seed (ReLU and gated-GELU feed-forward
networks, tied and untied output layers, an attention width H * D equal to d_model or not),
saved with save_pretrained (safetensors) and loaded by qkv; both models then read the same
right-padded inputs. transformers' own initialisation (N(0, 1) embeddings) gives logits of
order 10, far from the near-zero regime where a wrong mask or bias would hide.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

import qkv
from qkv.models import CheckpointError, T5Config, T5Transformer

VOCAB, PAD = 64, 0
SRC_LENGTHS, TGT_LENGTHS = torch.tensor([9, 6, 3]), torch.tensor([7, 4, 2])
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32; transformers' GELU is written out in Python

# name -> (feed_forward_proj, tie_word_embeddings, d_kv, untied head stored in the file)
CASES = {
    "relu-tied": ("relu", True, 8, False),  # H * D = 32 = d_model
    "gated-gelu-untied-head": ("gated-gelu", False, 6, True),  # H * D = 24, flan-t5's layout
    "relu-untied-unscaled": ("relu", False, 12, False),  # H * D = 48; transformers 5's layout
    "gated-gelu-tied": ("gated-gelu", True, 8, False),
}


def _reference(name: str) -> nn.Module:
    """transformers' model, with relative buckets that reach their logarithmic range and
    max_distance within the lengths used. "untied head": a separate lm_head, as the T5 v1.1
    checkpoints have (a model built with tie_word_embeddings=False in transformers 5 shares
    the matrix and only drops the d_model ** -0.5 scaling)."""
    feed_forward_proj, tied, d_kv, untied_head = CASES[name]
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=d_kv, d_ff=48, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
        dropout_rate=0.0, feed_forward_proj=feed_forward_proj, tie_word_embeddings=tied,
        pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    if untied_head:
        model.lm_head.weight = nn.Parameter(torch.randn(VOCAB, 32))
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, qkv model loaded from its save_pretrained folder, the folder)."""
    reference = _reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return reference, T5Transformer.from_pretrained(path), path


def _ids(lengths: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max length) random ids >= 2, right-padded with PAD, and the (B, L) 0/1 mask."""
    generator = torch.Generator().manual_seed(seed)
    L = int(lengths.max())
    ids = torch.randint(2, VOCAB, (len(lengths), L), generator=generator)
    mask = (torch.arange(L) < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def _batch() -> dict[str, torch.Tensor]:
    input_ids, attention_mask = _ids(SRC_LENGTHS, seed=1)
    decoder_input_ids, decoder_attention_mask = _ids(TGT_LENGTHS, seed=2)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_attention_mask,
    }


def _labels() -> torch.Tensor:
    ids, mask = _ids(TGT_LENGTHS, seed=3)
    return ids.masked_fill(mask == 0, -100)


# ---------------------------------------------------------------- parity with transformers


def test_logits_match_transformers_with_padding(pair):
    reference, model, _ = pair
    batch = _batch()
    with torch.no_grad():
        expected = reference(**batch).logits
        got = model(**batch).logits
    assert expected.abs().max() > 1.0  # far from the trivial near-zero regime
    torch.testing.assert_close(got, expected, **TOLERANCE)


def test_loss_matches_transformers_with_labels_shifted_right(pair):
    reference, model, _ = pair
    batch, labels = _batch(), _labels()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = reference(**inputs, labels=labels)
        got = model(**inputs, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, **TOLERANCE)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)


def test_relative_bias_gradients_match_transformers(pair):
    """The one table of each stack gets the gradient of every layer's scores."""
    reference, model, _ = pair
    batch, labels = _batch(), _labels()
    reference(**batch, labels=labels).loss.backward()
    model(**batch, labels=labels).loss.backward()
    for stack in ("encoder", "decoder"):
        table = getattr(model, stack).relative_bias.relative_attention_bias.weight
        hf_table = getattr(reference, stack).block[0].layer[0].SelfAttention
        expected = hf_table.relative_attention_bias.weight.grad
        assert table.grad is not None and table.grad.abs().sum() > 0
        torch.testing.assert_close(table.grad, expected, rtol=1e-4, atol=1e-6)
    reference.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)


def test_cached_decoding_equals_the_full_decode(pair):
    """A 3-token prefill, then one token per step: the relative bias of each new query must use
    its true offset to every cached key (max_distance 6 < 7 tokens: far offsets share buckets)."""
    _, model, _ = pair
    batch = _batch()
    target, target_mask = batch["decoder_input_ids"], batch["decoder_attention_mask"]
    B, L = target.shape
    with torch.no_grad():
        memory = model.encode(batch["input_ids"], batch["attention_mask"])
        full = model.decode(
            target, memory, memory_mask=batch["attention_mask"], decoder_attention_mask=target_mask
        )
        cache = model.new_decoder_cache(B, L)
        steps = []
        for start, end in [(0, 3)] + [(t, t + 1) for t in range(3, L)]:
            steps.append(
                model.decode(
                    target[:, start:end],
                    memory,
                    memory_mask=batch["attention_mask"],
                    decoder_attention_mask=target_mask[:, :end],
                    cache=cache,
                )  # fmt: skip
            )
    assert cache.length == L
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOLERANCE)


def test_output_layer_is_tied_only_when_the_checkpoint_ties_it(pair):
    reference, model, _ = pair
    scaled = reference.config.scale_decoder_outputs
    assert model.config.tie_word_embeddings == scaled
    assert (model.lm_head.weight is model.token_embedding.weight) == scaled
    torch.testing.assert_close(model.lm_head.weight, reference.lm_head.weight, rtol=0, atol=0)


# ---------------------------------------------------------------- writing back


def test_save_pretrained_is_read_back_by_transformers(pair, tmp_path):
    reference, model, _ = pair
    model.save_pretrained(tmp_path)
    reloaded, info = transformers.T5ForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            model(**batch).logits, reloaded.eval()(**batch).logits, **TOLERANCE
        )


def test_qkv_save_and_load_round_trip(pair, tmp_path):
    _, model, _ = pair
    qkv.models.save(model, tmp_path)
    loaded = qkv.models.load(tmp_path)
    assert isinstance(loaded, T5Transformer) and loaded.config == model.config
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


def test_a_transformers_4_config_reads_the_same(tmp_path):
    """transformers 4 wrote tie_word_embeddings=false for T5 v1.1, and no scale_decoder_outputs."""
    reference = _reference("gated-gelu-untied-head")
    reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("scale_decoder_outputs")
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = qkv.models.from_pretrained(tmp_path)
    assert isinstance(model, T5Transformer) and not model.config.tie_word_embeddings
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, **TOLERANCE)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("d_kv", 0, ValueError),
        ("num_heads", 2.0, TypeError),
        ("num_decoder_layers", -1, ValueError),
        ("dropout_rate", 1.5, ValueError),
        ("layer_norm_epsilon", 0.0, ValueError),
        ("feed_forward_proj", "gated-silu", ValueError),
        ("relative_attention_max_distance", 4, ValueError),  # not beyond 8 // 2 exact buckets
        ("tie_word_embeddings", "yes", TypeError),
        ("decoder_start_token_id", 128, ValueError),
    ],
)
def test_bad_config_values_name_the_argument(field, value, error):
    with pytest.raises(error, match=field):
        T5Config.from_name("t5-tiny", **{field: value})


def test_presets_build():
    config = T5Config.from_name("t5-tiny")
    assert config.num_decoder_layers == config.num_layers and config.inner_dim == 32
    model = T5Transformer(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == qkv.models.t5_config.t5_parameter_count(config)
    with pytest.raises(ValueError, match="name"):
        T5Config.from_name("t5-huge")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"feed_forward_proj": "gated-silu"}, "feed_forward_proj"),
        ({"model_type": "mt5"}, "model_type"),
        ({"architectures": ["T5EncoderModel"]}, "T5EncoderModel"),
        ({"d_kv": "8"}, "d_kv"),
    ],
)
def test_unsupported_checkpoints_are_refused(edit, match, tmp_path):
    _reference("relu-tied").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(CheckpointError, match=match):
        qkv.models.from_pretrained(tmp_path)
