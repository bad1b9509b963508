"""Head roles read from attention: sink, previous-token, duplicate-token and induction heads.

The probe of Olsson et al. 2022 ("In-context Learning and Induction Heads", s2): a sequence of
n random tokens followed by the same n tokens again, (B, 2n). On the repeat, a query at
position t = n + i (i = 0 .. n-1) holds a token seen before at t - n, and the token that came
after it then sits at t - n + 1. Per head, the mean attention over the repeat's queries and the
batch on:

    sink        key 0, the first token (Xiao et al. 2024; `qkv.analysis.inspection.sinks`)
    previous    key t - 1, the token before (a previous-token head, the first half of an
                induction circuit: Elhage et al. 2021, "A Mathematical Framework for
                Transformer Circuits", s "Induction Heads")
    duplicate   key t - n, the earlier copy of the query's own token (a duplicate-token head:
                Wang et al. 2023, "Interpretability in the Wild", s3)
    induction   key t - n + 1, the token that followed the earlier copy: the head that lets the
                model predict the repeat (Olsson et al. 2022)

Uniform attention over the t + 1 visible keys would give each key 1 / (t + 1): at most
1 / (n + 1) on the repeat. A head has a role where its score exceeds `ROLE_THRESHOLD` (0.4:
over 40% of its attention on one key, at least 0.4 (n + 1) times uniform): qkv's threshold,
stated with every result; sinks use Gu et al. 2024's 0.3 (`SINK_THRESHOLD`).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.analysis.inspection.attention_maps import record_attention
from qkv.analysis.inspection.sinks import SINK_THRESHOLD

__all__ = [
    "ROLES",
    "ROLE_THRESHOLD",
    "repeated_random_tokens",
    "role_heads",
    "role_scores",
    "role_scores_of_weights",
]

ROLES = ("sink", "previous", "duplicate", "induction")
ROLE_THRESHOLD = 0.4  # mean attention on the role's key, over the repeat's queries


def repeated_random_tokens(
    n: int, *, batch: int, vocab: tuple[int, int], generator: torch.Generator | None = None
) -> torch.Tensor:
    """(batch, 2n) token ids: n drawn uniformly from [vocab[0], vocab[1]), then the same n.

    Start vocab above a tokenizer's special tokens, so that no row begins a chat turn."""
    low, high = vocab
    if n < 2:
        raise ValueError(f"n: expected at least 2 tokens to repeat, got {n}")
    if batch < 1:
        raise ValueError(f"batch: expected at least 1, got {batch}")
    if not 0 <= low < high:
        raise ValueError(f"vocab: expected 0 <= low < high, got {vocab}")
    first = torch.randint(low, high, (batch, n), generator=generator)
    return torch.cat([first, first], dim=1)


def role_scores_of_weights(weights: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """{role: (H,)} from one layer's weights on the repeat, (B, H, n, 2n): the query rows
    t = n .. 2n-1 of a (B, 2n) repeated input, every key."""
    if weights.shape[-2:] != (n, 2 * n):
        raise ValueError(
            f"weights: expected (B, H, {n}, {2 * n}) rows of the repeat, got {tuple(weights.shape)}"
        )
    t = torch.arange(n, 2 * n, device=weights.device)  # (n,) query positions
    keys = {"sink": torch.zeros_like(t), "previous": t - 1, "duplicate": t - n,
            "induction": t - n + 1}  # fmt: skip
    rows = torch.arange(n, device=weights.device)
    return {
        role: weights[..., rows, key].mean(dim=(0, 2))  # (B, H, n) -> (H,)
        for role, key in keys.items()
    }


def role_scores(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """{role: (layers, H)} of `model` on a repeated input (B, 2n) (`repeated_random_tokens`),
    from the exact attention of its own backend (`record_attention`)."""
    length = input_ids.shape[-1]
    if input_ids.dim() != 2 or length % 2 or length < 4:
        raise ValueError(f"input_ids: expected (B, 2n) with n >= 2, got {tuple(input_ids.shape)}")
    n = length // 2
    if not torch.equal(input_ids[:, :n], input_ids[:, n:]):
        raise ValueError("input_ids: expected n tokens then the same n tokens again")
    with record_attention(model, rows=list(range(n, 2 * n))) as recording, torch.no_grad():
        model(input_ids)
    maps = sorted(recording, key=lambda recorded: recorded.layer)
    per_layer = [role_scores_of_weights(recorded.weights, n) for recorded in maps]
    return {role: torch.stack([scores[role] for scores in per_layer]) for role in ROLES}


def role_heads(scores: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, int, float]]]:
    """{role: [(layer, head, score), ...]} of the heads over their role's threshold, highest
    first: `ROLE_THRESHOLD`, and `SINK_THRESHOLD` for sinks."""
    found = {}
    for role, table in scores.items():  # (layers, H)
        threshold = SINK_THRESHOLD if role == "sink" else ROLE_THRESHOLD
        layers, heads = torch.nonzero(table > threshold, as_tuple=True)
        chosen = [(int(i), int(h), float(table[i, h])) for i, h in zip(layers, heads, strict=True)]
        found[role] = sorted(chosen, key=lambda item: -item[2])
    return found
