"""Which query rows must come out NaN: qkv's NaN rule for q and k on the fused kernels.

The rule (`qkv.attention.masks`): a NaN in a query row, or in a key that row may see, makes
that row's output NaN, as the softmax of the scores computes it (the reference backend). The
fused kernels that `sdpa` and `flex` call (PyTorch's CPU flash kernel, FlexAttention's) break
it where every score of a row is NaN (a NaN query, or only NaN keys in view): their running
maximum skips NaN, finds no score above -inf and returns the row as empty, output 0. A model
whose encoder went NaN would then cross-attend to zeros and decode on without a sign.

And where a mask hides a NaN key, SDPA's kernel adds the mask to the NaN score (NaN - inf is
NaN) instead of removing it, so rows that cannot see the key come out NaN too. Under a mask,
`sdpa` gives the kernel `without_nan_keys(k)`: the NaN keys set to 0, which the mask removes
where it should, while `nan_rows`, computed from the real k, marks the rows that see them.

`nan_rows` finds those rows from q and k themselves (a pass over each, no host sync, so it
traces into compiled steps), and the backends fill them with NaN after the kernel. Its cost
is O(L (D + L_k)) beside the kernel's O(L L_k D); where every row sees key 0 (no mask, or
aligned causal: a decoding step) `sdpa` passes key 0 alone, which is enough there. A masked
call reads the K cache once more (`nan_keys`). An eager CPU call under a causal/window mask
(whose structure `sdpa` caches, which it does only outside a traced graph) then asks whether
any key is NaN (`known_clean`); where none is, it skips `without_nan_keys` (a copy of K) and
the (L_q, L_k) pass of `nan_rows`: a prompt's chunk over a filled KV cache pays for neither.
"""

from __future__ import annotations

import torch

__all__ = ["fill_nan_rows", "known_clean", "nan_keys", "nan_rows", "without_nan_keys"]


def nan_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    visible: torch.Tensor | None,
    nan_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool (B, H, L_q, 1): the rows holding a NaN in q or seeing a NaN key.

    q (B, H, L_q, D); k (B, H_kv, L_k, D), H a multiple of H_kv (grouped-query heads share
    their K/V head); visible: bool, broadcastable to (B, H, L_q, L_k), True where a row may
    see a key, or None for every key; nan_key: `nan_keys(k)` where the caller has it already.

    A `visible` the same for every head (head dim 1) is read once per K/V head, not once per
    query head: (B, H_kv, L_q, L_k) bools instead of (B, H, L_q, L_k).
    """
    nan_query = torch.isnan(q.amax(dim=-1, keepdim=True))  # (B, H, L_q, 1)
    nan_key = nan_keys(k) if nan_key is None else nan_key  # (B, H_kv, L_k)
    group_size = q.shape[1] // k.shape[1]
    if visible is None:
        seen = nan_key.any(dim=-1, keepdim=True).unsqueeze(-1)  # (B, H_kv, 1, 1)
    elif visible.dim() < 3 or visible.shape[-3] == 1:  # one visibility for every head
        seen = (visible & nan_key.unsqueeze(-2)).any(dim=-1, keepdim=True)  # (B, H_kv, L_q, 1)
    else:
        if group_size > 1:
            nan_key = nan_key.repeat_interleave(group_size, dim=1)  # (B, H, L_k)
        return nan_query | (visible & nan_key.unsqueeze(-2)).any(dim=-1, keepdim=True)
    if group_size > 1:
        seen = seen.repeat_interleave(group_size, dim=1)  # (B, H, L_q | 1, 1)
    return nan_query | seen


def nan_keys(k: torch.Tensor) -> torch.Tensor:
    """Bool (B, H_kv, L_k): the keys of k (B, H_kv, L_k, D) that hold a NaN.

    Read from each key's maximum, which is NaN exactly where a value is: several times
    cheaper than `isnan(k).any(-1)`, whose reduction over bools is slow on the CPU.
    """
    return torch.isnan(k.amax(dim=-1))


def known_clean(nan_key: torch.Tensor) -> bool:
    """Whether no key holds a NaN, asked of the host: for an eager call on the CPU only (there
    one host read is a memory load; on a GPU it would wait for the queued kernels, and in a
    traced graph it would break the graph). The caller vouches that the call is eager;
    False on any other device."""
    return nan_key.device.type == "cpu" and not bool(nan_key.any())


def fill_nan_rows(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """output (B, H, L_q, D_v) with `rows` (broadcastable bool (B, H, L_q, 1)) set to NaN."""
    return output.masked_fill(rows, float("nan"))


def without_nan_keys(k: torch.Tensor, nan_key: torch.Tensor | None = None) -> torch.Tensor:
    """k (B, H_kv, L_k, D) with every key that holds a NaN set to 0 (for a masked kernel);
    nan_key: `nan_keys(k)` where the caller has it already."""
    nan_key = nan_keys(k) if nan_key is None else nan_key
    return k.masked_fill(nan_key.unsqueeze(-1), 0.0)
