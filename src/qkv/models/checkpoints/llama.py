"""Hugging Face `LlamaForCausalLM` and `MistralForCausalLM` <-> `qkv.models.GPT`.

Both checkpoints share one layout (Touvron et al. 2023; Jiang et al. 2023):

    model.embed_tokens.weight                       token_embedding.weight
    model.layers.{i}.input_layernorm.weight         blocks.{i}.attn_norm.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.*       blocks.{i}.self_attn.{q,k,v}_proj.*
    model.layers.{i}.self_attn.o_proj.*             blocks.{i}.self_attn.out_proj.*
    model.layers.{i}.post_attention_layernorm.weight blocks.{i}.ffn_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.*      blocks.{i}.ffn.{gate,up,down}_proj.*
    model.norm.weight                               final_norm.weight
    lm_head.weight                                  lm_head.weight (absent when tied)

RoPE: Hugging Face stores q/k_proj already permuted for the half-split layout (`rotate_half`),
which is qkv's layout "half", so no permutation is needed. k/v_proj have num_key_value_heads *
head_dim rows (GQA/MQA).

Mistral's sliding window: transformers 5.x builds it as `kv_idx > q_idx - sliding_window` on top
of the causal mask (masking_utils.sliding_window_overlay), i.e. query i sees keys
i - W < j <= i: itself and the W - 1 keys before it. That is exactly qkv's `window=W`, so the
number is carried over unchanged.

RoPE: config.json is read as transformers 5 reads it (configuration_utils.PreTrainedConfig
.__post_init__ -> modeling_rope_utils.RotaryEmbeddingConfigMixin.convert_rope_params_to_dict and
standardize_rope_params): a non-empty `rope_scaling` replaces `rope_parameters` whole; then
rope_theta and partial_rotary_factor come from that object, else from the top level of
config.json (rope_theta 10000.0 when absent everywhere); a top-level
original_max_position_embeddings wins for "yarn", "llama3" and "longrope" (Phi-3 keeps it
there), else the object's, else max_position_embeddings. A rope_type of "linear", "dynamic",
"yarn", "llama3", "longrope" or "proportional" becomes `GPTConfig.rope_scaling` (see
`qkv.positional.RopeScaling`) and is written back in both places; other types are refused.
"""

from __future__ import annotations

import logging

from qkv.models.checkpoints import fields
from qkv.models.checkpoints.core import CheckpointError, KeyMap
from qkv.models.checkpoints.registry import Architecture, register
from qkv.models.gpt import GPT, GPTConfig
from qkv.positional import RopeScaling
from qkv.positional.rope_scaling_hf import rope_scaling_from_hf, scaling_to_hf

__all__ = ["gpt_config_from_llama", "llama_config", "llama_key_map", "mistral_config"]

logger = logging.getLogger(__name__)

_LAYER_NAMES = {  # checkpoint name inside model.layers.{i}. -> qkv name inside blocks.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{
        f"self_attn.{hf}.{kind}": f"self_attn.{ours}.{kind}"
        for hf, ours in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"))
        + (("o_proj", "out_proj"),)
        for kind in ("weight", "bias")
    },
    **{
        f"mlp.{name}.{kind}": f"ffn.{name}.{kind}"
        for name in ("gate_proj", "up_proj", "down_proj")
        for kind in ("weight", "bias")
    },
}


def _names(num_layers: int) -> dict[str, str]:
    """Every checkpoint key -> qkv key, for a model with `num_layers` blocks."""
    names = {
        "model.embed_tokens.weight": "token_embedding.weight",
        "model.norm.weight": "final_norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    for i in range(num_layers):
        for hf, ours in _LAYER_NAMES.items():
            names[f"model.layers.{i}.{hf}"] = f"blocks.{i}.{ours}"
    return names


def llama_key_map(model: GPT) -> KeyMap:
    """Renames only: Llama's nn.Linear weights are stored as qkv stores them, (out, in)."""
    to_ours = _names(model.config.num_layers)
    to_theirs = {ours: hf for hf, ours in to_ours.items()}
    tied = model.config.tie_embeddings

    def to_qkv(tensors):
        renamed = {to_ours.get(k, k): t for k, t in tensors.items()}
        if tied:  # the head is the embedding; a saved copy (older writers) is not needed
            renamed["lm_head.weight"] = renamed.get("token_embedding.weight")
        return {k: t for k, t in renamed.items() if t is not None}

    def to_checkpoint(tensors):
        kept = {k: t for k, t in tensors.items() if not (tied and k == "lm_head.weight")}
        return {to_theirs.get(k, k): t for k, t in kept.items()}

    return KeyMap(to_qkv=to_qkv, to_checkpoint=to_checkpoint, ignore=("rotary_emb.inv_freq",))


def gpt_config_from_llama(config: dict) -> GPTConfig:
    """config.json of a Llama or Mistral checkpoint -> GPTConfig, read as transformers 5's
    LlamaConfig / MistralConfig (chosen by model_type) reads it; unsupported options raise."""
    defaults = _defaults(config)
    heads = fields.integer(config, "num_attention_heads", defaults["num_attention_heads"])
    kv_heads = fields.optional_integer(config, "num_key_value_heads")
    if "num_key_value_heads" not in config:
        kv_heads = defaults["num_key_value_heads"]
    bias = _bias(config)
    max_positions = fields.integer(config, "max_position_embeddings", defaults["max_positions"])
    rope = _rope_parameters(config)
    dropout = config.get("attention_dropout")  # LlamaConfig takes null: no dropout
    window = _window(config, defaults["sliding_window"])
    return GPTConfig(
        vocab_size=fields.integer(config, "vocab_size", defaults["vocab_size"]),
        embed_dim=fields.integer(config, "hidden_size", defaults["hidden_size"]),
        num_layers=fields.integer(config, "num_hidden_layers", defaults["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads or heads,
        ffn_dim=fields.integer(config, "intermediate_size", defaults["intermediate_size"]),
        max_positions=max_positions,
        position="rope",
        rope_base=fields.number(rope, "rope_theta"),
        rope_scaling=_rope_scaling(rope, max_positions),
        norm="rmsnorm",
        norm_eps=fields.number(config, "rms_norm_eps", 1e-6),
        ffn="swiglu",
        bias=bias,
        tie_embeddings=fields.boolean(config, "tie_word_embeddings", False),
        sliding_window=window,
        attention_dropout=0.0 if dropout is None else fields.number(config, "attention_dropout"),
    )


# transformers 5's defaults of the fields a config.json may leave out (LlamaConfig, MistralConfig)
_LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "max_positions": 2048, "sliding_window": None,
}  # fmt: skip
_MISTRAL_DEFAULTS = _LLAMA_DEFAULTS | {
    "intermediate_size": 14336, "num_key_value_heads": 8, "max_positions": 4096 * 32,
    "sliding_window": 4096,
}  # fmt: skip
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _defaults(config: dict) -> dict:
    """The defaults of the config class transformers picks by model_type ("llama", "mistral");
    for another or no model_type (a GPT read from a checkpoint of another family) the sizes
    are required, as nothing says which defaults would hold. Raises for what qkv cannot compute."""
    model_type = config.get("model_type")
    if model_type not in ("llama", "mistral"):
        missing = [key for key in (*_SIZES, "intermediate_size") if key not in config]
        if missing:
            raise CheckpointError(
                f"config.json: missing {missing}; expected a Llama/Mistral config, got "
                f"model_type {model_type!r}"
            )
    defaults = _MISTRAL_DEFAULTS if model_type == "mistral" else _LLAMA_DEFAULTS
    fields.activation(config, "hidden_act", "silu", ("silu",))  # SwiGLU: silu(gate) * up
    heads = fields.integer(config, "num_attention_heads", defaults["num_attention_heads"])
    hidden = fields.integer(config, "hidden_size", defaults["hidden_size"])
    head_dim = fields.optional_integer(config, "head_dim")
    if head_dim is not None and head_dim != hidden // max(heads, 1):
        raise CheckpointError(
            f"config.json: unsupported head_dim={head_dim} (qkv's GPT computes "
            f"hidden_size // num_attention_heads = {hidden // max(heads, 1)})"
        )
    return defaults


def _window(config: dict, default: int | None) -> int | None:
    """Mistral's sliding_window (MistralConfig: 4096 when absent; null: none). transformers'
    Llama never reads it; a checkpoint of another model_type keeps it, as qkv wrote it."""
    if config.get("model_type") != "llama":
        window = config.get("sliding_window", default)
        return None if window is None else fields.integer(config, "sliding_window", window)
    if config.get("sliding_window") is not None:
        logger.warning(
            "config.json: sliding_window=%r ignored: transformers' Llama attends to every "
            "earlier position (a window is a Mistral's)", config["sliding_window"],
        )  # fmt: skip
    return None


def _bias(config: dict) -> bool:
    """Llama: attention_bias on q/k/v/o_proj, mlp_bias on the MLP, which qkv's one `bias`
    computes only when equal. Mistral has no biases: transformers ignores both fields."""
    attention = fields.boolean(config, "attention_bias", False)
    mlp = fields.boolean(config, "mlp_bias", False)
    if config.get("model_type") == "mistral":
        if attention or mlp:
            logger.warning(
                "config.json: attention_bias / mlp_bias ignored: transformers' Mistral has no "
                "biases"
            )
        return False
    if mlp != attention:
        raise CheckpointError(
            f"config.json: unsupported mlp_bias={mlp} with attention_bias={attention} (qkv has "
            f"one `bias` for both; expected them equal)"
        )
    return attention


def _rope_parameters(config: dict) -> dict:
    """The RoPE object of config.json, resolved as transformers 5 resolves it (see the module
    docstring): `rope_scaling` when non-empty, else `rope_parameters`, with rope_theta,
    partial_rotary_factor and original_max_position_embeddings filled in."""
    scaling = fields.mapping(config, "rope_scaling")
    parameters = dict(scaling or fields.mapping(config, "rope_parameters"))
    parameters.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in config:
        parameters.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind in ("yarn", "llama3", "longrope") and "original_max_position_embeddings" in config:
        parameters["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    if scaling:
        _warn_set_aside(fields.mapping(config, "rope_parameters"), parameters)
    return parameters


def _warn_set_aside(set_aside: dict, applied: dict) -> None:
    """rope_parameters loses to a rope_scaling next to it; say so when it would differ."""
    differing = {key: value for key, value in set_aside.items() if applied.get(key) != value}
    if differing:
        logger.warning(
            "config.json: rope_scaling %s is applied and rope_parameters' %s ignored, as "
            "transformers reads them", applied, differing,
        )  # fmt: skip


def _rope_scaling(parameters: dict, max_positions: int) -> RopeScaling | None:
    """The RoPE scaling rule of the resolved object, None for plain RoPE; CheckpointError for
    one qkv cannot compute."""
    try:
        return rope_scaling_from_hf(parameters, max_positions=max_positions)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"config.json: unsupported {error}") from error


def _check_llama_layout(config: GPTConfig, *, windowed: bool) -> None:
    """Raise CheckpointError unless `config` is a Llama-style (or Mistral-style) model."""
    problems = [
        f"{field}={getattr(config, field)!r} (expected {want!r})"
        for field, want in (("position", "rope"), ("norm", "rmsnorm"), ("ffn", "swiglu"))
        if getattr(config, field) != want
    ]
    if config.dropout:
        problems.append(f"dropout={config.dropout} (Llama has attention dropout only; expected 0)")
    if windowed and config.bias:
        problems.append("bias=True (Mistral has no attention_bias; expected False)")
    scaling = config.rope_scaling
    dynamic = scaling is not None and scaling.kind == "dynamic"
    if dynamic and scaling.original_max_positions != config.max_positions:
        problems.append(
            f"rope_scaling.original_max_positions={scaling.original_max_positions} (dynamic "
            f"NTK in transformers starts at max_position_embeddings; expected "
            f"{config.max_positions})"
        )
    if windowed != (config.sliding_window is not None):
        want = "an int (Mistral)" if windowed else "None (Llama; use Mistral for a window)"
        problems.append(f"sliding_window={config.sliding_window!r} (expected {want})")
    if problems:
        raise CheckpointError("config: " + "; ".join(problems))


def _common_config(model: GPT) -> dict:
    config = model.config
    dtype = str(model.token_embedding.weight.dtype).removeprefix("torch.")
    rope = {"rope_theta": config.rope_base, "rope_type": "default"}
    scaling = {}
    if config.rope_scaling is not None:
        scaling = {"rope_scaling": scaling_to_hf(config.rope_scaling)}
        rope.update(scaling["rope_scaling"])
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim,
        "max_position_embeddings": config.max_positions,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope,  # transformers 5
        "rope_theta": config.rope_base,  # transformers 4
        **scaling,  # transformers 4
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": config.attention_dropout,
        "dtype": dtype,  # transformers 5
        "torch_dtype": dtype,  # transformers 4
    }


def llama_config(model: GPT) -> dict:
    """GPT -> config.json of a LlamaForCausalLM (raises CheckpointError if it is not one)."""
    config = model.config
    _check_llama_layout(config, windowed=False)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(model),
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
    }


def mistral_config(model: GPT) -> dict:
    """GPT -> config.json of a MistralForCausalLM (a Llama layout with a sliding window)."""
    config = model.config
    _check_llama_layout(config, windowed=True)
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **_common_config(model),
        "sliding_window": config.sliding_window,
    }


def _build(config: dict) -> GPT:
    return GPT(gpt_config_from_llama(config))


register(Architecture("LlamaForCausalLM", GPT, _build, llama_key_map, llama_config))
register(Architecture("MistralForCausalLM", GPT, _build, llama_key_map, mistral_config))
