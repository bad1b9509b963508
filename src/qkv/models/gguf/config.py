"""GGUF metadata -> `GPTConfig`, for the two decoder families qkv reads from GGUF files.

llama.cpp keeps a model's hyperparameters under its architecture's name (the GGUF
specification's "LLM" keys), e.g. for general.architecture = "llama":

    llama.block_count                         num_layers
    llama.embedding_length                    embed_dim
    llama.feed_forward_length                 ffn_dim
    llama.attention.head_count(_kv)           num_heads, num_kv_heads (GQA: Ainslie et al. 2023)
    llama.context_length                      max_positions
    llama.rope.freq_base                      rope_base (10000 when absent)
    llama.rope.scaling.type / .factor         rope_scaling ("none" or "linear")
    llama.attention.layer_norm_rms_epsilon    norm_eps
    llama.attention.sliding_window            sliding_window (Mistral-style, when present)

Llama (Touvron et al. 2023): RMSNorm, SwiGLU, RoPE, no biases; tied embeddings where the file
has no output.weight. GPT-2 (Radford et al. 2019): LayerNorm with biases, tanh-GELU FFN,
learned positions. A key with the wrong type, or a value qkv does not model (a partial RoPE, a
mixture of experts, another scaling), is refused by name.
"""

from __future__ import annotations

from qkv.models.gguf.file import GGUFError, GGUFFile
from qkv.models.gpt import GPTConfig
from qkv.positional import RopeScaling

__all__ = ["ARCHITECTURES", "gguf_config"]

_MISSING = object()


class _Metadata:
    """Typed reads of one file's metadata, errors naming the file and the key."""

    def __init__(self, file: GGUFFile):
        self.values, self.path, self.prefix = file.metadata, file.path, file.architecture + "."

    def fail(self, key: str, expected: str) -> GGUFError:
        value = self.values.get(key, "absent")
        return GGUFError(f"path: {self.path}: metadata {key} is {value!r:.80}; expected {expected}")

    def get(self, key: str, default: object = _MISSING) -> object:
        key = key if key.startswith(("general.", "tokenizer.")) else self.prefix + key
        if key not in self.values and default is _MISSING:
            raise self.fail(key, "it in a model file")
        return self.values.get(key, default)

    def integer(self, key: str, default: object = _MISSING) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(self.prefix + key, "a non-negative integer")
        return value

    def number(self, key: str, default: object = _MISSING) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(self.prefix + key, "a number")
        return float(value)


def gguf_config(file: GGUFFile) -> GPTConfig:
    """The GPTConfig of a GGUF file's metadata (and, for the tied head, its tensor names)."""
    build = ARCHITECTURES.get(file.architecture)
    if build is None:
        raise GGUFError(f"path: {file.path}: general.architecture is {file.architecture!r}; "
                        f"qkv reads {sorted(ARCHITECTURES)}")  # fmt: skip
    try:
        return build(_Metadata(file), file)
    except (TypeError, ValueError) as error:  # GPTConfig's own checks
        if isinstance(error, GGUFError):
            raise
        raise GGUFError(f"path: {file.path}: {error}") from error


def _common(meta: _Metadata, file: GGUFFile) -> dict:
    embed_dim, heads = meta.integer("embedding_length"), meta.integer("attention.head_count")
    return {
        "vocab_size": _vocab_size(meta, file),
        "embed_dim": embed_dim,
        "num_layers": meta.integer("block_count"),
        "num_heads": heads,
        "ffn_dim": meta.integer("feed_forward_length"),
        "max_positions": meta.integer("context_length"),
        "tie_embeddings": "output.weight" not in file.tensors,
    }


def _vocab_size(meta: _Metadata, file: GGUFFile) -> int:
    """{arch}.vocab_size, else the tokenizer's token count, else the embedding's rows."""
    tokens = meta.get("tokenizer.ggml.tokens", None)
    embedding = file.tensors.get("token_embd.weight")
    fallback = len(tokens) if isinstance(tokens, list) else None
    if fallback is None and embedding is not None:
        fallback = embedding.shape[0]
    return meta.integer("vocab_size", fallback)


def _llama(meta: _Metadata, file: GGUFFile) -> GPTConfig:
    common = _common(meta, file)
    head_dim = common["embed_dim"] // max(common["num_heads"], 1)
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if meta.integer(key, head_dim) != head_dim:
            raise meta.fail(meta.prefix + key, f"{head_dim} (embedding_length / head_count)")
    if meta.integer("expert_count", 0):
        raise meta.fail(meta.prefix + "expert_count", "0 (qkv has no mixture of experts)")
    return GPTConfig(
        **common,
        num_kv_heads=meta.integer("attention.head_count_kv", common["num_heads"]),
        position="rope",
        rope_base=meta.number("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(meta),
        norm="rmsnorm",
        norm_eps=meta.number("attention.layer_norm_rms_epsilon", 1e-5),
        ffn="swiglu",
        bias="blk.0.attn_q.bias" in file.tensors,
        sliding_window=_window(meta),
    )


def _window(meta: _Metadata) -> int | None:
    present = meta.get("attention.sliding_window", None) is not None
    return meta.integer("attention.sliding_window") if present else None


def _rope_scaling(meta: _Metadata) -> RopeScaling | None:
    kind = meta.get("rope.scaling.type", "none")
    factor = meta.number("rope.scaling.factor", 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind != "linear":
        raise meta.fail(meta.prefix + "rope.scaling.type", "'none' or 'linear'")
    return RopeScaling("linear", factor)


def _gpt2(meta: _Metadata, file: GGUFFile) -> GPTConfig:
    return GPTConfig(
        **_common(meta, file),
        position="learned",
        norm="layernorm",
        norm_eps=meta.number("attention.layer_norm_epsilon", 1e-5),
        ffn="gelu_tanh",
        bias=True,
    )


ARCHITECTURES = {"llama": _llama, "mistral": _llama, "gpt2": _gpt2}
