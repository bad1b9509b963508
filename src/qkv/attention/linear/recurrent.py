"""Causal linear attention one token at a time: a recurrent network whose state is (S, z),
S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j) (Katharopoulos et al. 2020, s3.4). With FAVOR+'s
features (Choromanski et al. 2021) the state also keeps each feature's largest key log-feature,
the offset that keeps its exponentials finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.linear.features import FeatureMap, key_features, query_features
from qkv.attention.linear.parallel import check_inputs, normalise
from qkv.validation import describe

__all__ = ["LinearAttentionState", "linear_attention_state", "linear_attention_step"]


@dataclass(frozen=True, eq=False)
class LinearAttentionState:
    """Causal linear attention's recurrent state after some tokens, per K/V head (Katharopoulos
    et al. 2020, s3.4), in the compute dtype (fp32, fp64 for fp64 inputs).

    key_value_sum: S = sum_j phi(k_j) v_j^T, (B, H_kv, F, D_v).
    key_sum: z = sum_j phi(k_j), (B, H_kv, F).
    key_offset: for a feature map with `log_features`, the largest key log-feature so far per
        feature, (B, H_kv, F): S and z then sum exp(log phi(k_j) - key_offset). None otherwise.
    """

    key_value_sum: torch.Tensor
    key_sum: torch.Tensor
    key_offset: torch.Tensor | None = None


def linear_attention_state(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: FeatureMap,
    key_padding: torch.Tensor | None = None,
) -> LinearAttentionState:
    """The state after keys k (B, H_kv, L_k, D) and values v (B, H_kv, L_k, D_v), e.g. a prompt's;
    `linear_attention_step` goes on from it. key_padding as in `linear_attention`."""
    check_inputs(k, k, v, False, key_padding, 1)
    dtype = torch.promote_types(k.dtype, torch.float32)
    phi_k, offset = key_features(feature_map, k.to(dtype), key_padding)  # (B, H_kv, L_k, F)
    key_value_sum = phi_k.transpose(-1, -2) @ v.to(dtype)  # (B, H_kv, F, D_v)
    key_offset = None if offset is None else offset.squeeze(-2)  # (B, H_kv, F)
    return LinearAttentionState(key_value_sum, phi_k.sum(dim=-2), key_offset)


def linear_attention_step(
    state: LinearAttentionState | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: FeatureMap,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """One step of causal linear attention as a recurrent network (Katharopoulos et al. 2020,
    s3.4): the new token's phi(k) v^T and phi(k) join the state, then phi(q) reads it. O(1) in
    the number of tokens so far; the same outputs as the causal `linear_attention`.

    state: a `LinearAttentionState`, or None before the first token. q: (B, H, 1, D).
    k: (B, H_kv, 1, D). v: (B, H_kv, 1, D_v). Returns (output (B, H, 1, D_v) in q's dtype,
    the new state); the given state is left as it is.
    """
    check_inputs(q, k, v, True, None, 1)
    if q.shape[2] != 1 or k.shape[2] != 1:
        raise ValueError(
            f"q, k, v: expected one new token each (length 1), got L_q={q.shape[2]}, "
            f"L_k={k.shape[2]}"
        )
    new = linear_attention_state(k, v, feature_map=feature_map)
    if state is not None:
        new = _merge(_check_state(state, new), new)
    offset = None if new.key_offset is None else new.key_offset.unsqueeze(-2)  # (B, H_kv, 1, F)
    phi_q = query_features(feature_map, q.to(new.key_sum.dtype), offset, k.shape[1])
    sums = torch.cat([new.key_value_sum, new.key_sum.unsqueeze(-1)], -1)  # (B, H_kv, F, D_v + 1)
    output = normalise(phi_q @ sums.unsqueeze(2)).flatten(1, 2)  # (B, H, 1, D_v)
    return output.to(q.dtype), new


def _merge(old: LinearAttentionState, new: LinearAttentionState) -> LinearAttentionState:
    """The sums of both, brought to the larger offset of each feature when there are offsets."""
    if old.key_offset is None:
        return LinearAttentionState(
            old.key_value_sum + new.key_value_sum, old.key_sum + new.key_sum
        )
    offset = torch.maximum(old.key_offset, new.key_offset)  # (B, H_kv, F)
    old_scale, new_scale = torch.exp(old.key_offset - offset), torch.exp(new.key_offset - offset)
    return LinearAttentionState(
        old.key_value_sum * old_scale.unsqueeze(-1) + new.key_value_sum * new_scale.unsqueeze(-1),
        old.key_sum * old_scale + new.key_sum * new_scale,
        offset,
    )


def _check_state(state: object, new: LinearAttentionState) -> LinearAttentionState:
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state: expected a LinearAttentionState or None, got {describe(state)}")
    same_map = (state.key_offset is None) == (new.key_offset is None)
    if state.key_value_sum.shape != new.key_value_sum.shape or not same_map:
        raise ValueError(
            f"state: expected the sums {tuple(new.key_value_sum.shape)} of this feature map, got "
            f"{tuple(state.key_value_sum.shape)}, key offsets {'as' if same_map else 'unlike'} it"
        )
    return state
