"""Where `qkv.inspect`'s activation points sit in each supported model, and their module hooks.

A model is read as one or two stacks of blocks (`layout`): GPT, BERT and ViT have one, named
"blocks.{i}.…"; the encoder-decoders (`Transformer`, `T5Transformer`) have "encoder." and
"decoder." ones. A block is a sequence of sub-layers, each with its norm: "attn" (self-
attention), "cross_attn" (decoder blocks), then "mlp", in a pre-norm (x + f(norm(x))) or a
post-norm (norm(x + f(x))) arrangement. The names and where each point is taken are listed in
`qkv.analysis.inspection.hooks`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from qkv.analysis.inspection.attention_maps import attention_map
from qkv.layers.attention import MultiHeadAttention
from qkv.layers.blocks import DecoderBlock, EncoderBlock
from qkv.layers.kv_cache import LayerCache
from qkv.models.bert import BertModel
from qkv.models.encoder_decoder import Transformer
from qkv.models.gpt import GPT, GPTBlock
from qkv.models.t5 import T5Attention, T5Block, T5Transformer
from qkv.models.vit import ViT

HookFn = Callable[[torch.Tensor, str], torch.Tensor | None]

ATTENTION_POINTS = ("q", "k", "pattern", "v", "head_out", "out")
READ_ONLY = ("attn.q", "attn.k", "attn.pattern", "cross_attn.q", "cross_attn.k",
             "cross_attn.pattern")  # fmt: skip
STREAM_AFTER = {"attn": "resid_mid", "cross_attn": "resid_cross"}  # the last one: resid_post
SUPPORTED = (
    "qkv.models.GPT, BertModel (or a BERT head holding one as .bert, e.g. "
    "BertForSequenceClassification), ViT, Transformer or T5Transformer"
)
_NAME = re.compile(r"^((?:encoder|decoder)\.)?blocks\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Block:
    """One block: its module, its sub-layers (point prefix, module, norm) in forward order,
    whether each sub-layer is post-norm, and the dropout on the sub-layers' outputs."""

    module: nn.Module
    sublayers: tuple[tuple[str, nn.Module, nn.Module], ...]
    post_norm: bool
    dropout: nn.Module

    def points(self) -> list[str]:
        names = ["resid_pre"]
        for index, (prefix, _, _) in enumerate(self.sublayers):
            if prefix == "mlp":
                names += ["mlp.hidden", "mlp.out"]
            else:
                names += [f"{prefix}.{point}" for point in ATTENTION_POINTS]
            last = index == len(self.sublayers) - 1
            names.append("resid_post" if last else STREAM_AFTER[prefix])
        return names


@dataclass(frozen=True)
class Stack:
    """A stack of blocks: "" (decoder-only models, encoders) or "encoder." / "decoder."."""

    prefix: str
    blocks: tuple[Block, ...]
    final_norm: nn.Module | None

    def names(self) -> list[str]:
        names = [
            f"{self.prefix}blocks.{i}.{point}"
            for i, block in enumerate(self.blocks)
            for point in block.points()
        ]
        return names + ([] if self.final_norm is None else [f"{self.prefix}final_norm"])

    def patterns(self) -> list[str]:
        points = self.blocks[0].points() if self.blocks else []
        tail = [] if self.final_norm is None else [f"{self.prefix}final_norm"]
        return [f"{self.prefix}blocks.{{i}}.{point}" for point in points] + tail


def layout(model: nn.Module) -> tuple[Stack, ...]:
    """The stacks of a supported model; any other type is refused by name."""
    if isinstance(model, GPT):
        return (Stack("", _blocks(model.blocks), model.final_norm),)
    bert = model if isinstance(model, BertModel) else getattr(model, "bert", None)
    if isinstance(bert, BertModel):
        if bert.config.share_layers:
            raise ValueError(
                "model: its BertModel shares one block across every depth (share_layers=True), "
                "so a hook on it cannot tell the layers apart; expected share_layers=False"
            )
        return (Stack("", _blocks(bert.layers), None),)
    if isinstance(model, ViT):
        return (Stack("", _blocks(model.blocks), model.norm),)
    if isinstance(model, Transformer):
        return (
            Stack("encoder.", _blocks(model.encoder.blocks), model.encoder.norm),
            Stack("decoder.", _blocks(model.decoder.blocks), model.decoder.norm),
        )
    if isinstance(model, T5Transformer):
        return (
            Stack("encoder.", _blocks(model.encoder.blocks), model.encoder.final_norm),
            Stack("decoder.", _blocks(model.decoder.blocks), model.decoder.final_norm),
        )
    raise TypeError(f"model: expected a {SUPPORTED}; got {type(model).__name__}")


def _blocks(modules: nn.ModuleList) -> tuple[Block, ...]:
    return tuple(_block(module) for module in modules)


def _block(block: nn.Module) -> Block:
    if isinstance(block, (GPTBlock, T5Block)):
        parts = [("attn", block.self_attn, block.attn_norm)]
        if getattr(block, "cross_attn", None) is not None:
            parts.append(("cross_attn", block.cross_attn, block.cross_norm))
        parts.append(("mlp", block.ffn, block.ffn_norm))
        return Block(block, tuple(parts), False, block.dropout)
    if isinstance(block, EncoderBlock):
        parts = [("attn", block.self_attn, block.norm1), ("mlp", block.ffn, block.norm2)]
    elif isinstance(block, DecoderBlock):
        parts = [
            ("attn", block.self_attn, block.norm1),
            ("cross_attn", block.cross_attn, block.norm2),
            ("mlp", block.ffn, block.norm3),
        ]
    else:
        raise TypeError(f"model: a block of type {type(block).__name__} has no activation points")
    return Block(block, tuple(parts), not block.norm_first, block.dropout)


def split_name(name: str) -> tuple[str, int, str] | None:
    """ "decoder.blocks.3.cross_attn.q" -> ("decoder.", 3, "cross_attn.q"); None otherwise."""
    match = _NAME.match(name)
    return None if match is None else (match.group(1) or "", int(match.group(2)), match.group(3))


def install(stacks: tuple[Stack, ...], name: str, fn: HookFn) -> list[RemovableHandle]:
    """Register the hooks of one point; returns their handles."""
    parts = split_name(name)
    if parts is None:  # a final norm
        stack = next(s for s in stacks if name == f"{s.prefix}final_norm")
        return [stack.final_norm.register_forward_hook(_output_hook(name, fn))]
    prefix, index, point = parts
    block = next(s for s in stacks if s.prefix == prefix).blocks[index]
    if point == "resid_pre":
        return [block.module.register_forward_pre_hook(_input_hook(name, fn))]
    if point == "resid_post":
        return [block.module.register_forward_hook(_output_hook(name, fn))]
    for position, (sub, module, norm) in enumerate(block.sublayers):
        if point == STREAM_AFTER.get(sub):
            if block.post_norm:  # norm(x + f(x)): the stream is the norm's output
                return [norm.register_forward_hook(_output_hook(name, fn))]
            return _pre_norm_stream(block, position, name, fn)
        if point.startswith(f"{sub}."):
            part = point[len(sub) + 1 :]
            if sub == "mlp":
                if part == "hidden":
                    return [module.down_proj.register_forward_pre_hook(_input_hook(name, fn))]
                return [module.register_forward_hook(_output_hook(name, fn))]
            return _attention_point(module, part, name, fn)
    raise ValueError(f"name: {name!r} is not an activation point of this model")


def call(fn: HookFn, tensor: torch.Tensor, name: str) -> torch.Tensor | None:
    """fn's replacement for `tensor` (checked), or None when it only read."""
    new = fn(tensor, name)
    if new is None or new is tensor:
        return None
    parts = split_name(name)
    if parts is not None and parts[2] in READ_ONLY:
        raise ValueError(f"hook_fns: {name!r} is read-only; expected the hook to return None")
    if not isinstance(new, torch.Tensor) or new.shape != tensor.shape:
        seen = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
        raise ValueError(
            f"hook_fns: the hook of {name!r} returned {seen}; expected None or a tensor of "
            f"shape {tuple(tensor.shape)}"
        )
    return new.to(tensor)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _input_hook(name: str, fn: HookFn, split=_same, merge=_same):
    """A forward pre-hook on a module's first argument, seen as split(argument)."""

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        new = call(fn, split(args[0]), name)
        return None if new is None else (merge(new), *args[1:])

    return hook


def _output_hook(name: str, fn: HookFn, split=_same, merge=_same):
    """A forward hook on a module's output, seen as split(output)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        new = call(fn, split(output), name)
        return None if new is None else merge(new)

    return hook


def _heads(count: int, heads_first: bool):
    """split/merge between (B, L, count * D) and (B, L, count, D), or (B, count, L, D)."""

    def split(x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (count, -1))  # (B, L, count, D)
        return x.transpose(1, 2) if heads_first else x  # (B, count, L, D) or as is

    def merge(x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(1, 2) if heads_first else x).flatten(-2)  # (B, L, count * D)

    return split, merge


def _pre_norm_stream(block: Block, position: int, name: str, fn: HookFn):
    """x + f(norm(x)) after sub-layer `position`, seen when f returns; a replacement r makes
    f's output r - x, so the block's own addition gives r back."""
    sub, module, norm = block.sublayers[position]
    if block.module.training and not isinstance(block.dropout, nn.Identity):
        before = "resid_pre" if position == 0 else STREAM_AFTER[block.sublayers[position - 1][0]]
        what = "attention" if sub == "attn" else "cross-attention"
        raise ValueError(
            f"model: {name} is {before} + dropout({what}), which differs from what the hook "
            "sees while the residual dropout is active; expected model.eval()"
        )
    stream: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple) -> None:
        stream.append(args[0])  # (B, L, E): the stream as the sub-layer's residual adds it

    def edit(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        before = stream.pop()
        new = call(fn, before + output, name)  # the block's own sum, bit for bit
        return None if new is None else new - before

    source = block.module if position == 0 else norm  # the block's input, or the norm's
    return [source.register_forward_pre_hook(keep), module.register_forward_hook(edit)]


def _attention_point(module: nn.Module, part: str, name: str, fn: HookFn):
    """q, k, pattern, v, head_out or out of a `MultiHeadAttention` or a `T5Attention`."""
    if part in ("q", "k", "pattern"):
        if isinstance(module, MultiHeadAttention):
            return [module.register_attention_hook(_attention_hook(name, fn, part))]
        return [module.register_forward_pre_hook(_t5_hook(name, fn, part), with_kwargs=True)]
    if part == "v":
        split, merge = _heads(module.num_kv_heads, heads_first=True)
        return [module.v_proj.register_forward_hook(_output_hook(name, fn, split, merge))]
    if part == "head_out":
        split, merge = _heads(module.num_heads, heads_first=False)
        return [module.out_proj.register_forward_pre_hook(_input_hook(name, fn, split, merge))]
    return [module.register_forward_hook(_output_hook(name, fn))]


def _attention_hook(name: str, fn: HookFn, part: str):
    """A `register_attention_hook` hook: q or k as attention receives them, or the weights."""

    def hook(module, q, k, *, mask, causal, window, bias, cross, pattern) -> None:
        if part == "pattern":
            seen = attention_map(
                q, k, mask=mask, causal=causal, window=window, bias=bias, pattern=pattern
            )  # (B, H, L_q, L_k), float32
        else:
            seen = q if part == "q" else k  # (B, H, L, D) or (B, H_kv, L_k, D)
        call(fn, seen, name)

    return hook


def _t5_hook(name: str, fn: HookFn, part: str):
    """A forward pre-hook on a `T5Attention`: q = q_proj(x), k = k_proj(context or x), split
    into heads, and the weights softmax(q k^T + bias) of its unscaled scores (Raffel et al.
    2020), from the call's own arguments."""

    def hook(module: T5Attention, args: tuple, kwargs: dict) -> None:
        x = args[0]
        context = args[1] if len(args) > 1 else kwargs.get("context")
        if part != "q" and isinstance(kwargs.get("cache"), LayerCache):
            raise ValueError(
                f"hook_fns: {name!r} is not available while decoding with a cache (the keys "
                "include cached tokens); expected a call without a cache"
            )
        with torch.no_grad():
            split = _heads(module.num_heads, heads_first=True)[0]
            q = split(F.linear(x, module.q_proj.weight, module.q_proj.bias))  # (B, H, L_q, D)
            if part == "q":
                return call(fn, q, name)
            source = x if context is None else context
            k = split(F.linear(source, module.k_proj.weight, module.k_proj.bias))  # (B, H, L_k, D)
            if part == "k":
                return call(fn, k, name)
            weights = attention_map(
                q, k, mask=kwargs.get("mask"), causal=kwargs.get("causal", False),
                bias=kwargs.get("bias"), scale=1.0,
            )  # fmt: skip
        return call(fn, weights, name)  # (B, H, L_q, L_k), float32

    return hook
