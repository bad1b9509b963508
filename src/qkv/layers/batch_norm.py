"""BatchNorm over token features (Ioffe & Szegedy 2015), with the padding left out on request.

    BN(x)_{b,l,j} = (x_{b,l,j} - mu_j) / sqrt(sigma_j^2 + eps) * weight_j + bias_j

mu_j and sigma_j^2 are the mean and the biased variance of channel j over the tokens of the
whole batch (Ioffe & Szegedy 2015, s3, Algorithm 1, with the B * L positions as the mini-batch).
Unlike LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), which normalise each
token over its own features, the output of one token depends on every other token in the
batch, padding included: a padded batch of text normalises with statistics that the padding
pulls towards the pad token's features. Given a `mask` (or `lengths`), the statistics are taken
over the real tokens only, as `nn.BatchNorm1d` on the (N, E) matrix of real tokens computes
them; without one, over all B * L positions, which is what BatchNorm does to a padded batch
when nobody tells it where the padding is.

In training mode the batch statistics normalise, and running estimates (an exponential moving
average with `momentum`, of the mean and of the unbiased variance, as `nn.BatchNorm1d` keeps)
are updated; in eval mode the running estimates normalise (Ioffe & Szegedy 2015, s3.1).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.attention.masks import padding
from qkv.validation import check_positive_float, check_positive_int, describe

__all__ = ["BatchNorm"]


class BatchNorm(nn.Module):
    """BatchNorm over (B, L, E) token features: one mean and variance per channel, over the
    real tokens of the batch (padding excluded by `mask` or `lengths`), or over all positions.

    Args:
        dim: E, the number of channels (features).
        eps: added to the variance.
        momentum: weight of the new batch statistics in the running estimates, in (0, 1].
        affine: a learned per-channel weight (ones) and bias (zeros).
        track_running_stats: keep running estimates and normalise with them in eval mode; when
            False, batch statistics normalise in both modes (as `nn.BatchNorm1d`).

    Buffers: running_mean (E,) and running_var (E,) (zeros and ones at first). The statistics
    are computed in fp32 whatever the input dtype, as `LayerNorm`'s are.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.eps = check_positive_float("eps", eps)
        if not check_positive_float("momentum", momentum) <= 1.0:
            raise ValueError(f"momentum: expected a float in (0, 1], got {momentum}")
        self.momentum = float(momentum)
        for name, flag in (("affine", affine), ("track_running_stats", track_running_stats)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {describe(flag)}")
        self.track_running_stats = track_running_stats
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(dim, **factory)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **factory)) if affine else None
        statistics_dtype = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)
        running = {"device": device, "dtype": statistics_dtype}
        self.register_buffer(
            "running_mean", torch.zeros(dim, **running) if track_running_stats else None
        )
        self.register_buffer(
            "running_var", torch.ones(dim, **running) if track_running_stats else None
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) -> (B, L, E).

        mask: (B, L) bool, True on real tokens (the polarity of `qkv.masks`); or lengths: (B,)
        integers, the first lengths[b] positions of row b real. Only the real tokens enter the
        statistics; every position is normalised with them (the outputs at padded positions
        are computed, and mean nothing). Neither: every position counts as a token.
        """
        real = _real_tokens(x, self.dim, mask, lengths)  # (B, L) bool, or None: all of them
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute_dtype)
        if self.training or not self.track_running_stats:
            tokens = h.reshape(-1, self.dim) if real is None else h[real]  # (N, E)
            count = tokens.shape[0]
            if self.training and count < 2:
                raise ValueError(
                    f"mask: expected at least 2 real tokens to estimate a variance in training "
                    f"mode, got {count}"
                )
            mean = tokens.mean(dim=0)  # (E,)
            var = tokens.var(dim=0, unbiased=False)  # (E,): biased, as Algorithm 1 normalises
            if self.training and self.track_running_stats:
                self._update_running(mean, var, count)
        else:
            mean, var = self.running_mean.to(compute_dtype), self.running_var.to(compute_dtype)
        out = (h - mean) * torch.rsqrt(var + self.eps)  # (B, L, E)
        if self.weight is not None:
            out = out * self.weight.to(compute_dtype) + self.bias.to(compute_dtype)
        return out.to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """running = (1 - momentum) running + momentum batch; the variance unbiased, N/(N-1)."""
        unbiased = var * (count / (count - 1))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.weight is not None}, track_running_stats={self.track_running_stats}"
        )


def _real_tokens(
    x: torch.Tensor, dim: int, mask: torch.Tensor | None, lengths: torch.Tensor | None
) -> torch.Tensor | None:
    """The (B, L) bool mask of real tokens from `mask` or `lengths`, or None for all."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"x: expected shape (B, L, {dim}), got {tuple(x.shape)}")
    B, L, _ = x.shape
    if mask is not None and lengths is not None:
        raise ValueError("mask: expected either mask or lengths, got both")
    if lengths is not None:
        return padding(lengths, L)[:, 0, 0, :]  # (B, L); padding checks lengths
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool tensor (True = real token), got {describe(mask)}")
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"mask: expected shape (B, L) = ({B}, {L}), got {tuple(mask.shape)}")
    return mask
