"""Hugging Face `GPT2LMHeadModel` <-> `qkv.models.GPT` (Radford et al. 2019).

    transformer.wte.weight               token_embedding.weight
    transformer.wpe.weight               position_embedding.weight
    transformer.h.{i}.ln_1.*             blocks.{i}.attn_norm.*
    transformer.h.{i}.attn.c_attn.*      blocks.{i}.self_attn.{q,k,v}_proj.*   fused, split in 3
    transformer.h.{i}.attn.c_proj.*      blocks.{i}.self_attn.out_proj.*
    transformer.h.{i}.ln_2.*             blocks.{i}.ffn_norm.*
    transformer.h.{i}.mlp.c_fc.*         blocks.{i}.ffn.up_proj.*
    transformer.h.{i}.mlp.c_proj.*       blocks.{i}.ffn.down_proj.*
    transformer.ln_f.*                   final_norm.*
    lm_head.weight                       lm_head.weight: tied to wte, not saved by transformers

Two details of the original OpenAI code survive in the checkpoint. Its `Conv1D` stores weights
as (in, out), the transpose of `nn.Linear`'s (out, in). And c_attn is one (E, 3E) projection
whose output columns are [q | k | v], E each. Checkpoints saved from `GPT2Model` (as the hub's
"gpt2" is) have no "transformer." prefix; both spellings are read. The causal-mask buffers
older versions saved (`attn.bias`, `attn.masked_bias`) carry no weights and are skipped.
"""

from __future__ import annotations

import torch

from qkv.models.checkpoints import fields
from qkv.models.checkpoints.core import CheckpointError, KeyMap
from qkv.models.checkpoints.registry import Architecture, register
from qkv.models.gpt import GPT, GPTConfig

__all__ = ["gpt2_config", "gpt2_key_map", "gpt_config_from_gpt2"]

_PREFIX = "transformer."
_LAYER_NAMES = {  # checkpoint name inside h.{i}. -> (qkv name inside blocks.{i}., is Conv1D)
    "ln_1": ("attn_norm", False),
    "attn.c_proj": ("self_attn.out_proj", True),
    "ln_2": ("ffn_norm", False),
    "mlp.c_fc": ("ffn.up_proj", True),
    "mlp.c_proj": ("ffn.down_proj", True),
}


def _names(num_layers: int) -> tuple[dict[str, str], set[str]]:
    """Checkpoint key (without "transformer.") -> qkv key, and the qkv keys stored transposed."""
    names = {"wte.weight": "token_embedding.weight", "wpe.weight": "position_embedding.weight"}
    names |= {f"ln_f.{kind}": f"final_norm.{kind}" for kind in ("weight", "bias")}
    names["lm_head.weight"] = "lm_head.weight"
    transposed = set()
    for i in range(num_layers):
        for hf, (ours, conv1d) in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"h.{i}.{hf}.{kind}"] = f"blocks.{i}.{ours}.{kind}"
            if conv1d:
                transposed.add(f"blocks.{i}.{ours}.weight")
    return names, transposed


def gpt2_key_map(model: GPT) -> KeyMap:
    """Renames, Conv1D transposes, the c_attn split/fuse, and the tied head."""
    num_layers, tied = model.config.num_layers, model.config.tie_embeddings
    to_ours, transposed = _names(num_layers)
    to_theirs = {ours: hf for hf, ours in to_ours.items()}

    def to_qkv(tensors):
        tensors = {k.removeprefix(_PREFIX): t for k, t in tensors.items()}
        out = _split_fused_qkv(tensors, num_layers)
        for key, tensor in tensors.items():
            ours = to_ours.get(key, key)
            out[ours] = tensor.t() if ours in transposed else tensor  # (in, out) -> (out, in)
        if tied:  # the head is the embedding matrix, whatever copy a checkpoint carries
            out.pop("lm_head.weight", None)
            if "token_embedding.weight" in out:
                out["lm_head.weight"] = out["token_embedding.weight"]
        return out

    def to_checkpoint(tensors):
        tensors = dict(tensors)
        if tied:
            tensors.pop("lm_head.weight", None)
        out = _fuse_qkv(tensors, num_layers)
        for key, tensor in tensors.items():
            theirs = to_theirs.get(key, key)
            theirs = theirs if theirs == "lm_head.weight" else _PREFIX + theirs
            out[theirs] = tensor.t().contiguous() if key in transposed else tensor
        return out

    return KeyMap(to_qkv, to_checkpoint, ignore=(".attn.bias", ".attn.masked_bias"))


def _split_fused_qkv(tensors: dict, num_layers: int) -> dict:
    """Pop each h.{i}.attn.c_attn.{weight (E, 3E), bias (3E,)} and return q/k/v_proj tensors."""
    out = {}
    for i in range(num_layers):
        weight = tensors.pop(f"h.{i}.attn.c_attn.weight", None)
        bias = tensors.pop(f"h.{i}.attn.c_attn.bias", None)
        target = f"blocks.{i}.self_attn"
        if weight is not None:
            q, k, v = weight.t().chunk(3, dim=0)  # (3E, E) -> three (E, E), rows [q | k | v]
            out |= {f"{target}.q_proj.weight": q, f"{target}.k_proj.weight": k}
            out[f"{target}.v_proj.weight"] = v
        if bias is not None:
            q, k, v = bias.chunk(3)  # (3E,) -> three (E,)
            out |= {f"{target}.q_proj.bias": q, f"{target}.k_proj.bias": k}
            out[f"{target}.v_proj.bias"] = v
    return out


def _fuse_qkv(tensors: dict, num_layers: int) -> dict:
    """Pop blocks.{i}.self_attn.{q,k,v}_proj.* and return GPT-2's fused c_attn tensors."""
    out = {}
    for i in range(num_layers):
        source, target = f"blocks.{i}.self_attn", f"{_PREFIX}h.{i}.attn.c_attn"
        for kind in ("weight", "bias"):
            parts = [tensors.pop(f"{source}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                fused = torch.cat(parts, dim=0)  # (3E, E) or (3E,)
                out[f"{target}.{kind}"] = fused.t().contiguous() if kind == "weight" else fused
    return out


def gpt_config_from_gpt2(config: dict) -> GPTConfig:
    """config.json of a GPT-2 checkpoint -> GPTConfig, read as transformers 5's GPT2Config
    reads it (its aliases, its defaults); options qkv does not model raise."""
    sizes = _sizes(config)
    embed_dim = sizes["n_embd"]
    n_inner = fields.optional_integer(config, "n_inner")  # null: 4 * n_embd
    return GPTConfig(
        vocab_size=sizes["vocab_size"],
        embed_dim=embed_dim,
        num_layers=sizes["n_layer"],
        num_heads=sizes["n_head"],
        ffn_dim=4 * embed_dim if n_inner is None else n_inner,
        max_positions=sizes["n_positions"],
        position="learned",
        norm="layernorm",
        norm_eps=fields.number(config, "layer_norm_epsilon", 1e-5),
        ffn="gelu_tanh",
        bias=True,
        tie_embeddings=fields.boolean(config, "tie_word_embeddings", True),
        # embd_pdrop is the same as resid_pdrop in every release
        dropout=fields.number(config, "resid_pdrop", 0.1),
        attention_dropout=fields.number(config, "attn_pdrop", 0.1),
    )


# GPT2Config's field -> (its attribute_map alias, its default)
_SIZES = {
    "vocab_size": (None, 50257),
    "n_embd": ("hidden_size", 768),
    "n_layer": ("num_hidden_layers", 12),
    "n_head": ("num_attention_heads", 12),
    "n_positions": ("max_position_embeddings", 1024),
}


def _sizes(config: dict) -> dict[str, int]:
    """The sizes, each from its field or its alias (the alias wins, as in transformers), else
    GPT2Config's default; for a config.json of another model_type (a GPT read from a checkpoint
    of another family) GPT-2's own spellings are required, as nothing says it is a GPT-2.
    Raises for what qkv cannot compute."""
    present = {k: fields.aliased(config, k, a) if a else k for k, (a, _) in _SIZES.items()}
    if config.get("model_type") != "gpt2":
        missing = [key for key in _SIZES if key not in config]
        if missing:
            raise CheckpointError(
                f"config.json: missing {missing}; expected a GPT-2 config, got model_type "
                f"{config.get('model_type')!r}"
            )
    fields.activation(config, "activation_function", "gelu_new", ("gelu_tanh",))
    problems = []
    for flag, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if fields.boolean(config, flag, want) != want:
            problems.append(f"{flag}={config[flag]!r} (expected {want})")
    if problems:
        raise CheckpointError("config.json: unsupported " + "; ".join(problems))
    return {k: fields.integer(config, present[k], default) for k, (_, default) in _SIZES.items()}


def gpt2_config(model: GPT) -> dict:
    """GPT -> config.json of a GPT2LMHeadModel (raises CheckpointError if it is not one)."""
    config = model.config
    expected = {"position": "learned", "norm": "layernorm", "ffn": "gelu_tanh", "bias": True}
    problems = [
        f"{field}={getattr(config, field)!r} (expected {want!r})"
        for field, want in expected.items()
        if getattr(config, field) != want
    ]
    if config.num_kv_heads != config.num_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} (GPT-2's c_attn is plain MHA)")
    if config.sliding_window is not None:
        problems.append(f"sliding_window={config.sliding_window} (expected None)")
    if problems:
        raise CheckpointError("config: " + "; ".join(problems))
    dtype = str(model.token_embedding.weight.dtype).removeprefix("torch.")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.embed_dim,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.ffn_dim,
        "n_positions": config.max_positions,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attention_dropout,
        "tie_word_embeddings": config.tie_embeddings,
        "scale_attn_weights": True,
        "dtype": dtype,  # transformers 5
        "torch_dtype": dtype,  # transformers 4
    }


def _build(config: dict) -> GPT:
    return GPT(gpt_config_from_gpt2(config))


register(Architecture("GPT2LMHeadModel", GPT, _build, gpt2_key_map, gpt2_config))
