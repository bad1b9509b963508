"""Linear attention's feature maps, and their stabilisation.

Feature maps: `elu_feature_map`, elu(x) + 1 (Katharopoulos et al. 2020, s3.2.1), and
`FavorFeatureMap`, the positive orthogonal random features of FAVOR+ (Choromanski et al. 2021,
s2.3-2.4), whose products estimate softmax attention's kernel exp(q^T k / sqrt(D)) without bias.
A feature map is a callable x (..., D) -> phi(x) (..., F) > 0. One that also has `log_features`
(FAVOR+: its exponentials overflow) is stabilised here (`key_features`, `query_features`), as the
Performer implementation subtracts maxima before exp: each feature's largest key log-feature
moves from the keys to the queries (the products do not change), then each query loses its
largest log-feature, a per-query factor that the normalisation cancels. Key and query features
then lie in (0, 1]. The maxima are constants to autograd: the output does not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qkv.validation import check_positive_int, describe

__all__ = [
    "FavorFeatureMap",
    "FeatureMap",
    "elu_feature_map",
    "key_features",
    "orthogonal_random_features",
    "query_features",
]

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1, elementwise and positive, F = D (Katharopoulos et al. 2020, s3.2.1)."""
    return F.elu(x) + 1.0


def orthogonal_random_features(
    num_features: int,
    head_dim: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The (F, D) projection of FAVOR+: rows w_r ~ N(0, I_D), orthogonal within each block of D
    rows (Choromanski et al. 2021, s2.4).

    A block is the Q factor of a Gaussian matrix, its signs fixed by R's diagonal so that it is
    uniform over the orthogonal matrices. Its unit rows take the norms of independent Gaussian
    vectors, so that each row keeps the law N(0, I_D) (the estimate stays unbiased) while the
    orthogonality lowers its variance. Drawn in fp64 on the CPU from `generator` (a CPU
    generator; torch's global one if None).
    """
    check_positive_int("num_features", num_features)
    check_positive_int("head_dim", head_dim)
    blocks = []
    for _ in range(-(-num_features // head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # (D, D): orthonormal rows
    directions = torch.cat(blocks)[:num_features]  # (F, D)
    gaussian = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
    norms = torch.linalg.vector_norm(gaussian, dim=-1, keepdim=True)  # (F, 1): chi, D degrees
    return (directions * norms).to(device=device, dtype=dtype)


@dataclass(frozen=True, eq=False)
class FavorFeatureMap:
    """The positive random features of FAVOR+ (Choromanski et al. 2021, s2.3, Lemma 1):

        phi(x)_r = exp(w_r^T x' - |x'|^2 / 2) / sqrt(F),   x' = x D^(-1/4),   r = 1 .. F,

    so that E[phi(q)^T phi(k)] = exp(q'^T k') = exp(q^T k / sqrt(D)), softmax attention's kernel.
    projection: (F, D), the rows w_r (`orthogonal_random_features`). Calling the map gives phi(x),
    which overflows for large x; `linear_attention` uses `log_features` and stabilises them.
    """

    projection: torch.Tensor

    def __post_init__(self) -> None:
        p = self.projection
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"projection: expected a floating-point tensor, got {describe(p)}")
        if p.dim() != 2:
            raise ValueError(f"projection: expected shape (F, D), got {tuple(p.shape)}")

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """log phi(x): (..., F) for x (..., D)."""
        num_features, head_dim = self.projection.shape
        if x.shape[-1] != head_dim:
            raise ValueError(
                f"x: expected head dim {head_dim} (the projection's), got {describe(x)}"
            )
        x = x * head_dim**-0.25  # x': then q'^T k' = q^T k / sqrt(D)
        projected = x @ self.projection.to(x).T  # (..., F): w_r^T x'
        return projected - x.square().sum(-1, keepdim=True) / 2 - math.log(num_features) / 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.log_features(x))


def key_features(
    feature_map: FeatureMap, k: torch.Tensor, key_padding: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """phi(k) (B, H_kv, L_k, F), 0 on padded keys, and for log-features the offset (B, H_kv, 1, F)
    taken from them: each feature's largest log-feature over the real keys."""
    keep = None if key_padding is None else key_padding[:, None, :, None]  # (B, 1, L_k, 1)
    log_features = getattr(feature_map, "log_features", None)
    if log_features is None:
        phi_k = _checked_features(feature_map(k), k)
        return (phi_k if keep is None else phi_k.masked_fill(~keep, 0.0)), None
    log_k = _checked_features(log_features(k), k)
    if keep is not None:
        log_k = log_k.masked_fill(~keep, -math.inf)
    if log_k.shape[-2] == 0:
        offset = log_k.new_zeros(*log_k.shape[:-2], 1, log_k.shape[-1])
    else:
        offset = log_k.detach().amax(dim=-2, keepdim=True)  # (B, H_kv, 1, F)
        offset = offset.masked_fill(offset == -math.inf, 0.0)  # no real key: any finite value
    return torch.exp(log_k - offset), offset


def query_features(
    feature_map: FeatureMap, q: torch.Tensor, offset: torch.Tensor | None, num_kv_heads: int
) -> torch.Tensor:
    """phi(q) grouped by K/V head, (B, H_kv, G, L_q, F); for log-features, times exp(offset) and
    divided by each query's largest feature, a factor that the normalisation cancels."""
    log_features = getattr(feature_map, "log_features", None)
    if log_features is None:
        return _checked_features(feature_map(q), q).unflatten(1, (num_kv_heads, -1))
    log_q = _checked_features(log_features(q), q).unflatten(1, (num_kv_heads, -1))
    log_q = log_q + offset.unsqueeze(2)  # (B, H_kv, G, L_q, F)
    return torch.exp(log_q - log_q.detach().amax(dim=-1, keepdim=True))


def _checked_features(features: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(features, torch.Tensor) or features.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"feature_map: expected features (..., F) for an input of shape {tuple(x.shape)}, "
            f"got {describe(features)}"
        )
    return features
