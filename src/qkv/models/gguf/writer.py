"""A qkv `GPT` -> a GGUF file that llama.cpp, transformers and qkv read: `save_gguf`.

The inverse of `qkv.models.gguf.model`: the same tensor names, q/k rows reordered to llama.cpp's
adjacent-pair RoPE layout (`half_split_to_interleaved`), the metadata keys `qkv.models.gguf
.config` reads. Written with the gguf package's own writer. Float weights are stored as F32,
F16, BF16, Q8_0, Q4_1 or Q4_0 (norms and biases stay F32, as llama.cpp's converter keeps them;
the blocks are qkv's quantizers', byte for byte gguf.quants.quantize's). A model whose layers
are quantized already (`qkv.quantize`, `qkv.acceleration.quantized_from_gguf`: their weights
GGUF blocks) has those blocks written as they are, each in its own kind: a file read by
`quantized_from_gguf` and written again holds the same tensors, byte for byte. A tokenizer's
vocabulary is not written, so a file for llama.cpp needs `tokenizer.ggml.*` keys added by the
caller (`extra_metadata`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from qkv.models.gguf.model import gguf_tensor_names
from qkv.models.gguf.quants import quantize_q4_0, quantize_q4_1, quantize_q8_0
from qkv.models.gpt import GPT
from qkv.positional import half_split_to_interleaved

__all__ = ["WEIGHT_TYPES", "save_gguf"]

WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_0")
# llama.cpp's general.file_type: what most of the weights are
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
_QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1, "Q4_0": quantize_q4_0}


def save_gguf(
    model: GPT,
    path: str | Path,
    *,
    weight_type: str = "F32",
    extra_metadata: Mapping[str, object] | None = None,
) -> Path:
    """Write `model` (a Llama-style or GPT-2-style GPT) to the GGUF file at `path`.

    weight_type: the storage of the float matrices, one of WEIGHT_TYPES (a quantized layer's
    blocks are written in their own kind). extra_metadata: more key/values (strings, numbers,
    bools, lists), e.g. a tokenizer's `tokenizer.ggml.*` keys.
    """
    import gguf

    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type: expected one of {WEIGHT_TYPES}, got {weight_type!r}")
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected a qkv.models.GPT, got {type(model).__name__}")
    architecture = _architecture(model)
    path = Path(path)
    tensors = _gguf_tensors(model)
    writer = gguf.GGUFWriter(path, architecture)
    _write_metadata(writer, model, architecture, _file_type(tensors, weight_type))
    for key, value in (extra_metadata or {}).items():
        _add_value(writer, key, value)
    for name, (tensor, kind) in tensors.items():
        _add_tensor(writer, name, tensor, kind, weight_type, gguf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _architecture(model: GPT) -> str:
    config = model.config
    if (config.position, config.norm, config.ffn) == ("rope", "rmsnorm", "swiglu"):
        return "llama"
    if (config.position, config.norm, config.ffn, config.bias) == (
        "learned", "layernorm", "gelu_tanh", True,
    ):  # fmt: skip
        return "gpt2"
    raise ValueError(
        f"model: GGUF holds Llama-style (rope, rmsnorm, swiglu) or GPT-2-style (learned, "
        f"layernorm, gelu_tanh, bias) GPTs; got position={config.position!r}, "
        f"norm={config.norm!r}, ffn={config.ffn!r}, bias={config.bias}"
    )


def _write_metadata(writer, model: GPT, architecture: str, file_type: str) -> None:
    config = model.config
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_positions)
    writer.add_embedding_length(config.embed_dim)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.num_heads)
    writer.add_file_type(_FILE_TYPES[file_type])
    writer.add_uint32(f"{architecture}.vocab_size", config.vocab_size)
    if architecture == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
        return
    writer.add_head_count_kv(config.num_kv_heads or config.num_heads)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    scaling = config.rope_scaling
    if scaling is not None:
        if scaling.kind != "linear":
            raise ValueError(f"model: GGUF's llama keys hold a linear RoPE scaling; got "
                             f"{scaling.kind!r}")  # fmt: skip
        writer.add_string(f"{architecture}.rope.scaling.type", "linear")
        writer.add_rope_scaling_factor(scaling.factor)


def _gguf_tensors(model: GPT) -> dict[str, tuple[torch.Tensor, str | None]]:
    """The model's tensors under GGUF names, q/k rows in llama.cpp's RoPE layout, each with its
    kind: a quantized layer's blocks (uint8 rows) with theirs, a float tensor in fp32 with None
    (stored as `weight_type` says). A tied output layer (the embedding's very tensor) is left
    out, as llama.cpp's files leave it."""
    config = model.config
    theirs = {ours: name for name, ours in gguf_tensor_names(config.num_layers).items()}
    state = model.state_dict()
    if _tied(state):
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    out = {}
    for key, tensor in state.items():
        prefix, _, field = key.rpartition(".")
        if field == "blocks":  # a QuantizedLinear's or QuantizedEmbedding's GGUF blocks
            key, kind, tensor = f"{prefix}.weight", model.get_submodule(prefix).kind, tensor.cpu()
        else:
            kind, tensor = None, tensor.detach().float().cpu()
        if config.position == "rope" and ".q_proj." in key:
            tensor = half_split_to_interleaved(tensor, config.num_heads)
        elif config.position == "rope" and ".k_proj." in key:
            tensor = half_split_to_interleaved(tensor, config.num_kv_heads or config.num_heads)
        out[theirs[key]] = (tensor, kind)
    return _fused_gpt2_attention(out) if config.position == "learned" else out


def _tied(state: dict[str, torch.Tensor]) -> bool:
    """Whether the output layer's weight is the embedding's own tensor (float or blocks)."""
    head = state.get("lm_head.weight", state.get("lm_head.blocks"))
    table = state.get("token_embedding.weight", state.get("token_embedding.blocks"))
    return head is not None and table is not None and head.data_ptr() == table.data_ptr()


def _fused_gpt2_attention(tensors: dict) -> dict:
    """GPT-2's files hold one attn_qkv per block, rows [q | k | v]."""
    out = {}
    for name, entry in tensors.items():
        if ".attn_q." in name:
            parts = [tensors[name.replace(".attn_q.", f".attn_{p}.")] for p in "qkv"]
            kinds = {kind for _, kind in parts}
            if len(kinds) > 1:
                named = sorted(kind or "float" for kind in kinds)
                raise ValueError(f"model: GPT-2's fused attn_qkv needs q, k and v of one kind "
                                 f"(float, or blocks of one kind); {name}: {named}")  # fmt: skip
            fused = torch.cat([tensor for tensor, _ in parts], dim=0)
            out[name.replace(".attn_q.", ".attn_qkv.")] = (fused, kinds.pop())
        elif ".attn_k." not in name and ".attn_v." not in name:
            out[name] = entry
    return out


def _file_type(tensors: dict, weight_type: str) -> str:
    """The kind most of the matrices' bytes are stored in (llama.cpp's general.file_type)."""
    stored: dict[str, int] = {}
    for tensor, kind in tensors.values():
        if tensor.dim() == 2:
            kind = kind or weight_type
            stored[kind] = stored.get(kind, 0) + tensor.numel() * tensor.element_size()
    return max(stored, key=stored.get) if stored else weight_type


def _add_tensor(writer, name: str, tensor: torch.Tensor, kind, weight_type: str, gguf) -> None:
    """Blocks in their own `kind`; float matrices in `weight_type` (F16 where a row is not
    whole blocks of 32); vectors (norms, biases) in F32, as llama.cpp keeps them."""
    if kind is None:
        kind = weight_type if tensor.dim() == 2 else "F32"
        if kind in _QUANTIZERS and tensor.shape[-1] % 32:
            kind = "F16"  # a row that is not whole blocks of 32
        if kind in _QUANTIZERS:
            tensor = _QUANTIZERS[kind](tensor)
    raw_type = getattr(gguf.GGMLQuantizationType, kind)
    if kind == "F32":
        writer.add_tensor(name, tensor.numpy())
    elif kind == "F16":
        writer.add_tensor(name, tensor.half().numpy())
    elif kind == "BF16":
        raw = tensor.bfloat16().view(torch.int16).numpy().view(np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type)
    else:  # GGUF blocks (uint8 rows)
        raw = tensor.contiguous().numpy()
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type)


def _add_value(writer, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if 0 <= value < 2**32 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"extra_metadata[{key!r}]: expected a bool, int, float, str or list, got "
                        f"{type(value).__name__}")  # fmt: skip
