"""Exact attention maps of any qkv model, from whatever backend ran, for chosen layers/heads/rows.

Fused and tiled kernels never form the L_q x L_k weights, so looking at one head usually means
switching the whole model to slow eager attention (transformers refuses `output_attentions` with
SDPA; bertviz needs eager matrices). Here each `MultiHeadAttention` keeps its backend; a hook
(`MultiHeadAttention.register_attention_hook`) sees what the layer attends with (the post-RoPE q and
k, the mask, causal, window, ALiBi bias) and recomputes only the selected heads and query rows
against all keys:

    p_ij = exp(s_ij - lse_i),  s_ij = q_i . k_j * scale + bias_ij,  lse_i = log sum_j exp(s_ij)

with the masking of `qkv.attention_weights` (the tiled kernel's), so memory is linear in what is
selected: B x heads x rows x L_k weights, never L_q x L_k unless every row is asked for. These
are the pre-dropout weights: softmax(QK^T / sqrt(d_k)) (Vaswani et al. 2017, s3.2.1), before
any attention dropout.

    with record_attention(model, layers=[0, 5], heads=[3], rows=[-1]) as recording:
        model(input_ids)
    recording["layers.5.self"].weights  # (B, 1, 1, L_k)
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from qkv.attention import attention_weights
from qkv.attention.request import make_request
from qkv.attention.sparse import SparsePattern
from qkv.layers.attention import MultiHeadAttention

__all__ = [
    "AttentionMap",
    "AttentionRecording",
    "attention_map",
    "chosen_attention_modules",
    "display_name",
    "record_attention",
]

Selection = int | str | Iterable[int | str] | None
CHUNK_SCORES = 2**20  # float64 scores per chunk of rows (8 MiB): all rows need not fit at once


@dataclass(frozen=True)
class AttentionMap:
    """The weights of one attention call, for the selected heads and query rows.

    name: "encoder.3.self", "decoder.1.cross", "layers.0.self" (BERT), "blocks.2.self" (GPT):
    the module's path with the block container dropped. module: the full path
    ("decoder.blocks.1.cross_attn"). kind: "self", or "cross" when the keys came from a context
    (the encoder's memory). call: how many calls of that module came before (a shared layer or
    a decoding step runs one module several times). heads, rows: the query heads and query
    positions kept. weights: (B, len(heads), len(rows), L_k) float32; each row sums to 1 (0 on
    a row with no visible key).
    """

    name: str
    module: str
    kind: str
    call: int
    heads: tuple[int, ...]
    rows: tuple[int, ...]
    weights: torch.Tensor

    @property
    def layer(self) -> int | None:
        """The layer index in the name ("decoder.1.cross" -> 1), or None."""
        return next((int(part) for part in self.name.split(".") if part.isdigit()), None)

    @property
    def stack(self) -> str:
        """The name without its layer index ("encoder.self", "decoder.cross", "layers.self")."""
        return ".".join(part for part in self.name.split(".") if not part.isdigit())


@dataclass
class AttentionRecording:
    """The maps recorded inside `record_attention`, in call order."""

    maps: list[AttentionMap] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.maps)

    def __iter__(self) -> Iterator[AttentionMap]:
        return iter(self.maps)

    def __getitem__(self, name: str) -> AttentionMap:
        """The first recorded map of that name (the first call of the module)."""
        for recorded in self.maps:
            if recorded.name == name:
                return recorded
        raise KeyError(f"name: {name!r} was not recorded; recorded {self.names()}")

    def names(self) -> list[str]:
        return list(dict.fromkeys(recorded.name for recorded in self.maps))


@contextmanager
def record_attention(
    model: nn.Module,
    *,
    layers: Selection = None,
    heads: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
) -> Iterator[AttentionRecording]:
    """Record exact attention maps of `model`'s `MultiHeadAttention` modules while inside.

    layers: None (all), or layer indices and/or name patterns ("decoder.*.cross", see
    `AttentionMap.name`). heads: query heads to keep (default all). rows: query positions to
    keep, negative ones counting from the end (default all). The model runs exactly as without
    recording, with its own backend; nothing is kept but the selected weights.
    """
    chosen = chosen_attention_modules(model, layers)
    for path, module in chosen:
        if module in _RECORDED:
            raise ValueError(
                f"model: {path or 'the model'} is already being recorded; expected one "
                "record_attention at a time"
            )
        if heads is not None:
            _indices("heads", heads, module.num_heads)  # fail before the model runs
    recording = AttentionRecording()
    handles = []
    try:
        for path, module in chosen:
            hook = _Observer(recording, path, heads, rows)
            handles.append(module.register_attention_hook(hook))
            _RECORDED.add(module)
        yield recording
    finally:
        for handle in handles:
            handle.remove()
        for _, module in chosen:
            _RECORDED.discard(module)


# The modules a record_attention block is recording now: one block at a time per module.
_RECORDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def attention_map(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    heads: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    pattern: SparsePattern | None = None,
) -> torch.Tensor:
    """Exact weights (B, len(heads), len(rows), L_k), float32, of `qkv.attention(q, k, v, ...)`.

    q: (B, H, L_q, D), k: (B, H_kv, L_k, D) (GQA: each query head reads its group's K head);
    mask, causal, window, bias, scale, pattern as in `qkv.attention`. No log-sum-exp is needed:
    each row is shifted by an upper bound of its scores (max_j q_i . k_j * scale plus the
    largest additive term), exponentiated in float64 by `qkv.attention_weights` (which applies
    the masking) and normalised, so nothing overflows and the result is softmax(s_i) to float64
    rounding. (A row whose visible scores all lie over 700 below that bound, which only finite
    -1e9-style masks on every visible key produce, would read as empty and get 0.)
    """
    request = make_request(
        q, k, k, mask=mask, causal=causal, scale=scale, bias=bias, window=window, dropout_p=0.0,
        return_weights=True, pattern=pattern,
    )  # fmt: skip
    B, H, L_q, _ = q.shape
    L_k = k.shape[2]
    head_index = _indices("heads", heads, H).to(q.device)
    row_index = _indices("rows", rows, L_q).to(q.device)
    with torch.no_grad():
        q_sel = q[:, head_index].double()  # (B, h, L_q, D): rows are picked later, by index
        k_sel = k[:, head_index // request.group_size].double()  # (B, h, L_k, D): GQA's K head
        masking = {
            "mask": _select_heads(mask, head_index),
            "bias": _select_heads(bias, head_index),
            "causal": causal,
            "window": window,
            "scale": request.scale,
            "pattern": pattern,
        }
        headroom = _largest_additive(masking["mask"], masking["bias"])
        weights = q.new_empty(B, len(head_index), len(row_index), L_k, dtype=torch.float32)
        chunk = max(1, CHUNK_SCORES // max(1, B * len(head_index) * L_k))  # rows at a time
        for start in range(0, len(row_index), chunk):
            chosen = row_index[start : start + chunk]
            weights[:, :, start : start + chunk] = _softmax_rows(
                q_sel, k_sel, chosen, masking, headroom
            )
    return weights


def _softmax_rows(
    q: torch.Tensor, k: torch.Tensor, row_index: torch.Tensor, masking: dict, headroom: float
) -> torch.Tensor:
    """Weights (B, h, r, L_k) of the rows `row_index` of q (B, h, L_q, D) against k (B, h, L_k,
    D), both float64: exp(s - bound) by `qkv.attention_weights`, then normalised. headroom:
    the most that masks and biases add to a score."""
    raw = (q[:, :, row_index] * masking["scale"]) @ k.transpose(-1, -2)  # (B, h, r, L_k)
    bound = q.new_zeros(q.shape[:3])  # (B, h, L_q); only the chosen rows are read
    bound[:, :, row_index] = raw.amax(dim=-1) + headroom
    unnormalised = attention_weights(q, k, bound, rows=row_index, **masking)  # each <= 1
    total = unnormalised.sum(dim=-1, keepdim=True)  # 0 only on a row with no visible key
    return (unnormalised / total.clamp_min(torch.finfo(total.dtype).tiny)).float()


class _Observer:
    """An attention hook of one `MultiHeadAttention`: turns each call into an `AttentionMap`."""

    def __init__(self, recording, path: str, heads, rows) -> None:
        self.recording, self.path, self.name = recording, path, display_name(path)
        self.heads, self.rows, self.calls = heads, rows, 0

    def __call__(self, module, q, k, *, mask, causal, window, bias, cross, pattern) -> None:
        head_index = _indices("heads", self.heads, q.shape[1])
        row_index = _indices("rows", self.rows, q.shape[2])
        weights = attention_map(
            q, k, heads=head_index, rows=row_index, mask=mask, causal=causal, window=window,
            bias=bias, pattern=pattern,
        )  # fmt: skip
        self.recording.maps.append(
            AttentionMap(
                name=self.name,
                module=self.path,
                kind="cross" if cross else "self",
                call=self.calls,
                heads=tuple(head_index.tolist()),
                rows=tuple(row_index.tolist()),
                weights=weights,
            )
        )
        self.calls += 1


def chosen_attention_modules(
    model: nn.Module, layers: Selection
) -> list[tuple[str, MultiHeadAttention]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(f"model: {type(model).__name__} has no qkv MultiHeadAttention module")
    if layers is None:
        return found
    wanted = [layers] if isinstance(layers, (int, str)) else list(layers)
    for item in wanted:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise TypeError(f"layers: expected ints and name patterns, got {item!r}")
    chosen = [(p, m) for p, m in found if _matches(display_name(p), wanted)]
    if not chosen:
        names = [display_name(p) for p, _ in found]
        raise ValueError(f"layers: {layers!r} matches none of the attention modules {names}")
    return chosen


def _matches(name: str, wanted: list[int | str]) -> bool:
    layer = next((int(part) for part in name.split(".") if part.isdigit()), None)
    return any(
        item == layer if isinstance(item, int) else fnmatch.fnmatchcase(name, item)
        for item in wanted
    )


def display_name(path: str) -> str:
    """A module path as a map name: "encoder.blocks.3.self_attn" -> "encoder.3.self"."""
    parts = path.split(".") if path else ["attention"]
    parts = [parts[0]] + [p for p in parts[1:] if p not in ("blocks", "layers")]
    parts[-1] = parts[-1].removesuffix("_attn")
    return ".".join(parts)


def _indices(name: str, selection, size: int) -> torch.Tensor:
    """Indices in [0, size) as a long tensor; negative ones count from the end."""
    if selection is None:
        return torch.arange(size)
    index = torch.as_tensor(selection).reshape(-1)
    if index.is_floating_point() or index.dtype == torch.bool or index.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty list of int indices, got {selection!r}")
    if index.min() < -size or index.max() >= size:
        raise ValueError(f"{name}: expected indices in [-{size}, {size}), got {selection!r}")
    return index.long() % size


def _select_heads(tensor: torch.Tensor | None, head_index: torch.Tensor) -> torch.Tensor | None:
    """A (B|1, H, L_q|1, L_k) mask or bias restricted to the selected heads (others unchanged)."""
    if tensor is None or tensor.dim() != 4 or tensor.shape[1] == 1:
        return tensor
    return tensor[:, head_index.to(tensor.device)]


def _largest_additive(*terms: torch.Tensor | None) -> float:
    """An upper bound (>= 0) of what float masks and biases add to any score."""
    bound = 0.0
    for term in terms:
        if term is not None and term.is_floating_point() and term.numel():
            bound += max(0.0, float(term.max()))
    return bound
