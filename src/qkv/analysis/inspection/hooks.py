"""Named activation points of a qkv `GPT`: read them (`run_with_cache`) or edit them (`hooks`).

The residual stream view of Elhage et al. 2021 ("A Mathematical Framework for Transformer
Circuits", s2): each block reads the stream and adds its attention and MLP outputs back into
it, and each attention layer's output is a sum of independent per-head terms. The points, per
layer i of a model with N blocks (names as TransformerLens spells them):

    blocks.{i}.resid_pre       (B, L, E)      the input of block i (the embeddings for i = 0)
    blocks.{i}.attn.q          (B, H, L, D)   queries, after RoPE where the model has RoPE
    blocks.{i}.attn.k          (B, H_kv, L, D)  keys, after RoPE; H_kv key/value heads (GQA)
    blocks.{i}.attn.v          (B, H_kv, L, D)  values (no rotation); H_kv heads too
    blocks.{i}.attn.pattern    (B, H, L, L)   softmax weights, exact from any backend
    blocks.{i}.attn.head_out   (B, L, H, D)   each head's output, before out_proj
    blocks.{i}.attn.out        (B, L, E)      out_proj's output: the sum of the heads' terms
    blocks.{i}.resid_mid       (B, L, E)      resid_pre + attn.out, the input of the MLP's norm
    blocks.{i}.mlp.hidden      (B, L, F)      what enters down_proj: silu(gate) * up (SwiGLU)
                                              or gelu(up) (GPT-2); F the FFN width
    blocks.{i}.mlp.out         (B, L, E)      down_proj's output
    blocks.{i}.resid_post      (B, L, E)      the output of block i
    final_norm                 (B, L, E)      the final norm's output, what lm_head reads

Positions are RoPE's (Su et al. 2021) for Llama, SmolLM and Mistral: q and k are seen after the
rotation, as attention receives them; GPT-2's learned positions are already in resid_pre. When
decoding with a KV cache, q and v cover the tokens of the call, k and pattern every cached key.

Every hook is a PyTorch module hook (or `MultiHeadAttention.register_attention_hook` for q, k
and pattern) that exists only inside the call and is removed in a `finally`: a model used
without inspection carries none. q, k and pattern are read-only; every other point may be
replaced, which is activation patching (Vig et al. 2020, "Causal Mediation Analysis"; Meng et
al. 2022, "Locating and Editing Factual Associations in GPT", s2.1).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from qkv.analysis.inspection.attention_maps import attention_map
from qkv.models.gpt import GPT, GPTBlock

__all__ = ["ActivationCache", "activation_names", "hooks", "logit_lens", "run_with_cache"]

HookFn = Callable[[torch.Tensor, str], torch.Tensor | None]

# per block, in the order a forward pass reaches them (hooks on one module chain in this order)
LAYER_POINTS = (
    "resid_pre", "attn.q", "attn.k", "attn.pattern", "attn.v", "attn.head_out", "attn.out",
    "resid_mid", "mlp.hidden", "mlp.out", "resid_post",
)  # fmt: skip
READ_ONLY = ("attn.q", "attn.k", "attn.pattern")  # seen inside one forward, never returned
PATTERNS = tuple(f"blocks.{{i}}.{point}" for point in LAYER_POINTS) + ("final_norm",)


class ActivationCache(Mapping[str, torch.Tensor]):
    """The activations `run_with_cache` kept, by name (see the module docstring for shapes)."""

    def __init__(self, activations: dict[str, torch.Tensor] | None = None) -> None:
        self._activations: dict[str, torch.Tensor] = dict(activations or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._activations:
            raise KeyError(f"name: {name!r} was not cached; cached {list(self._activations)}")
        return self._activations[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._activations)

    def __len__(self) -> int:
        return len(self._activations)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {list(self._activations)})"

    def stack(self, point: str) -> torch.Tensor:
        """One point of every cached layer, in layer order: stack("resid_post") is (N, B, L, E)."""
        layers = [n for n in self._activations if n.startswith("blocks.") and _point(n) == point]
        if not layers:
            raise KeyError(f"point: no cached blocks.{{i}}.{point!r}; cached {list(self)}")
        layers.sort(key=lambda name: int(name.split(".")[1]))
        return torch.stack([self._activations[name] for name in layers])  # (N, ...)


def activation_names(model: GPT) -> list[str]:
    """Every activation point of `model`, in the order a forward pass reaches them."""
    _check_model(model)
    names = [f"blocks.{i}.{point}" for i in range(len(model.blocks)) for point in LAYER_POINTS]
    return names + ["final_norm"]


def run_with_cache(
    model: GPT, input_ids: torch.Tensor, names: str | Iterable[str] | None = None, **forward_kwargs
) -> tuple[object, ActivationCache]:
    """Run `model(input_ids, **forward_kwargs)` once under torch.no_grad, keeping activations.

    names: None (every point but attn.pattern), or names and globs ("blocks.*.resid_post")
    of `activation_names(model)`; attn.pattern, B x H x L x L weights per layer, is computed
    only when named (`record_attention` chooses rows and heads). Returns (the model's output, an
    `ActivationCache`); the model carries no hook afterwards, whether it returned or raised.
    """
    if names is None:  # a dense (L, L) map per head only when asked for
        chosen = [n for n in activation_names(model) if not n.endswith(".attn.pattern")]
    else:
        chosen = resolve_names(model, names, "names")
    kept: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, name: str) -> None:
        kept[name] = tensor.detach()

    with hooks(model, dict.fromkeys(chosen, keep)), torch.no_grad():
        output = model(input_ids, **forward_kwargs)
    return output, ActivationCache({name: kept[name] for name in chosen if name in kept})


def logit_lens(
    model: GPT, input_ids: torch.Tensor, *, top_k: int | None = None, **forward_kwargs
) -> torch.Tensor:
    """Each layer's resid_post read out by the final norm and lm_head: the logit lens
    (nostalgebraist 2020, "interpreting GPT: the logit lens").

    Returns logits (N, B, L, V), one entry per block (the last is the model's own logits), or
    with top_k the k most likely token ids (N, B, L, k), best first.
    """
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
    _, cache = run_with_cache(model, input_ids, "blocks.*.resid_post", **forward_kwargs)
    with torch.no_grad():
        logits = model.lm_head(model.final_norm(cache.stack("resid_post")))  # (N, B, L, V)
    return logits if top_k is None else logits.topk(top_k, dim=-1).indices  # (N, B, L, k)


@contextmanager
def hooks(model: GPT, hook_fns: Mapping[str, HookFn]) -> Iterator[None]:
    """Inside, every forward of `model` calls `fn(tensor, name)` at each named point.

    hook_fns: {name or glob: fn}. fn returns None to only read, or a tensor of the same shape
    to replace the activation (activation patching; Vig et al. 2020, Meng et al. 2022): e.g.
    zero `head_out[:, :, h]` to ablate head h. q, k and pattern are read-only. Replacing
    resid_mid sets the attention output to (replacement - resid_pre), exact to one rounding,
    and needs the residual dropout inactive (eval mode). The hooks are removed on leaving.
    """
    if not isinstance(hook_fns, Mapping):
        raise TypeError(f"hook_fns: expected a dict {{name: fn}}, got {type(hook_fns).__name__}")
    pairs = [(name, fn) for key, fn in hook_fns.items() for name in _expand(model, key, fn)]
    order = {name: index for index, name in enumerate(activation_names(model))}
    pairs.sort(key=lambda pair: order[pair[0]])  # hooks on one module chain in forward order
    handles: list[RemovableHandle] = []
    try:
        for name, fn in pairs:
            handles.extend(_install(model, name, fn))
        yield
    finally:
        for handle in handles:
            handle.remove()


def resolve_names(model: GPT, names: str | Iterable[str], argument: str) -> list[str]:
    """Names and globs -> the matching activation names, in forward order; a name or glob
    matching none is refused, naming it and listing the valid patterns."""
    wanted = [names] if isinstance(names, str) else list(names)
    valid = activation_names(model)
    for name in wanted:
        if not isinstance(name, str):
            raise TypeError(f"{argument}: expected activation names (str), got {name!r}")
        if not fnmatch.filter(valid, name):
            raise ValueError(
                f"{argument}: {name!r} is not an activation point of this model; expected a "
                f"name or glob of {list(PATTERNS)}, i in [0, {len(model.blocks)})"
            )
    return [name for name in valid if any(fnmatch.fnmatchcase(name, w) for w in wanted)]


def _expand(model: GPT, key: str, fn: HookFn) -> list[str]:
    if not callable(fn):
        raise TypeError(f"hook_fns: the value for {key!r} must be callable, got {fn!r}")
    return resolve_names(model, key, "hook_fns")


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected a qkv.models.GPT, got {type(model).__name__}")


def _point(name: str) -> str:
    """ "blocks.3.attn.q" -> "attn.q"."""
    return name.split(".", 2)[2]


def _install(model: GPT, name: str, fn: HookFn) -> list[RemovableHandle]:
    """Register the hooks of one point; returns their handles."""
    if name == "final_norm":
        return [model.final_norm.register_forward_hook(_output_hook(name, fn))]
    block = model.blocks[int(name.split(".")[1])]
    return _LAYER_INSTALLERS[_point(name)](block, name, fn)


def _call(fn: HookFn, tensor: torch.Tensor, name: str) -> torch.Tensor | None:
    """fn's replacement for `tensor` (checked), or None when it only read."""
    new = fn(tensor, name)
    if new is None or new is tensor:
        return None
    if name.startswith("blocks.") and _point(name) in READ_ONLY:
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
        new = _call(fn, split(args[0]), name)
        return None if new is None else (merge(new), *args[1:])

    return hook


def _output_hook(name: str, fn: HookFn, split=_same, merge=_same):
    """A forward hook on a module's output, seen as split(output)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        new = _call(fn, split(output), name)
        return None if new is None else merge(new)

    return hook


def _attention_hook(name: str, fn: HookFn, part: str):
    """A `register_attention_hook` hook: q or k as attention receives them, or the weights."""

    def hook(module, q, k, *, mask, causal, window, bias, cross, pattern) -> None:
        if part == "pattern":
            seen = attention_map(
                q, k, mask=mask, causal=causal, window=window, bias=bias, pattern=pattern
            )  # (B, H, L_q, L_k), float32
        else:
            seen = q if part == "q" else k  # (B, H, L, D) or (B, H_kv, L_k, D)
        _call(fn, seen, name)

    return hook


def _heads(count: int, heads_first: bool):
    """split/merge between (B, L, count * D) and (B, L, count, D), or (B, count, L, D)."""

    def split(x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (count, -1))  # (B, L, count, D)
        return x.transpose(1, 2) if heads_first else x  # (B, count, L, D) or as is

    def merge(x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(1, 2) if heads_first else x).flatten(-2)  # (B, L, count * D)

    return split, merge


def _resid_mid(block: GPTBlock, name: str, fn: HookFn) -> list[RemovableHandle]:
    """resid_pre + attention output, seen when the attention returns; a replacement r makes
    the attention output r - resid_pre, so the block's own addition gives r back."""
    if block.training and not isinstance(block.dropout, nn.Identity):
        raise ValueError(
            f"model: {name} is resid_pre + dropout(attention), which differs from what the "
            "hook sees while the residual dropout is active; expected model.eval()"
        )
    stream: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple) -> None:
        stream.append(args[0])  # (B, L, E): resid_pre, as the block receives it

    def edit(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        resid_pre = stream.pop()
        new = _call(fn, resid_pre + output, name)  # the block's own sum, bit for bit
        return None if new is None else new - resid_pre

    return [
        block.register_forward_pre_hook(keep),
        block.self_attn.register_forward_hook(edit),
    ]


def _on_heads(module: nn.Module, count: int, name: str, fn: HookFn, *, pre: bool, first: bool):
    split, merge = _heads(count, heads_first=first)
    if pre:
        return [module.register_forward_pre_hook(_input_hook(name, fn, split, merge))]
    return [module.register_forward_hook(_output_hook(name, fn, split, merge))]


_LAYER_INSTALLERS: dict[str, Callable[[GPTBlock, str, HookFn], list[RemovableHandle]]] = {
    "resid_pre": lambda b, n, f: [b.register_forward_pre_hook(_input_hook(n, f))],
    "attn.q": lambda b, n, f: [b.self_attn.register_attention_hook(_attention_hook(n, f, "q"))],
    "attn.k": lambda b, n, f: [b.self_attn.register_attention_hook(_attention_hook(n, f, "k"))],
    "attn.pattern": lambda b, n, f: [
        b.self_attn.register_attention_hook(_attention_hook(n, f, "pattern"))
    ],
    "attn.v": lambda b, n, f: _on_heads(
        b.self_attn.v_proj, b.self_attn.num_kv_heads, n, f, pre=False, first=True
    ),
    "attn.head_out": lambda b, n, f: _on_heads(
        b.self_attn.out_proj, b.self_attn.num_heads, n, f, pre=True, first=False
    ),
    "attn.out": lambda b, n, f: [b.self_attn.register_forward_hook(_output_hook(n, f))],
    "resid_mid": _resid_mid,
    "mlp.hidden": lambda b, n, f: [b.ffn.down_proj.register_forward_pre_hook(_input_hook(n, f))],
    "mlp.out": lambda b, n, f: [b.ffn.register_forward_hook(_output_hook(n, f))],
    "resid_post": lambda b, n, f: [b.register_forward_hook(_output_hook(n, f))],
}
