"""Denoising diffusion: the forward noising process, its posterior, and two samplers.

Ho et al. 2020 ("Denoising Diffusion Probabilistic Models"), with betas beta_1 .. beta_T,
alpha_t = 1 - beta_t and alpha_bar_t = prod_{s <= t} alpha_s:

    q(x_t | x_{t-1}) = N(sqrt(1 - beta_t) x_{t-1}, beta_t I)                      eq. 2
    q(x_t | x_0)     = N(sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I)              eq. 4
    q(x_{t-1} | x_t, x_0) = N(mu_tilde, beta_tilde_t I)                           eq. 6-7
        mu_tilde     = sqrt(alpha_bar_{t-1}) beta_t / (1 - alpha_bar_t) x_0
                       + sqrt(alpha_t) (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t) x_t
        beta_tilde_t = (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t) beta_t

A network eps_theta(x_t, t) learns the noise of eq. 4 (the simple loss, eq. 14). Sampling:

- `ddpm_sample`, ancestral sampling (Algorithm 2): from x_T ~ N(0, I), each step draws
  x_{t-1} from the posterior above with x_0 replaced by its estimate from the predicted noise,
  x0_hat = (x_t - sqrt(1 - alpha_bar_t) eps) / sqrt(alpha_bar_t), and sigma_t^2 = beta_tilde_t
  (s3.2: beta_t and beta_tilde_t do about as well). Without clipping this is Algorithm 2's
  x_{t-1} = (x_t - beta_t / sqrt(1 - alpha_bar_t) eps) / sqrt(alpha_t) + sigma_t z exactly;
  with `clip_denoised` x0_hat is clipped to the data's range [-1, 1] first, as Ho et al.'s
  released sampler does.
- `ddim_sample`, DDIM (Song et al. 2021, "Denoising Diffusion Implicit Models", eq. 12) on a
  subsequence of the timesteps: eta = 0 is deterministic, eta = 1 has DDPM's variance.

Timesteps are 0-based here: index t in [0, T) is the paper's t + 1, so index 0 is the last
denoising step (alpha_bar_{t-1} there is alpha_bar_0 = 1). The schedule is kept in float64,
and each coefficient is cast to the data's dtype where it is used. A noise predictor is any
callable (x_t (B, ...), t (B,) int64) -> eps of x_t's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qkv.validation import check_int, check_positive_float, check_positive_int

__all__ = [
    "NoiseSchedule",
    "ddim_sample",
    "ddim_timesteps",
    "ddpm_sample",
    "ddpm_step",
    "linear_betas",
    "predict_x0",
    "q_posterior",
    "q_sample",
    "q_step",
]

NoisePredictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_betas(
    num_timesteps: int = 1000, *, beta_start: float = 1e-4, beta_end: float = 0.02
) -> torch.Tensor:
    """beta_1 .. beta_T rising linearly from beta_start to beta_end, float64 (T,) (Ho et al.
    2020, s4: T = 1000, 1e-4 to 0.02)."""
    check_positive_int("num_timesteps", num_timesteps)
    check_positive_float("beta_start", beta_start)
    check_positive_float("beta_end", beta_end)
    if not beta_start <= beta_end < 1:
        raise ValueError(
            f"beta_end: {beta_end} with beta_start={beta_start}; expected "
            f"beta_start <= beta_end < 1"
        )
    return torch.linspace(beta_start, beta_end, num_timesteps, dtype=torch.float64)


class NoiseSchedule:
    """The float64 quantities of a schedule, each (T,), indexed by 0-based timestep t:
    betas, alphas, alphas_cumprod (alpha_bar_t), alphas_cumprod_prev (alpha_bar_{t-1}, 1 at
    t = 0), posterior_variance (beta_tilde_t), posterior_coef_x0 and posterior_coef_xt (the
    two weights of mu_tilde, eq. 7)."""

    def __init__(self, betas: torch.Tensor) -> None:
        if not isinstance(betas, torch.Tensor) or betas.dim() != 1 or len(betas) == 0:
            raise ValueError(f"betas: expected a non-empty 1-D tensor, got {betas!r}")
        betas = betas.detach().to("cpu", torch.float64)
        if not bool(((betas > 0) & (betas < 1)).all()):
            raise ValueError("betas: expected every beta in (0, 1)")
        self.betas = betas
        self.alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        self.alphas_cumprod_prev = torch.cat((betas.new_ones(1), self.alphas_cumprod[:-1]))
        one_minus = 1.0 - self.alphas_cumprod
        self.posterior_variance = (1.0 - self.alphas_cumprod_prev) / one_minus * betas
        self.posterior_coef_x0 = self.alphas_cumprod_prev.sqrt() * betas / one_minus
        self.posterior_coef_xt = self.alphas.sqrt() * (1.0 - self.alphas_cumprod_prev) / one_minus

    @classmethod
    def linear(
        cls, num_timesteps: int = 1000, *, beta_start: float = 1e-4, beta_end: float = 0.02
    ) -> NoiseSchedule:
        """The schedule of `linear_betas` (Ho et al. 2020, s4)."""
        return cls(linear_betas(num_timesteps, beta_start=beta_start, beta_end=beta_end))

    @property
    def num_timesteps(self) -> int:
        return len(self.betas)

    def at(self, values: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """values[t] shaped (B, 1, ..., 1) to broadcast against `like` (B, ...), in its dtype
        and on its device."""
        picked = values[t.to("cpu")].to(device=like.device, dtype=like.dtype)  # (B,)
        return picked.view(-1, *([1] * (like.dim() - 1)))

    def check_timesteps(self, t: torch.Tensor, batch: int) -> None:
        if not isinstance(t, torch.Tensor) or t.shape != (batch,) or t.is_floating_point():
            raise ValueError(f"t: expected a ({batch},) integer tensor of timesteps, got {t!r}")
        if batch and not 0 <= int(t.min()) <= int(t.max()) < self.num_timesteps:
            raise ValueError(
                f"t: expected timesteps in [0, {self.num_timesteps}), got values from "
                f"{int(t.min())} to {int(t.max())}"
            )


def q_sample(
    schedule: NoiseSchedule, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) noise, a draw of q(x_t | x_0)
    (Ho et al. 2020, eq. 4): x0 and noise (B, ...), t (B,)."""
    schedule.check_timesteps(t, x0.shape[0])
    alpha_bar = schedule.at(schedule.alphas_cumprod, t, x0)
    return alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise


def q_step(
    schedule: NoiseSchedule, x_prev: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """One step of the forward chain, x_t = sqrt(1 - beta_t) x_{t-1} + sqrt(beta_t) noise, a
    draw of q(x_t | x_{t-1}) (Ho et al. 2020, eq. 2)."""
    schedule.check_timesteps(t, x_prev.shape[0])
    beta = schedule.at(schedule.betas, t, x_prev)
    return (1 - beta).sqrt() * x_prev + beta.sqrt() * noise


def q_posterior(
    schedule: NoiseSchedule, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) of q(x_{t-1} | x_t, x_0) (Ho et al. 2020, eq. 6-7); the variance
    (B, 1, ..., 1)."""
    schedule.check_timesteps(t, x_t.shape[0])
    mean = (schedule.at(schedule.posterior_coef_x0, t, x_t) * x0
            + schedule.at(schedule.posterior_coef_xt, t, x_t) * x_t)  # fmt: skip
    return mean, schedule.at(schedule.posterior_variance, t, x_t)


def predict_x0(
    schedule: NoiseSchedule, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    """x0_hat = (x_t - sqrt(1 - alpha_bar_t) eps) / sqrt(alpha_bar_t): eq. 4 solved for x_0."""
    alpha_bar = schedule.at(schedule.alphas_cumprod, t, x_t)
    return (x_t - (1 - alpha_bar).sqrt() * eps) / alpha_bar.sqrt()


def ddpm_step(
    schedule: NoiseSchedule,
    x_t: torch.Tensor,
    t: torch.Tensor,
    eps: torch.Tensor,
    noise: torch.Tensor,
    *,
    clip_denoised: bool = True,
) -> torch.Tensor:
    """x_{t-1} from x_t and the predicted noise eps: the posterior mean at x0_hat (clipped to
    [-1, 1] with clip_denoised) plus sqrt(beta_tilde_t) * noise (Ho et al. 2020, Algorithm 2)."""
    x0 = predict_x0(schedule, x_t, t, eps)
    if clip_denoised:
        x0 = x0.clamp(-1.0, 1.0)
    mean, variance = q_posterior(schedule, x0, x_t, t)
    return mean + variance.sqrt() * noise


def ddpm_sample(
    predict_noise: NoisePredictor,
    schedule: NoiseSchedule,
    shape: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    clip_denoised: bool = True,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Ancestral sampling (Ho et al. 2020, Algorithm 2): T calls of predict_noise, from
    x_T ~ N(0, I) of `shape` (B, ...) down to x_0. Every draw comes from `generator` on the CPU
    (the same samples on every device)."""
    x = _normal(shape, generator, device, dtype)  # x_T
    for step in reversed(range(schedule.num_timesteps)):
        t = torch.full((shape[0],), step, dtype=torch.long, device=device)
        eps = predict_noise(x, t)
        noise = _normal(shape, generator, device, dtype) if step > 0 else torch.zeros_like(x)
        x = ddpm_step(schedule, x, t, eps, noise, clip_denoised=clip_denoised)
    return x


def ddim_timesteps(num_timesteps: int, steps: int) -> list[int]:
    """`steps` timesteps spread evenly from T - 1 down to 0 (both included), largest first:
    the subsequence tau that DDIM walks (Song et al. 2021, s4.2)."""
    check_positive_int("num_timesteps", num_timesteps)
    check_int("steps", steps, minimum=1)
    if steps > num_timesteps:
        raise ValueError(f"steps: {steps} is more than the schedule's {num_timesteps} timesteps")
    if steps == 1:
        return [num_timesteps - 1]
    spread = torch.linspace(num_timesteps - 1, 0, steps, dtype=torch.float64).round().long()
    return spread.tolist()


def ddim_sample(
    predict_noise: NoisePredictor,
    schedule: NoiseSchedule,
    shape: tuple[int, ...],
    *,
    steps: int = 50,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    clip_denoised: bool = True,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """DDIM sampling (Song et al. 2021, eq. 12) over `ddim_timesteps(T, steps)`:

            x_prev = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - sigma^2) eps + sigma z
            sigma  = eta sqrt((1 - a_prev) / (1 - a_t)) sqrt(1 - a_t / a_prev)

    with a_t = alpha_bar_t and a_prev = alpha_bar of the next timestep of the subsequence.

        eta = 0: deterministic given x_T (the default); the last step returns x0_hat. With
        clip_denoised, x0_hat is clipped to [-1, 1] and eps recomputed from it."""
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or eta < 0:
        raise ValueError(f"eta: expected a number >= 0, got {eta!r}")
    timesteps = ddim_timesteps(schedule.num_timesteps, steps)
    x = _normal(shape, generator, device, dtype)
    for index, step in enumerate(timesteps):
        t = torch.full((shape[0],), step, dtype=torch.long, device=device)
        eps = predict_noise(x, t)
        alpha_bar = schedule.at(schedule.alphas_cumprod, t, x)
        x0 = predict_x0(schedule, x, t, eps)
        if clip_denoised:
            x0 = x0.clamp(-1.0, 1.0)
            eps = (x - alpha_bar.sqrt() * x0) / (1 - alpha_bar).sqrt()
        if index == len(timesteps) - 1:
            return x0
        prev = torch.full_like(t, timesteps[index + 1])
        alpha_bar_prev = schedule.at(schedule.alphas_cumprod, prev, x)
        sigma = eta * ((1 - alpha_bar_prev) / (1 - alpha_bar)
                       * (1 - alpha_bar / alpha_bar_prev)).sqrt()  # fmt: skip
        x = alpha_bar_prev.sqrt() * x0 + (1 - alpha_bar_prev - sigma**2).sqrt() * eps
        if eta > 0:
            x = x + sigma * _normal(shape, generator, device, dtype)
    return x


def _normal(
    shape: tuple[int, ...],
    generator: torch.Generator | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=dtype).to(device)
