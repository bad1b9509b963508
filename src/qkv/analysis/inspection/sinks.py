"""Attention sinks: how much of each head's attention lands on the first tokens.

Xiao et al. 2024 ("Efficient Streaming Language Models with Attention Sinks") find that LLMs put
a large share of their attention on the first token, whatever it is; Gu et al. 2024 ("When
Attention Sink Emerges in Language Models: An Empirical View", s3) count a head as a sink where
its average attention on the first token exceeds a threshold, epsilon = 0.3. Here:

- `attention_masses(model, input_ids, keys)`: the share of attention on chosen key positions,
  per layer and head, from the exact maps of any backend (`record_attention`).
- `uniform_mass(k, L)`: the same share if every query spread its attention evenly over the keys
  it sees, the baseline a mass is compared with.
- `sink_heads(map)`: per head of one recorded `AttentionMap`, the mean mass on key 0 over its
  query rows (row 0 of a causal map, which sees key 0 alone, is left out), the uniform baseline
  of those rows, and whether the head is a sink: a mass above `SINK_THRESHOLD` and above twice
  the baseline (so that a short causal text, where even uniform attention puts much weight on
  key 0, marks nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qkv.analysis.inspection.attention_maps import AttentionMap, record_attention

__all__ = ["SINK_THRESHOLD", "HeadSink", "attention_masses", "sink_heads", "uniform_mass"]

SINK_THRESHOLD = 0.3  # Gu et al. 2024's epsilon: mean attention on the first token
BASELINE_FACTOR = 2.0  # and at least this many times what uniform attention would give


@dataclass(frozen=True)
class HeadSink:
    """One head of one map: `mass` (mean attention on key 0 over the rows measured), `uniform`
    (that mean for uniform attention over the visible keys), `is_sink`."""

    head: int
    mass: float
    uniform: float
    is_sink: bool


def attention_masses(
    model: nn.Module, input_ids: torch.Tensor, keys: dict[str, list[int]], *, first_query: int = 0
) -> dict[str, torch.Tensor]:
    """Share of attention on chosen keys, per layer and head, averaged over the batch and the
    queries at positions >= first_query: {name: (layers, heads)} for each `keys[name]`, a list
    of key positions (negative ones count from the end). input_ids (B, L), no padding."""
    L = input_ids.shape[1]
    if not 0 <= first_query < L:
        raise ValueError(f"first_query: expected 0..{L - 1} for {L} tokens, got {first_query}")
    rows = list(range(first_query, L))
    with record_attention(model, rows=rows) as recording, torch.no_grad():
        model(input_ids)
    maps = sorted(recording, key=lambda recorded: recorded.layer)
    weights = torch.stack([recorded.weights for recorded in maps])  # (layers, B, H, rows, L)
    return {
        name: weights[..., positions].sum(dim=-1).mean(dim=(1, 3))  # (layers, H)
        for name, positions in keys.items()
    }


def uniform_mass(k: int, length: int, *, first_query: int = 0, causal: bool) -> float:
    """The mass on the first k keys if every query spread its attention evenly over the keys
    it sees: k / L (bidirectional), or the mean over i >= first_query of min(k, i + 1) / (i + 1)
    (causal), the baseline that `attention_masses` is compared with."""
    if not causal:
        return k / length
    shares = [min(k, i + 1) / (i + 1) for i in range(first_query, length)]
    return sum(shares) / len(shares)


def sink_heads(recorded: AttentionMap, *, batch_index: int = 0) -> list[HeadSink]:
    """Per head of `recorded` (one sequence of its batch): the mass on key 0 and whether the
    head is a sink (module doc). A self-attention map whose weights above the diagonal are all
    zero is taken as causal (row i sees i + 1 keys), any other as seeing every key."""
    weights = recorded.weights[batch_index].float()  # (H, rows, L_k)
    rows = torch.tensor(recorded.rows)
    L_k = weights.shape[-1]
    keys = torch.arange(L_k)
    causal = recorded.kind == "self" and not weights[:, keys[None, :] > rows[:, None]].any()
    kept = rows > 0 if causal else torch.ones_like(rows, dtype=torch.bool)
    if not kept.any():  # a causal map of row 0 alone: nothing to measure
        return [HeadSink(head, 1.0, 1.0, False) for head in recorded.heads]
    masses = weights[:, kept, 0].mean(dim=1)  # (H,)
    visible = (rows[kept] + 1).clamp(max=L_k) if causal else torch.full((int(kept.sum()),), L_k)
    uniform = float((1.0 / visible.double()).mean())
    threshold = max(SINK_THRESHOLD, BASELINE_FACTOR * uniform)
    return [
        HeadSink(head, float(mass), uniform, float(mass) > threshold)
        for head, mass in zip(recorded.heads, masses.tolist(), strict=True)
    ]
