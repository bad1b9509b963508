"""`LinearAttention`, the nn.Module that runs linear attention behind `qkv.attention`'s call
signature, with elu(x) + 1 features (Katharopoulos et al. 2020) or FAVOR+'s random features in a
buffer (Choromanski et al. 2021), and refuses the keywords that act on the (L_q, L_k) scores.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qkv.attention.linear.features import (
    FavorFeatureMap,
    FeatureMap,
    elu_feature_map,
    orthogonal_random_features,
)
from qkv.attention.linear.parallel import CHUNK_SIZE, check_inputs, describe_mask, linear_attention
from qkv.validation import check_int, check_positive_int, describe

__all__ = ["LinearAttention"]


class LinearAttention(nn.Module):
    """Linear attention with `qkv.attention`'s call signature, e.g. for
    `qkv.layers.MultiHeadAttention(E, H, attention=LinearAttention("favor", head_dim=E // H))`.

    Args:
        feature_map: "elu", elu(x) + 1 (Katharopoulos et al. 2020, s3.2.1), or "favor", FAVOR+'s
            random features, an unbiased softmax approximation (Choromanski et al. 2021, s2.3-2.4).
        num_features: F random features ("favor" only); default D * ceil(ln D), the O(D log D)
            features the paper finds sufficient.
        head_dim: D ("favor" only, required).
        seed: seeds the draws of the projection ("favor" only); None: torch's global generator.
        chunk_size: C of the causal form.

    Buffer `projection` (F, D) for "favor" (None for "elu"): in the state dict, moved by `.to()`;
    `redraw()` draws a fresh one, as Performers do from time to time in training. A call serves
    `causal` and a key-padding `mask`, bool (B|1, 1, 1, L_k) as `qkv.masks.padding` makes; what
    acts on the (L_q, L_k) scores (window, bias, dropout, weights, ...) raises a ValueError.
    """

    def __init__(
        self,
        feature_map: str = "elu",
        *,
        num_features: int | None = None,
        head_dim: int | None = None,
        seed: int | None = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        super().__init__()
        if not isinstance(feature_map, str):
            raise TypeError(f"feature_map: expected 'elu' or 'favor', got {describe(feature_map)}")
        if feature_map not in ("elu", "favor"):
            raise ValueError(f"feature_map: expected 'elu' or 'favor', got {describe(feature_map)}")
        self.feature_map_name = feature_map
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.head_dim, self.num_features, self._generator = head_dim, num_features, None
        if feature_map == "elu":
            given = {"num_features": num_features, "head_dim": head_dim, "seed": seed}
            for name, value in given.items():
                if value is not None:
                    raise ValueError(
                        f"{name}: only feature_map='favor' draws random features; expected "
                        f"None with feature_map='elu', got {value!r}"
                    )
            self.register_buffer("projection", None)
            return
        check_positive_int("head_dim", head_dim)
        if num_features is None:
            self.num_features = head_dim * max(1, math.ceil(math.log(head_dim)))
        check_positive_int("num_features", self.num_features)
        if seed is not None:
            self._generator = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))
        projection = orthogonal_random_features(
            self.num_features, head_dim, generator=self._generator
        )
        self.register_buffer("projection", projection)

    @property
    def feature_map(self) -> FeatureMap:
        """The feature map, as `linear_attention` and `linear_attention_step` take it."""
        return elu_feature_map if self.projection is None else FavorFeatureMap(self.projection)

    def redraw(self) -> None:
        """Draws a fresh projection in place (the buffer keeps its device and dtype)."""
        if self.projection is None:
            raise ValueError(
                "redraw: feature_map='elu' has no random projection; expected a LinearAttention "
                "built with feature_map='favor'"
            )
        fresh = orthogonal_random_features(*self.projection.shape, generator=self._generator)
        with torch.no_grad():
            self.projection.copy_(fresh)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        **options: object,
    ) -> torch.Tensor:
        """q (B, H, L_q, D), k (B, H_kv, L_k, D), v (B, H_kv, L_k, D_v) -> (B, H, L_q, D_v), with
        `qkv.attention`'s keywords; the ones linear attention cannot serve must keep their
        defaults."""
        _check_options(options)
        check_inputs(q, k, v, causal, None, self.chunk_size)
        if self.projection is not None and q.shape[-1] != self.projection.shape[1]:
            raise ValueError(
                f"q: expected head dim {self.projection.shape[1]} (this module's head_dim), "
                f"got {tuple(q.shape)}"
            )
        return linear_attention(
            q,
            k,
            v,
            feature_map=self.feature_map,
            causal=causal,
            key_padding=_key_padding(mask, q.shape[0], k.shape[2]),
            chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        favor = f", num_features={self.num_features}, head_dim={self.head_dim}"
        return (
            f"feature_map={self.feature_map_name!r}"
            f"{favor if self.projection is not None else ''}, chunk_size={self.chunk_size}"
        )


# qkv.attention's keywords that act on the (L_q, L_k) scores, with the values that leave them be
_SCORE_OPTIONS = {
    "scale": None,
    "bias": None,
    "window": None,
    "sinks": 0,
    "alibi_slopes": None,
    "softcap": None,
    "score_mod": None,
    "dropout_p": 0.0,
    "return_weights": False,
    "backend": "auto",
}


def _check_options(options: dict[str, object]) -> None:
    for name, value in options.items():
        if name not in _SCORE_OPTIONS:
            raise TypeError(
                f"{name}: expected a keyword of qkv.attention, one of {list(_SCORE_OPTIONS)}"
            )
        expected = _SCORE_OPTIONS[name]
        differs = isinstance(value, torch.Tensor) or value is None or value != expected
        if value is not expected and differs:
            raise ValueError(
                f"{name}: linear attention never forms the (L_q, L_k) attention scores or "
                f"weights, so it cannot serve it; expected {expected!r}, got {describe(value)}"
            )


def _key_padding(mask: torch.Tensor | None, batch: int, key_len: int) -> torch.Tensor | None:
    """A (B|1, 1, 1, L_k) bool mask as (B, L_k) key padding; anything else is refused."""
    if mask is None:
        return None
    if not (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1:] == (1, 1, key_len)
    ):
        raise ValueError(
            f"mask: linear attention takes only a key-padding mask, bool (B|1, 1, 1, L_k) = "
            f"({batch}, 1, 1, {key_len}) as qkv.masks.padding makes, True on real keys; got "
            f"{describe_mask(mask)}"
        )
    return mask[:, 0, 0, :].expand(batch, key_len)  # (B, L_k)
