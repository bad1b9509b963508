"""BERT checkpoints: transformers' `BertModel`, `BertForPreTraining` and
`BertForSequenceClassification` directories <-> qkv's models of the same names.

The checkpoint names are those of transformers' modeling_bert.py. A bare `BertModel` (such as
all-MiniLM-L6-v2) stores `embeddings.word_embeddings.weight`, `encoder.layer.0...`; models with
heads put the encoder under `bert.` and the heads under `cls.` or `classifier.`. Reading accepts
either form, and the legacy TensorFlow names `LayerNorm.gamma` / `LayerNorm.beta`.

Tied MLM decoder: transformers (5.x) writes neither `cls.predictions.decoder.weight` (it is the
word embedding matrix) nor `cls.predictions.decoder.bias` (it is `cls.predictions.bias`), so
qkv writes them neither; older checkpoints that hold these copies load, the copies ignored.

Shared layers (ALBERT-style, `share_layers`): the one block is written under every
`encoder.layer.{i}`, so transformers loads the file as an ordinary BERT computing the same
function; config.json records `qkv_share_layers: true`, and reading checks all layers are equal.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from qkv.models.bert import BertConfig, BertModel
from qkv.models.bert_heads import BertForPreTraining, BertForSequenceClassification
from qkv.models.checkpoints import fields
from qkv.models.checkpoints.core import CheckpointError, KeyMap, Tensors
from qkv.models.checkpoints.registry import Architecture, register

logger = logging.getLogger(__name__)

# checkpoint name -> qkv name: the embedding tables (a weight only), then modules with a bias
_TABLES = {
    "embeddings.word_embeddings": "embeddings.token_embedding",
    "embeddings.position_embeddings": "embeddings.position_embedding",
    "embeddings.token_type_embeddings": "embeddings.segment_embedding",
}
_LAYER = {  # under encoder.layer.{i}. in the checkpoint, layers.{i}. in qkv
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "ffn.up_proj",
    "output.dense": "ffn.down_proj",
    "output.LayerNorm": "norm2",
}
_PRETRAINING_HEADS = {
    "cls.predictions.transform.dense": "mlm_head.dense",
    "cls.predictions.transform.LayerNorm": "mlm_head.norm",
    "cls.seq_relationship": "nsp_head",
}
_HEAD_PREFIXES = ("cls.", "classifier.")
_IGNORED = ("embeddings.position_ids", "cls.predictions.decoder.weight")
_IGNORED_BIAS = "cls.predictions.decoder.bias"  # a copy of cls.predictions.bias
_LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def name_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(checkpoint name, qkv state_dict name) for every tensor of `model`.

    With shared layers several checkpoint names map to the one qkv block (layers.0).
    """
    config: BertConfig = model.config
    modules = [("embeddings.LayerNorm", "embeddings.norm")]
    for i in range(config.num_layers):
        block = 0 if config.share_layers else i
        modules += [(f"encoder.layer.{i}.{c}", f"layers.{block}.{q}") for c, q in _LAYER.items()]
    modules.append(("pooler.dense", "pooler"))
    pairs = [(f"{c}.weight", f"{q}.weight") for c, q in _TABLES.items()]
    pairs += [(f"{c}.{p}", f"{q}.{p}") for c, q in modules for p in ("weight", "bias")]
    if isinstance(model, BertModel):
        return pairs
    pairs = [(f"bert.{c}", f"bert.{q}") for c, q in pairs]
    if isinstance(model, BertForPreTraining):
        heads = list(_PRETRAINING_HEADS.items())
        pairs += [(f"{c}.{p}", f"{q}.{p}") for c, q in heads for p in ("weight", "bias")]
        pairs.append(("cls.predictions.bias", "mlm_head.bias"))
    else:
        pairs += [
            ("classifier.weight", "classifier.weight"),
            ("classifier.bias", "classifier.bias"),
        ]
    return pairs


def key_map(model: nn.Module) -> KeyMap:
    """The KeyMap of a qkv BERT model (BertModel or one with heads)."""
    pairs = name_pairs(model)
    with_heads = not isinstance(model, BertModel)

    def to_qkv(tensors: Tensors) -> Tensors:
        tensors = _normalise(tensors, with_heads)
        renamed: Tensors = {}
        for checkpoint_name, qkv_name in pairs:
            if checkpoint_name not in tensors:
                continue  # load_into reports it as missing
            tensor = tensors.pop(checkpoint_name)
            if qkv_name in renamed and not torch.equal(renamed[qkv_name], tensor):
                raise CheckpointError(
                    f"share_layers: {checkpoint_name} differs from the same tensor of layer 0; "
                    f"a model with shared layers needs every encoder.layer.* to be identical"
                )
            renamed[qkv_name] = tensor
        return {**renamed, **tensors}  # leftovers keep their names: load_into lists them

    def to_checkpoint(tensors: Tensors) -> Tensors:
        return {c: tensors[q] for c, q in pairs if q in tensors}

    return KeyMap(to_qkv=to_qkv, to_checkpoint=to_checkpoint, ignore=_IGNORED)


def _normalise(tensors: Tensors, with_heads: bool) -> Tensors:
    """Checkpoint keys in today's transformers form: `bert.` present for models with heads and
    absent for a bare encoder (either is accepted), LayerNorm.weight/bias, no duplicate bias."""
    out: Tensors = {}
    dropped = []
    for key, tensor in tensors.items():
        for legacy, current in _LEGACY.items():
            if key.endswith(legacy):
                key = key[: -len(legacy)] + current
        bare = key.removeprefix("bert.")
        if bare == _IGNORED_BIAS:
            continue
        if not with_heads and bare.startswith(_HEAD_PREFIXES):
            dropped.append(bare)
            continue
        is_head = bare.startswith(_HEAD_PREFIXES)
        out[bare if is_head or not with_heads else f"bert.{bare}"] = tensor
    if dropped:
        logger.info("BertModel: ignoring %d head tensors of the checkpoint", len(dropped))
    return out


# config.json field -> BertConfig field; the defaults of both are BERT-base, as in transformers
_CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embed_dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "ffn_dim",
    "max_position_embeddings": "max_positions",
    "type_vocab_size": "type_vocab_size",
    "layer_norm_eps": "norm_eps",
    "hidden_dropout_prob": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "pad_token_id": "pad_token_id",
}
_FLOATS = ("layer_norm_eps", "hidden_dropout_prob", "attention_probs_dropout_prob")
# written to config.json: what qkv's BERT computes (see _check_computable for reading)
_REQUIRED = {
    "model_type": "bert",
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}


def config_from_hf(hf: dict, *, tied_decoder: bool = False) -> BertConfig:
    """A transformers BERT config.json (as a dict) -> BertConfig, read as transformers 5's
    BertConfig reads it; CheckpointError if qkv's BERT cannot compute what it describes.
    `tied_decoder`: the model has an MLM decoder tied to the embedding (BertForPreTraining),
    so tie_word_embeddings must be true; the other models have no decoder to tie."""
    _check_computable(hf, tied_decoder)
    defaults = BertConfig()
    values = {}
    for key, ours in _CONFIG_FIELDS.items():
        if key == "pad_token_id":
            values[ours] = fields.optional_integer(hf, key) if key in hf else defaults.pad_token_id
        else:
            read = fields.number if key in _FLOATS else fields.integer
            values[ours] = read(hf, key, getattr(defaults, ours))
    values["share_layers"] = fields.boolean(hf, "qkv_share_layers", False)
    try:
        return BertConfig(**values)
    except (TypeError, ValueError) as error:  # named as config.json names the fields
        message = str(error)
        for key, ours in _CONFIG_FIELDS.items():
            message = re.sub(rf"\b{ours}\b", key, message)
        raise CheckpointError(f"config.json: {message}") from error


def _check_computable(hf: dict, tied_decoder: bool) -> None:
    model_type = hf.get("model_type", "bert")  # absent: BertConfig reads it all the same
    if model_type != "bert":
        raise CheckpointError(
            f"config.json: model_type is {model_type!r}; qkv's BERT expects 'bert'"
        )
    fields.activation(hf, "hidden_act", "gelu", ("gelu",))
    for field in ("is_decoder", "add_cross_attention"):
        if fields.boolean(hf, field, False):
            raise CheckpointError(f"config.json: {field} is True; qkv's BERT expects False")
    if tied_decoder and not fields.boolean(hf, "tie_word_embeddings", True):
        raise CheckpointError(
            "config.json: tie_word_embeddings is False; qkv's BertForPreTraining expects True "
            "(its MLM decoder is the word embedding matrix)"
        )
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":  # transformers 4 had relative_key(_query); 5 reads no such field
        logger.warning(
            "config.json: position_embedding_type=%r ignored: transformers 5's BERT (as qkv's) "
            "has absolute positions only", position,
        )  # fmt: skip


def config_to_hf(config: BertConfig, architecture: str) -> dict:
    """BertConfig -> a config.json dict that transformers' BertConfig reads."""
    hf = {c: getattr(config, q) for c, q in _CONFIG_FIELDS.items()}
    hf.update(_REQUIRED)
    hf.update(architectures=[architecture], initializer_range=0.02, classifier_dropout=None)
    if config.share_layers:
        hf["qkv_share_layers"] = True
    return hf


def _classifier_from_hf(hf: dict) -> BertForSequenceClassification:
    count, names = fields.labels(hf)
    return BertForSequenceClassification(config_from_hf(hf), count, label_names=names)


def _classifier_to_hf(model: BertForSequenceClassification) -> dict:
    hf = config_to_hf(model.config, "BertForSequenceClassification")
    hf["id2label"] = {str(i): name for i, name in enumerate(model.label_names)}
    hf["label2id"] = {name: i for i, name in enumerate(model.label_names)}
    return hf


register(
    Architecture(
        name="BertModel",
        model_class=BertModel,
        build=lambda hf: BertModel(config_from_hf(hf)),
        key_map=key_map,
        hf_config=lambda model: config_to_hf(model.config, "BertModel"),
    )
)
register(
    Architecture(
        name="BertForPreTraining",
        model_class=BertForPreTraining,
        build=lambda hf: BertForPreTraining(config_from_hf(hf, tied_decoder=True)),
        key_map=key_map,
        hf_config=lambda model: config_to_hf(model.config, "BertForPreTraining"),
    )
)
register(
    Architecture(
        name="BertForSequenceClassification",
        model_class=BertForSequenceClassification,
        build=_classifier_from_hf,
        key_map=key_map,
        hf_config=_classifier_to_hf,
    )
)
