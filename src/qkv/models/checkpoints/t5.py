"""Hugging Face `T5ForConditionalGeneration` <-> `qkv.models.T5Transformer` (Raffel et al. 2020).

    shared.weight                                     token_embedding.weight
    {s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight
                                                      {s}.relative_bias.relative_attention_bias.weight
    {s}.block.{i}.layer.0.layer_norm.weight           {s}.blocks.{i}.attn_norm.weight
    {s}.block.{i}.layer.0.SelfAttention.{q,k,v,o}     {s}.blocks.{i}.self_attn.{q,k,v,out}_proj
    decoder.block.{i}.layer.1.layer_norm.weight       decoder.blocks.{i}.cross_norm.weight
    decoder.block.{i}.layer.1.EncDecAttention.{q,k,v,o}  decoder.blocks.{i}.cross_attn.*_proj
    {s}.block.{i}.layer.{f}.layer_norm.weight         {s}.blocks.{i}.ffn_norm.weight
    {s}.block.{i}.layer.{f}.DenseReluDense.wi, wo     {s}.blocks.{i}.ffn.up_proj, down_proj
        (gated-gelu: wi_0, wi_1, wo                   ffn.gate_proj, up_proj, down_proj)
    {s}.final_layer_norm.weight                       {s}.final_norm.weight
    lm_head.weight                                    lm_head.weight

{s} is encoder or decoder, {f} is 1 in the encoder and 2 in the decoder; every tensor is a
".weight" (T5 has no biases), stored (out, in) as qkv stores it. The relative bias lives in
block 0 of each stack in the checkpoint and in the stack itself in qkv: all blocks use it.
`encoder.embed_tokens` and `decoder.embed_tokens` (copies of `shared`) and a cross-attention
bias some old checkpoints carry are skipped.

The output layer. T5 ties it to the embedding and scales the decoder output by d_model ** -0.5;
T5 v1.1 does neither. config.json says which by `tie_word_embeddings`, or, when transformers 5
wrote it, by `scale_decoder_outputs` (transformers 5 always writes tie_word_embeddings=true). A
v1.1 checkpoint without `lm_head.weight` (saved by transformers 5, which then ties the matrix it
does not scale) gets a copy of `shared.weight` as its output layer: the same logits.
"""

from __future__ import annotations

import torch

from qkv.models.checkpoints import fields
from qkv.models.checkpoints.core import CheckpointError, KeyMap
from qkv.models.checkpoints.registry import Architecture, register
from qkv.models.t5 import T5Transformer
from qkv.models.t5_config import FEED_FORWARD_KINDS, T5Config

__all__ = ["t5_config", "t5_config_from_hf", "t5_key_map"]

_ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
_FFN = {"wi": "up_proj", "wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}


def _block_names(stack: str, i: int, feed_forward_proj: str) -> dict[str, str]:
    """Checkpoint key -> qkv key for block i of `stack` ("encoder" or "decoder")."""
    ours, theirs = f"{stack}.blocks.{i}", f"{stack}.block.{i}.layer"
    ffn_layer = 2 if stack == "decoder" else 1
    sublayers = [(0, "SelfAttention", "attn_norm", "self_attn")]
    if stack == "decoder":
        sublayers.append((1, "EncDecAttention", "cross_norm", "cross_attn"))
    names = {}
    for index, attention, norm, module in sublayers:
        names[f"{theirs}.{index}.layer_norm.weight"] = f"{ours}.{norm}.weight"
        for hf, projection in _ATTENTION.items():
            names[f"{theirs}.{index}.{attention}.{hf}.weight"] = (
                f"{ours}.{module}.{projection}.weight"
            )
    names[f"{theirs}.{ffn_layer}.layer_norm.weight"] = f"{ours}.ffn_norm.weight"
    matrices = ("wi_0", "wi_1", "wo") if feed_forward_proj == "gated-gelu" else ("wi", "wo")
    for hf in matrices:
        names[f"{theirs}.{ffn_layer}.DenseReluDense.{hf}.weight"] = f"{ours}.ffn.{_FFN[hf]}.weight"
    return names


def _names(config: T5Config) -> dict[str, str]:
    """Every checkpoint key -> qkv key."""
    names = {"shared.weight": "token_embedding.weight", "lm_head.weight": "lm_head.weight"}
    for stack, count in (("encoder", config.num_layers), ("decoder", config.num_decoder_layers)):
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        names[bias] = f"{stack}.relative_bias.relative_attention_bias.weight"
        names[f"{stack}.final_layer_norm.weight"] = f"{stack}.final_norm.weight"
        for i in range(count):
            names |= _block_names(stack, i, config.feed_forward_proj)
    return names


def t5_key_map(model: T5Transformer) -> KeyMap:
    """Renames, and the output layer: dropped when tied (it is the embedding), copied from the
    embedding when untied and absent (see the module docstring)."""
    to_ours = _names(model.config)
    to_theirs = {ours: hf for hf, ours in to_ours.items()}
    tied = model.config.tie_word_embeddings

    def to_qkv(tensors):
        renamed = {to_ours.get(k, k): t for k, t in tensors.items()}
        embedding, head = renamed.get("token_embedding.weight"), renamed.get("lm_head.weight")
        if tied and head is not None and embedding is not None and not torch.equal(head, embedding):
            raise CheckpointError(
                "lm_head.weight: differs from shared.weight, but config.json ties the output "
                "layer to the embedding (tie_word_embeddings / scale_decoder_outputs true); "
                "expected equal tensors, or an untied config"
            )
        if embedding is not None and (tied or head is None):
            renamed["lm_head.weight"] = embedding if tied else embedding.clone()
        return renamed

    def to_checkpoint(tensors):
        kept = {k: t for k, t in tensors.items() if not (tied and k == "lm_head.weight")}
        return {to_theirs.get(k, k): t for k, t in kept.items()}

    ignore = ("embed_tokens.weight", "EncDecAttention.relative_attention_bias.weight")
    return KeyMap(to_qkv=to_qkv, to_checkpoint=to_checkpoint, ignore=ignore)


def t5_config_from_hf(config: dict) -> T5Config:
    """config.json of a T5 checkpoint -> T5Config, read as transformers 5's T5Config reads it
    (its aliases, its defaults); another model type, or a function qkv does not compute, raises."""
    model_type = config.get("model_type", "t5")
    if model_type != "t5":
        raise CheckpointError(f"config.json: model_type is {model_type!r}; expected 't5'")
    feed_forward_proj = _feed_forward(config)
    # transformers 5: scale_decoder_outputs = (tie_word_embeddings is not False), unless given
    tied = config.get("tie_word_embeddings") is None or fields.boolean(
        config, "tie_word_embeddings"
    )
    pad = fields.integer(config, "pad_token_id", 0)
    start = fields.optional_integer(config, "decoder_start_token_id")
    d_model, d_kv, num_heads, num_layers = (
        fields.integer(config, fields.aliased(config, key, alias), default)
        for key, alias, default in _ALIASED
    )
    return T5Config(
        vocab_size=fields.integer(config, "vocab_size", 32128),
        d_model=d_model,
        d_kv=d_kv,
        d_ff=fields.integer(config, "d_ff", 2048),
        num_layers=num_layers,
        num_decoder_layers=_decoder_layers(config),
        num_heads=num_heads,
        relative_attention_num_buckets=fields.integer(config, "relative_attention_num_buckets", 32),
        relative_attention_max_distance=fields.integer(
            config, "relative_attention_max_distance", 128
        ),
        dropout_rate=fields.number(config, "dropout_rate", 0.1),
        layer_norm_epsilon=fields.number(config, "layer_norm_epsilon", 1e-6),
        feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=fields.boolean(config, "scale_decoder_outputs", tied),
        pad_token_id=pad,
        eos_token_id=_eos(config),
        decoder_start_token_id=pad if start is None else start,
    )


# T5Config's field, its attribute_map alias, its default
_ALIASED = (
    ("d_model", "hidden_size", 512),
    ("d_kv", "head_dim", 64),
    ("num_heads", "num_attention_heads", 8),
    ("num_layers", "num_hidden_layers", 6),
)


def _decoder_layers(config: dict) -> int:
    """num_decoder_layers; absent or null, T5Config's num_layers as it stands before its alias
    num_hidden_layers is applied (transformers resolves it first)."""
    layers = fields.optional_integer(config, "num_decoder_layers")
    return fields.integer(config, "num_layers", 6) if layers is None else layers


def _feed_forward(config: dict) -> str:
    """feed_forward_proj parsed as T5Config parses it ("{act}" or "gated-{act}"; "gated-gelu"
    is gelu_new) -> the FFN qkv computes: "relu" or "gated-gelu" (GEGLU, tanh GELU)."""
    value = config.get("feed_forward_proj", "relu")
    parts = value.split("-") if isinstance(value, str) else []
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise CheckpointError(
            f"config.json: feed_forward_proj is {value!r:.80}; expected '{{ACT_FN}}' or "
            f"'gated-{{ACT_FN}}', such as 'relu' or 'gated-gelu'"
        )
    gated, act = len(parts) == 2, "gelu_new" if value == "gated-gelu" else parts[-1]
    kind = {(False, "relu"): "relu", (True, "gelu_tanh"): "gated-gelu"}.get(
        (gated, fields.ACTIVATIONS.get(act))
    )
    if kind not in FEED_FORWARD_KINDS:
        raise CheckpointError(
            f"config.json: feed_forward_proj is {value!r}; qkv computes 'relu' (T5) and "
            f"'gated-gelu' (T5 v1.1; also 'gated-gelu_new', 'gated-gelu_pytorch_tanh')"
        )
    return kind


def _eos(config: dict) -> int:
    """eos_token_id (default 1); transformers also takes a list of ids, qkv a list of one."""
    value = config.get("eos_token_id", 1)
    if isinstance(value, list) and len(value) == 1:
        return fields.integer({"eos_token_id": value[0]}, "eos_token_id")
    if isinstance(value, list):
        raise CheckpointError(
            f"config.json: eos_token_id is {value!r:.80}; qkv's T5 stops at one id, expected an "
            f"int or a list of one"
        )
    return fields.integer(config, "eos_token_id", 1)


def t5_config(model: T5Transformer) -> dict:
    """T5Transformer -> config.json that transformers 4 and 5 read as this model."""
    config = model.config
    dtype = str(model.token_embedding.weight.dtype).removeprefix("torch.")
    names = (
        "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
        "num_heads", "relative_attention_num_buckets", "relative_attention_max_distance",
        "dropout_rate", "layer_norm_epsilon", "feed_forward_proj", "tie_word_embeddings",
        "pad_token_id", "eos_token_id", "decoder_start_token_id",
    )  # fmt: skip
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        **{name: getattr(config, name) for name in names},
        "scale_decoder_outputs": config.tie_word_embeddings,  # transformers 5
        "is_encoder_decoder": True,
        "dtype": dtype,  # transformers 5
        "torch_dtype": dtype,  # transformers 4
    }


def _build(config: dict) -> T5Transformer:
    return T5Transformer(t5_config_from_hf(config))


register(Architecture("T5ForConditionalGeneration", T5Transformer, _build, t5_key_map, t5_config))
# the original checkpoints' config.json (t5-small ... t5-11b) name the older class
register(Architecture("T5WithLMHeadModel", T5Transformer, _build, t5_key_map, t5_config))
