"""Whole models with quantized linears: `quantize(model)`, `quantized_from_gguf(path)`, and
`explain_quantized(model)`, which says what computes them here.

    model = qkv.acceleration.quantized_from_gguf(path)   # the file's blocks, never dequantized
    print(qkv.acceleration.explain_quantized(model))
    tokens = qkv.generate(model, prompt, max_new_tokens=64)

`quantize(model, "Q4_1")` quantizes a float model's linears in place (`QuantizedLinear`). The
model's own modules are replaced for good, so that their float weights can be freed; the
layers and models themselves stay plain PyTorch and know nothing of it. Both compute the linears
that read one input (q, k and v; gate and up) as one product (`share_quantized_inputs`).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from qkv import capabilities
from qkv.acceleration.quantized import (
    BLOCK,
    INT4PACK_OPS,
    KINDS,
    QuantizedLinear,
    quantized_kernel,
)
from qkv.acceleration.quantized_embedding import QuantizedEmbedding
from qkv.acceleration.quantized_sharing import share_quantized_inputs
from qkv.models.building import built_on_meta, return_freed_heap
from qkv.models.gguf.config import gguf_config
from qkv.models.gguf.file import GGUFError, GGUFFile, GGUFTensor, read_gguf
from qkv.models.gguf.model import gguf_keys, gguf_tensor_names, rope_heads, rope_rows_to_qkv
from qkv.models.gguf.quants import BLOCK_FORMATS, dequantize
from qkv.models.gpt import GPT

__all__ = ["explain_quantized", "quantize", "quantized_from_gguf", "quantized_pays"]

EMBEDDING = "token_embedding.weight"
# the kinds whose kernel here decodes faster than the fp32 model, where it is the kernel chosen
# (benchmarks/decode_smollm2.py): int4pack reads a quarter of the bytes of bf16, its pair form
# half (Q8_0); Q8_0's exact int8-blocks product reads int8 codes but writes fp32 chunks, no
# faster than fp32 itself, so a Q8_0 file pays only where the pair form runs
FASTER_THAN_FP32 = {"Q4_0": "int4pack", "Q4_1": "int4pack", "Q8_0": "int4pack-pair"}

logger = logging.getLogger(__name__)


def quantize(model: nn.Module, kind: str = "Q4_1", *, head_kind: str | None = "Q8_0") -> nn.Module:
    """Replace every `nn.Linear` of `model` (that very class) by a `QuantizedLinear` of `kind`,
    in place, and return the model. A linear whose in_features is not a multiple of 32 (a
    block) is left as it is, and logged. The model's `lm_head` (a GPT's output layer, tied to
    the embedding or not) gets `head_kind` instead: Q8_0 by default, as llama.cpp keeps the
    output layer at a higher precision than the rest, and with fp32 outputs (`fp32_output`: its
    logits are not rounded to bf16); None leaves it as it is. A tied head is
    untied: the embedding keeps its float weight. A linear shared by several parents becomes
    one QuantizedLinear."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    for name, value in (("kind", kind), ("head_kind", head_kind)):
        if value not in KINDS and not (name == "head_kind" and value is None):
            raise ValueError(f"{name}: expected one of {KINDS}, got {value!r}")
    done: dict[nn.Linear, QuantizedLinear] = {}
    left = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            label = f"{parent_name}.{name}" if parent_name else name
            wanted = head_kind if parent is model and name == "lm_head" else kind
            reason = _why_not(child, wanted)
            if reason:
                if type(child) is nn.Linear:
                    left.append(f"{label} ({reason})")
                continue
            if child not in done:
                head = parent is model and name == "lm_head"  # logits: fp32 where it can
                done[child] = QuantizedLinear.from_linear(child, wanted, fp32_output=head)
            setattr(parent, name, done[child])
    logger.info("quantize: %d linears quantized; left as nn.Linear: %s", len(done),
                "; ".join(left) or "none")  # fmt: skip
    return share_quantized_inputs(model)


def _why_not(child: nn.Module, kind: str | None) -> str:
    """Why `child` is not quantized to `kind` ("" when it is)."""
    if type(child) is not nn.Linear:
        return "not an nn.Linear"
    if kind is None:
        return "head_kind=None"
    if child.weight.device.type != "cpu" or not child.weight.is_floating_point():
        return f"a {child.weight.dtype} weight on {child.weight.device}; the kernels are CPU ones"
    if child.in_features % BLOCK:
        return f"in_features={child.in_features} is not a multiple of the block size {BLOCK}"
    return ""


def quantized_from_gguf(source: str | Path | GGUFFile) -> GPT:
    """The GGUF file at `source` (a path, or a file read by `qkv.models.gguf.read_gguf`) as a
    GPT in eval mode whose linears stored as Q4_0, Q4_1 or Q8_0 are `QuantizedLinear`s on the
    file's blocks, never dequantized (q/k rows reordered for qkv's RoPE layout, as
    `qkv.models.from_gguf` does, the blocks kept in the file's order: `rope_heads`). A token
    embedding of one of those types is a
    `QuantizedEmbedding` on its blocks (each lookup dequantizes its rows), and a tied output
    layer (no output.weight) a QuantizedLinear on the same blocks: the table is in memory once.
    Norms, biases and tensors of other types are dequantized to fp32, as `from_gguf` does; a
    tied output layer then shares the embedding's fp32 weight."""
    file = source if isinstance(source, GGUFFile) else read_gguf(source)
    config = gguf_config(file)
    model = built_on_meta(lambda: GPT(config))  # no memory: every weight comes from the file
    dense, quantized = _file_tensors(file, model)
    tied = config.tie_embeddings and "output.weight" not in file.tensors
    embedding = quantized.pop("token_embedding", None)  # (blocks, kind, None) or None: dense
    if embedding is not None and tied:  # one table in memory, for the lookup and the output
        quantized = {"lm_head": embedding, **quantized}  # first: its pages go before the rest
    biases = {path: dense.pop(f"{path}.bias", None) for path in quantized}
    # The dense tensors first: loading a state dict lays every QuantizedLinear out again
    result = model.load_state_dict(dense, strict=False, assign=True)
    if tied and embedding is None:
        model.lm_head.weight = model.token_embedding.weight  # one fp32 (V, E) matrix
    kept = {*quantized, "token_embedding"} if embedding is not None else set(quantized)
    missing = [
        key for key in result.missing_keys
        if key.rpartition(".")[0] not in kept and not (tied and key == "lm_head.weight")
    ]  # fmt: skip
    if result.unexpected_keys or missing:
        unexpected = result.unexpected_keys[:10]
        raise GGUFError(
            f"path: {file.path} does not fit the model its metadata describes: missing "
            f"{missing[:10]}, unexpected {unexpected}"
        )
    if embedding is not None:
        model.token_embedding = QuantizedEmbedding(*embedding[:2])
    for path, (blocks, kind, heads) in quantized.items():
        parent, _, name = path.rpartition(".")
        head = path == "lm_head"  # its logits stay fp32 where a kernel can (Q8_0)
        linear = QuantizedLinear(blocks, kind, bias=biases[path], fp32_output=head,
                                 rope_heads=heads)  # fmt: skip
        model.get_submodule(parent).register_module(name, linear)
        file.release(blocks)  # laid out for its kernel: the file's pages go until read again
        return_freed_heap()  # and the temporaries of the layout
    for module in model.modules():  # one module at a time, each one's freed layouts returned
        share_quantized_inputs(module, recurse=False)
        return_freed_heap()
    logger.info("loaded %s: %d quantized linears; %s", file.path, len(quantized), config)
    return model.eval()


def quantized_pays(source: str | Path | GGUFFile) -> capabilities.Support:
    """Should the GGUF file at `source` decode with its blocks kept (`quantized_from_gguf`)
    rather than dequantized to fp32? Yes where most of its linear weights (by bytes) are of a
    kind whose kernel here is faster than fp32 (`FASTER_THAN_FP32`: Q4_0, Q4_1 by int4pack,
    Q8_0 by its pair form).
    Decided from the file and what this machine's PyTorch can run, never from a timing."""
    file = source if isinstance(source, GGUFFile) else read_gguf(source)
    names = gguf_tensor_names(gguf_config(file).num_layers)
    linear = [t for name, t in file.tensors.items()
              if t.kind in KINDS and len(t.shape) == 2 and name != "token_embd.weight"
              and gguf_keys(name, names)]  # fmt: skip
    fast = [t for t in linear if quantized_kernel(t.kind)[0] == FASTER_THAN_FP32.get(t.kind)]
    total = sum(t.raw.nbytes for t in file.tensors.values())
    share = sum(t.raw.nbytes for t in fast) / max(1, total)
    kinds = ", ".join(sorted({t.kind for t in linear})) or "no Q4_0, Q4_1 or Q8_0"
    if share > 0.5:
        return capabilities.Support(True, f"{len(fast)} {kinds} linear weights ({share:.0%} of "
                                          "the file) by PyTorch's int4pack kernel")  # fmt: skip
    why = f"{kinds} linear weights: {share:.0%} of the file has a kernel faster than fp32 here"
    unserved = [t.kind for t in linear if t.kind in FASTER_THAN_FP32]
    if unserved:  # weights whose int4pack kernel does not serve here: say why
        why += f" ({quantized_kernel(unserved[0])[1].reason})"
    return capabilities.Support(False, why)


def _file_tensors(file: GGUFFile, model: GPT) -> tuple[dict, dict]:
    """({qkv key: fp32 tensor}, {linear path: (blocks (out, row bytes), kind, rope heads)}):
    the file's tensors under qkv's names, each checked against the (meta) model's shape, q/k
    rows in qkv's RoPE layout (blocks: in the file's, with the heads that reorder them). A
    linear weight of one of KINDS stays blocks; the rest is dequantized."""
    config = model.config
    names = gguf_tensor_names(config.num_layers)
    expected = model.state_dict()
    linears = {f"{n}.weight" for n, m in model.named_modules() if type(m) is nn.Linear}
    dense, quantized = {}, {}
    for name, tensor in file.tensors.items():
        keys = _keys(name, names, file)
        if any(key not in expected for key in keys):
            raise GGUFError(f"path: {file.path} has a tensor qkv does not read: {name}")
        shape = (tensor.shape[0] // len(keys), *tensor.shape[1:])  # of each part
        if any(tuple(expected[key].shape) != shape for key in keys):
            wanted = tuple(expected[keys[0]].shape)
            raise GGUFError(
                f"path: {file.path}: {name} has shape {tensor.shape}, the model {wanted} "
                f"per part of {len(keys)}"
            )
        blocks = tensor.kind in KINDS and (keys[0] in linears or keys[0] == EMBEDDING)
        if not blocks and tensor.kind not in BLOCK_FORMATS:
            raise GGUFError(f"path: {file.path}: qkv has no dequantizer for {name} "
                            f"({tensor.kind})")  # fmt: skip
        values = (
            _block_rows(tensor) if blocks else dequantize(tensor.raw, tensor.kind, tensor.shape)
        )
        for key, part in zip(keys, values.chunk(len(keys), dim=0), strict=True):
            if blocks:  # an embedding's rows are blocks as a linear's are: the file's bytes
                heads = rope_heads(key, config)
                quantized[key.removesuffix(".weight")] = (part, tensor.kind, heads)
            else:
                dense[key] = rope_rows_to_qkv(key, part, config)
        if not blocks:  # decoded: the file's pages are not needed again
            file.release(tensor.raw)
    return dense, quantized


def _keys(name: str, names: dict[str, str], file: GGUFFile) -> list[str]:
    keys = gguf_keys(name, names)
    if not keys:
        raise GGUFError(f"path: {file.path} has a tensor qkv does not read: {name}")
    return keys


def _block_rows(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF matrix's blocks, (out, row bytes) uint8: a view of the file's (private) mapping,
    a copy for a file small enough to have been read whole."""
    rows = tensor.raw.reshape(tensor.shape[0], -1)
    return torch.from_numpy(rows if rows.flags.writeable else rows.copy())


def explain_quantized(model: nn.Module) -> str:
    """Which kernel computes each kind of QuantizedLinear in `model`, and why; the linears left
    as nn.Linear; the facts the choice rests on (the int4pack ops, the CPU's ISA)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules(remove_duplicate=True))
    quantized = {n: m for n, m in modules.items() if isinstance(m, QuantizedLinear)}
    counts = Counter((m.kind, m.kernel, m.kernel_reason.reason) for m in quantized.values())
    lines = [f"{len(quantized)} quantized linears"]
    for (kind, kernel, reason), count in sorted(counts.items()):
        dtype = "bf16" if kernel.startswith("int4pack") else "fp32"
        lines.append(f"  {count} {kind} by {kernel} ({dtype} compute): {reason}")
    joined = sum(m._sharing is not None for m in quantized.values())
    if joined:
        lines.append(f"  {joined} of them laid out with the others of their module and input "
                     "width: those that read one tensor are one product "
                     "(share_quantized_inputs)")  # fmt: skip
    tables = [f"{n} ({m.kind})" for n, m in modules.items() if isinstance(m, QuantizedEmbedding)]
    if tables:
        tables_text = ", ".join(tables)
        lines.append(f"  embeddings kept as blocks, rows dequantized at lookup: {tables_text}")
    plain = [n for n, m in modules.items() if type(m) is nn.Linear]
    lines.append(f"left as nn.Linear: {', '.join(plain) if plain else 'none'}")
    for kind in KINDS:
        kernel, why = quantized_kernel(kind)
        lines.append(f"a new {kind} layer here: {kernel} ({why.reason})")
    ops = ", ".join(f"{op}: {'yes' if hasattr(torch.ops.aten, op) else 'no'}"
                    for op in INT4PACK_OPS)  # fmt: skip
    isa = capabilities.cpu_isa()
    cpu = ", ".join(f"{name}={value}" for name, value in isa.items() if value is not None)
    lines.append(f"ops: {ops}; CPU: {cpu}")
    return "\n".join(lines)
