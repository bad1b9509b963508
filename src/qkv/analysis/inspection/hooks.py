"""Named activation points of qkv's Transformers: read them (`run_with_cache`) or edit them
(`hooks`).

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

Models: `GPT` has these names. `BertModel` (and a head holding one as `.bert`, e.g.
`BertForSequenceClassification`) and `ViT` have the same per-block names; ViT's final_norm is
the LayerNorm before pooling, and BERT has none (its last resid_post is last_hidden_state).
The encoder-decoders `Transformer` and `T5Transformer` prefix them: encoder.blocks.{i}.…,
encoder.final_norm, decoder.blocks.{i}.…, decoder.final_norm. A decoder block has, after its
self-attention (attn.…, resid_mid = resid_pre + attn.out), a cross-attention to the encoder's
output: cross_attn.q (B, H, L, D), cross_attn.k and cross_attn.v (B, H_kv, L_src, D),
cross_attn.pattern (B, H, L, L_src), cross_attn.head_out, cross_attn.out, and
resid_cross = resid_mid + cross_attn.out, the input of the MLP's sub-layer. T5's pattern is
softmax(q k^T + relative bias), its scores unscaled (Raffel et al. 2020).

Post-norm blocks (BERT; `Transformer` unless norm_first), x = norm(x + f(x)) per sub-layer
(Vaswani et al. 2017, s3.1), normalise the stream after each sub-layer, so there resid_mid is
norm1(resid_pre + attn.out), resid_cross is norm2(resid_mid + cross_attn.out) and resid_post
is the last norm's output, norm(resid_mid + mlp.out) (= transformers' hidden_states[i + 1]);
each is the output of that norm, and the sums before the norms are not points. Pre-norm
blocks (GPT, ViT, T5, `Transformer(norm_first=True)`) add without normalising, as listed.

Positions are RoPE's (Su et al. 2021) for Llama, SmolLM and Mistral: q and k are seen after the
rotation, as attention receives them; GPT-2's learned positions are already in resid_pre. When
decoding with a KV cache, q and v cover the tokens of the call, k and pattern every cached key
(T5's k and pattern are refused then); a cross-attention cache projects cross_attn.v once.

Every hook is a PyTorch module hook (or `MultiHeadAttention.register_attention_hook` for q, k
and pattern) that exists only inside the call and is removed in a `finally`: a model used
without inspection carries none. q, k and pattern are read-only; every other point may be
replaced, which is activation patching (Vig et al. 2020, "Causal Mediation Analysis"; Meng et
al. 2022, "Locating and Editing Factual Associations in GPT", s2.1).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from qkv.analysis.inspection.points import HookFn, install, layout, split_name
from qkv.models.bert_heads import BertForPreTraining
from qkv.models.gpt import GPT

__all__ = ["ActivationCache", "activation_names", "hooks", "logit_lens", "run_with_cache"]


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
        """One point of every cached layer, in layer order: stack("resid_post") is (N, B, L, E);
        an encoder-decoder's stacks are named "encoder.resid_post", "decoder.resid_post"."""
        prefix = ""
        for stack in ("encoder.", "decoder."):
            if point.startswith(stack):
                prefix, point = stack, point[len(stack) :]
        layers = []
        for name in self._activations:
            parts = split_name(name)
            if parts is not None and parts[0] == prefix and parts[2] == point:
                layers.append((parts[1], name))
        if not layers:
            raise KeyError(f"point: no cached {prefix}blocks.{{i}}.{point!r}; cached {list(self)}")
        layers.sort()
        return torch.stack([self._activations[name] for _, name in layers])  # (N, ...)


def activation_names(model: nn.Module) -> list[str]:
    """Every activation point of `model`, in the order a forward pass reaches them."""
    return [name for stack in layout(model) for name in stack.names()]


def run_with_cache(
    model: nn.Module,
    input_ids: torch.Tensor,
    names: str | Iterable[str] | None = None,
    **forward_kwargs,
) -> tuple[object, ActivationCache]:
    """Run `model(input_ids, **forward_kwargs)` once under torch.no_grad, keeping activations.

    input_ids: what the model takes first (images for a ViT); forward_kwargs the rest (e.g.
    decoder_input_ids for an encoder-decoder). names: None (every point but the patterns), or
    names and globs ("blocks.*.resid_post") of `activation_names(model)`; attn.pattern (and
    cross_attn.pattern), B x H x L_q x L_k weights per layer, is computed only when named
    (`record_attention` chooses rows and heads). Returns (the model's output, an
    `ActivationCache`); the model carries no hook afterwards, whether it returned or raised.
    """
    if names is None:  # a dense (L, L) map per head only when asked for
        chosen = [n for n in activation_names(model) if not n.endswith("attn.pattern")]
    else:
        chosen = resolve_names(model, names, "names")
    kept: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, name: str) -> None:
        kept[name] = tensor.detach()

    with hooks(model, dict.fromkeys(chosen, keep)), torch.no_grad():
        output = model(input_ids, **forward_kwargs)
    return output, ActivationCache({name: kept[name] for name in chosen if name in kept})


def logit_lens(
    model: GPT | BertForPreTraining,
    input_ids: torch.Tensor,
    *,
    top_k: int | None = None,
    **forward_kwargs,
) -> torch.Tensor:
    """Each layer's resid_post read out by the model's own output head: the logit lens
    (nostalgebraist 2020, "interpreting GPT: the logit lens"). A `GPT` reads through its final
    norm and lm_head; a `BertForPreTraining` through its masked-LM head (dense, GELU, LayerNorm,
    the tied token embedding), the encoder's lens of Dar et al. 2023 ("Analyzing Transformers
    in Embedding Space"): BERT's blocks end in a norm, so each resid_post is what the head
    reads at the last layer.

    Returns logits (N, B, L, V), one entry per block (the last is the model's own logits), or
    with top_k the k most likely token ids (N, B, L, k), best first.
    """
    if isinstance(model, BertForPreTraining):
        table = model.bert.embeddings.token_embedding.weight  # (V, E), the tied decoder

        def read_out(resid):
            return model.mlm_head(resid, table)
    elif isinstance(model, GPT):

        def read_out(resid):
            return model.lm_head(model.final_norm(resid))
    else:
        raise TypeError(
            f"model: expected a qkv.models.GPT or BertForPreTraining, got {type(model).__name__}"
        )

    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
    _, cache = run_with_cache(model, input_ids, "blocks.*.resid_post", **forward_kwargs)
    with torch.no_grad():
        logits = read_out(cache.stack("resid_post"))  # (N, B, L, V)
    return logits if top_k is None else logits.topk(top_k, dim=-1).indices  # (N, B, L, k)


@contextmanager
def hooks(model: nn.Module, hook_fns: Mapping[str, HookFn]) -> Iterator[None]:
    """Inside, every forward of `model` calls `fn(tensor, name)` at each named point.

    hook_fns: {name or glob: fn}. fn returns None to only read, or a tensor of the same shape
    to replace the activation (activation patching; Vig et al. 2020, Meng et al. 2022): e.g.
    zero `head_out[:, :, h]` to ablate head h. q, k and pattern are read-only. Replacing
    resid_mid (or resid_cross) of a pre-norm block sets the sub-layer's output to
    (replacement - the stream before it), exact to one rounding, and needs the residual
    dropout inactive (eval mode); in a post-norm block it replaces the norm's output. The hooks
    are removed on leaving.
    """
    if not isinstance(hook_fns, Mapping):
        raise TypeError(f"hook_fns: expected a dict {{name: fn}}, got {type(hook_fns).__name__}")
    pairs = [(name, fn) for key, fn in hook_fns.items() for name in _expand(model, key, fn)]
    order = {name: index for index, name in enumerate(activation_names(model))}
    pairs.sort(key=lambda pair: order[pair[0]])  # hooks on one module chain in forward order
    stacks = layout(model)
    handles: list[RemovableHandle] = []
    try:
        for name, fn in pairs:
            handles.extend(install(stacks, name, fn))
        yield
    finally:
        for handle in handles:
            handle.remove()


def resolve_names(model: nn.Module, names: str | Iterable[str], argument: str) -> list[str]:
    """Names and globs -> the matching activation names, in forward order; a name or glob
    matching none is refused, naming it and listing the valid patterns."""
    wanted = [names] if isinstance(names, str) else list(names)
    stacks = layout(model)
    valid = [name for stack in stacks for name in stack.names()]
    for name in wanted:
        if not isinstance(name, str):
            raise TypeError(f"{argument}: expected activation names (str), got {name!r}")
        if not fnmatch.filter(valid, name):
            patterns = [pattern for stack in stacks for pattern in stack.patterns()]
            ranges = ", ".join(
                f"{stack.prefix[:-1] + ' ' if stack.prefix else ''}i in [0, {len(stack.blocks)})"
                for stack in stacks
            )
            raise ValueError(
                f"{argument}: {name!r} is not an activation point of this model; expected a "
                f"name or glob of {patterns}, {ranges}"
            )
    return [name for name in valid if any(fnmatch.fnmatchcase(name, w) for w in wanted)]


def _expand(model: nn.Module, key: str, fn: HookFn) -> list[str]:
    if not callable(fn):
        raise TypeError(f"hook_fns: the value for {key!r} must be callable, got {fn!r}")
    return resolve_names(model, key, "hook_fns")


def _check_model(model: nn.Module) -> None:
    """For what needs a GPT's lm_head (the logit lens, attribution, patch sweeps)."""
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected a qkv.models.GPT, got {type(model).__name__}")
