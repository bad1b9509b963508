"""A GGUF file -> a loaded `qkv.models.GPT`: `from_gguf(path)`.

llama.cpp names a decoder's tensors by role (its convert_hf_to_gguf.py writes them):

    token_embd.weight                 token_embedding.weight           (V, E)
    position_embd.weight              position_embedding.weight        GPT-2 only
    blk.{i}.attn_norm.*               blocks.{i}.attn_norm.*
    blk.{i}.attn_{q,k,v}.*            blocks.{i}.self_attn.{q,k,v}_proj.*
    blk.{i}.attn_qkv.*                the three above, fused [q | k | v] (GPT-2)
    blk.{i}.attn_output.*             blocks.{i}.self_attn.out_proj.*
    blk.{i}.ffn_norm.*                blocks.{i}.ffn_norm.*
    blk.{i}.ffn_{gate,up,down}.*      blocks.{i}.ffn.{gate,up,down}_proj.*
    output_norm.*                     final_norm.*
    output.weight                     lm_head.weight                   absent when tied

GGUF lists a tensor's dims innermost first, so a matrix of ne = [in, out] is PyTorch's
(out, in): nn.Linear's layout, no transpose. For RoPE, llama.cpp's converter reorders the rows
of attn_q and attn_k within each head so that its kernel rotates adjacent pairs (2j, 2j + 1);
qkv rotates the half-split pairs (j, j + D/2), as transformers does, so those rows are put back
with `interleaved_to_half_split`. The config comes from `gguf_config` (`qkv.models.gguf.config`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qkv.models.building import built_on_meta
from qkv.models.checkpoints.core import CheckpointError
from qkv.models.gguf.config import gguf_config
from qkv.models.gguf.file import GGUFError, GGUFFile, read_gguf
from qkv.models.gguf.quants import BLOCK_FORMATS, dequantize
from qkv.models.gpt import GPT
from qkv.models.gpt_config import GPTConfig
from qkv.positional import interleaved_to_half_split

__all__ = [
    "from_gguf",
    "gguf_keys",
    "gguf_tensor_names",
    "load_gguf_tensors",
    "model_from_file",
    "rope_rows_to_qkv",
]

logger = logging.getLogger(__name__)

_LAYER_NAMES = {  # GGUF name inside blk.{i}. -> qkv name inside blocks.{i}. (weights and biases)
    "attn_norm": "attn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "ffn.gate_proj",
    "ffn_up": "ffn.up_proj",
    "ffn_down": "ffn.down_proj",
}
_TOP_NAMES = {
    "token_embd": "token_embedding",
    "position_embd": "position_embedding",
    "output_norm": "final_norm",
    "output": "lm_head",
}


def gguf_tensor_names(num_layers: int) -> dict[str, str]:
    """Every GGUF tensor name qkv reads -> the qkv state_dict key it fills."""
    names = {}
    for kind in ("weight", "bias"):
        names |= {f"{theirs}.{kind}": f"{ours}.{kind}" for theirs, ours in _TOP_NAMES.items()}
        for i in range(num_layers):
            for theirs, ours in _LAYER_NAMES.items():
                names[f"blk.{i}.{theirs}.{kind}"] = f"blocks.{i}.{ours}.{kind}"
    return names


def from_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32) -> GPT:
    """Load the GGUF file at `path` (llama or GPT-2 architecture) as a GPT in eval mode.

    Quantized tensors are dequantized (`qkv.models.gguf.quants`) and the model holds them in
    `dtype`. Anything qkv cannot read (another architecture, a ggml type without a
    dequantizer, a missing or unexpected tensor) raises a GGUFError or CheckpointError that
    names it, before the weights are dequantized.
    """
    return model_from_file(read_gguf(path), dtype=dtype)


def model_from_file(file: GGUFFile, *, dtype: torch.dtype = torch.float32) -> GPT:
    """`from_gguf` on a file already read by `read_gguf`: its metadata then also gives the
    tokenizer and the chat template (`qkv.data.gguf_tokenizer`) without a second read."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    config = gguf_config(file)
    model = built_on_meta(lambda: GPT(config))  # no memory: every weight comes from the file
    tensors = load_gguf_tensors(file, model, dtype=dtype)  # names and shapes checked first
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as error:
        raise CheckpointError(f"path: {file.path}: {error}") from error
    if config.tie_embeddings:  # one (V, E) Parameter again, as GPT ties it
        model.lm_head.weight = model.token_embedding.weight
    logger.info("loaded %s: %s", file.path, config)
    return model.eval()


def load_gguf_tensors(
    file: GGUFFile, model: GPT, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The file's tensors under qkv's names, dequantized to `dtype`, q/k rows in qkv's RoPE
    layout, the head tied to the embedding when the file has no output.weight. `model` (on any
    device, "meta" included) gives the names and shapes, checked before anything is
    dequantized."""
    config = model.config
    names = gguf_tensor_names(config.num_layers)
    unknown = sorted(set(file.tensors) - set(names) - _fused_names(config.num_layers))
    if unknown:
        raise GGUFError(f"path: {file.path} has tensors qkv does not read: {unknown[:10]}")
    _check_shapes(file, model.state_dict(), names)
    unreadable = sorted(
        f"{n} ({t.kind})" for n, t in file.tensors.items() if t.kind not in BLOCK_FORMATS
    )
    if unreadable:
        raise GGUFError(f"path: {file.path}: qkv has no dequantizer for {unreadable[:5]}; it "
                        f"reads {sorted(BLOCK_FORMATS)}")  # fmt: skip
    tensors = {}
    for name, tensor in file.tensors.items():
        values = dequantize(tensor.raw, tensor.kind, tensor.shape).to(dtype)
        file.release(tensor.raw)  # decoded: its pages need not stay on top of the model
        tensors |= _renamed(name, values, names, config)
    if config.tie_embeddings:
        tensors["lm_head.weight"] = tensors["token_embedding.weight"]
    return tensors


def _fused_names(num_layers: int) -> set[str]:
    return {f"blk.{i}.attn_qkv.{kind}" for i in range(num_layers) for kind in ("weight", "bias")}


def _renamed(name: str, values: torch.Tensor, names: dict[str, str], config) -> dict:
    """One GGUF tensor -> the qkv tensors it fills (three for a fused attn_qkv)."""
    keys = gguf_keys(name, names)
    parts = values.chunk(len(keys), dim=0)  # GPT-2's (3E, E) -> three (E, E), (3E,) -> (E,)
    return {key: rope_rows_to_qkv(key, part, config) for key, part in zip(keys, parts, strict=True)}


def gguf_keys(name: str, names: dict[str, str]) -> list[str]:
    """The qkv keys one GGUF tensor fills (`names`: `gguf_tensor_names`): three for GPT-2's
    fused attn_qkv (rows [q | k | v]), none for a tensor qkv does not read."""
    if ".attn_qkv." in name:
        prefix, kind = name.replace("blk.", "blocks.").split(".attn_qkv.")
        return [f"{prefix}.self_attn.{p}_proj.{kind}" for p in "qkv"]
    return [names[name]] if name in names else []


def rope_rows_to_qkv(key: str, values: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """q/k rows (weights, biases, or their quantized blocks) from llama.cpp's adjacent-pair
    RoPE layout to qkv's half-split one; any other tensor as it is."""
    heads = rope_heads(key, config)
    return values if heads is None else interleaved_to_half_split(values, heads)


def rope_heads(key: str, config: GPTConfig) -> int | None:
    """The heads whose rows the tensor `key` (a qkv name) holds in llama.cpp's RoPE layout: a
    q or k projection's of a RoPE model; None for any other."""
    if config.position == "rope" and ".q_proj." in key:
        return config.num_heads
    if config.position == "rope" and ".k_proj." in key:
        return config.num_kv_heads or config.num_heads
    return None


def _check_shapes(file: GGUFFile, expected: dict, names: dict[str, str]) -> None:
    """Missing and mis-shaped tensors, named, before anything is dequantized."""
    given = {names[n] for n in file.tensors if n in names}
    given |= {
        n.replace("blk.", "blocks.").replace(".attn_qkv.", f".self_attn.{p}_proj.")
        for n in file.tensors if ".attn_qkv." in n for p in "qkv"
    }  # fmt: skip
    tied = "lm_head.weight" if "output.weight" not in file.tensors else None
    missing = sorted(set(expected) - given - {tied})
    unexpected = sorted(n for n in file.tensors if n in names and names[n] not in expected)
    misshaped = [
        f"{name}: file {tensor.shape}, model {tuple(expected[names[name]].shape)}"
        for name, tensor in file.tensors.items()
        if name in names and names[name] in expected
        and tuple(expected[names[name]].shape) != tensor.shape
    ]  # fmt: skip
    if missing or unexpected or misshaped:
        theirs = {ours: theirs for theirs, ours in names.items()}
        missing = [theirs.get(key, key) for key in missing]
        raise GGUFError(f"path: {file.path} does not fit the model its metadata describes: "
                        f"missing {missing[:10]}, unexpected {unexpected[:10]} (a model "
                        f"without biases), mis-shaped {misshaped[:10]}")  # fmt: skip
