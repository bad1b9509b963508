"""`DiffusionTransformer`: a text-conditioned noise predictor eps_theta(x_t, t, prompt) over
images cut into patches (Ho et al. 2020's DDPM with a Transformer denoiser, Peebles & Xie 2023).

    noisy image x_t                                              (B, C, H, W)
    -> patches, flattened and projected, + learned positions     (B, N, E)
    timestep t -> sinusoids (Vaswani et al. 2017, s3.5) -> MLP   (B, E)        the condition c
    prompt ids -> embeddings + positions -> text encoder         (B, S, E)     the context
    -> num_layers blocks: self-attention over the image tokens,
       cross-attention to the prompt's tokens, FFN               (B, N, E)
    -> final norm, Linear(E -> C * P * P), patches put back      (B, C, H, W)  the noise

Conditioning ("conditioning" in the config): "adaln_zero" feeds c to every sub-layer as a
shift, scale and gate (`qkv.layers.AdaLNZeroBlock`, DiT's adaLN-Zero, s3.2), and to the final
norm; "add" adds c to the image tokens once and uses plain pre-norm blocks
(`qkv.layers.DecoderBlock` without its causal mask), so only attention and the residual stream
carry it. Either way the prompt enters by cross-attention, the image tokens as queries and the
prompt's tokens as keys and values, its padding masked (Rombach et al. 2022, s3.3).
"in_context" concatenates instead (DiT's in-context conditioning, s3.2): c as one token and the
encoded prompt's tokens go before the image tokens, plain pre-norm self-attention blocks
(`qkv.layers.EncoderBlock`) treat them as any other token (the prompt's padding masked as keys),
and they are dropped after the last block. The last linear map starts at zero, so an untrained
model predicts no noise (DiT, s3.2).

Classifier-free guidance (Ho & Salimans 2022): one model learns both eps(x_t, prompt) and
eps(x_t, null prompt) (the prompt replaced by a null one in a share of the training steps), and
sampling follows eps_u + s (eps_c - eps_u) (`classifier_free_guidance`, `guided_noise`).
`recording_cross_attention` collects the cross-attention weights while the model runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from qkv.attention import attention
from qkv.layers import DecoderBlock, EncoderBlock, LayerNorm, PatchEmbedding
from qkv.layers.adaln import AdaLNModulation, AdaLNZeroBlock, layer_norm_without_affine, modulate
from qkv.layers.attention import MultiHeadAttention
from qkv.models.diffusion_config import DiffusionConfig
from qkv.models.diffusion_prompt import PromptDenoiser
from qkv.models.serialization import register_model_class
from qkv.positional import LearnedPositionalEmbedding

__all__ = [
    "DiffusionConfig",
    "DiffusionTransformer",
    "classifier_free_guidance",
    "guided_noise",
    "recording_cross_attention",
]


class DiffusionTransformer(PromptDenoiser):
    """The noise predictor eps_theta(x_t, t, prompt); see the module docstring.

    Submodules: `patch_embedding`, `position_embedding` (over the N patches), the timestep's
    and the prompt's (`PromptDenoiser`: `time_embedding`, `time_mlp`, `token_embedding`,
    `prompt_position_embedding`, `text_blocks`, `text_norm`), `blocks` (`AdaLNZeroBlock`,
    `DecoderBlock`, or `EncoderBlock` in context), `final_modulation` (adaLN-Zero only) or
    `final_norm`, `head` (Linear(E -> C * P * P), zero at initialisation). `schedule`: the
    `NoiseSchedule` the model is trained for.
    """

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__(config)
        E = config.embed_dim
        self.patch_embedding = PatchEmbedding(
            image_size=config.image_size, patch_size=config.patch_size,
            channels=config.channels, embed_dim=E,
        )  # fmt: skip
        self.position_embedding = LearnedPositionalEmbedding(config.num_patches, E)
        self._build_conditioning()
        self.blocks = nn.ModuleList(_denoiser_block(config) for _ in range(config.num_layers))
        if config.conditioning == "adaln_zero":
            self.final_modulation = AdaLNModulation(E, E, 2)
        else:
            self.final_norm = LayerNorm(E, eps=config.norm_eps)
        P = config.patch_size
        self.head = nn.Linear(E, config.channels * P * P)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self,
        noisy_images: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The predicted noise (B, C, H, W) of noisy_images x_t (B, C, H, W) at timesteps t
        (B,) int64 in [0, T), conditioned on prompt_ids (B, S); prompt_mask (B, S) is 1/True on
        the prompt's tokens and 0/False on padding (default: no padding)."""
        mask, context, cond = self.conditions(noisy_images, timesteps, prompt_ids, prompt_mask)
        x = self.patch_embedding(noisy_images)  # (B, N, E)
        x = x + self.position_embedding(torch.arange(x.shape[1], device=x.device))
        if self.config.conditioning == "adaln_zero":
            for block in self.blocks:
                x = block(x, cond, context, context_mask=mask)  # (B, N, E)
            shift, scale = self.final_modulation(cond)  # each (B, 1, E)
            x = modulate(layer_norm_without_affine(x, self.config.norm_eps), shift, scale)
        elif self.config.conditioning == "in_context":
            x = self._in_context(x, cond, context, mask)
        else:
            x = x + cond.unsqueeze(1)  # (B, N, E): the noise level, added to every token
            for block in self.blocks:
                x = block(x, context, memory_mask=mask, causal=False)  # (B, N, E)
            x = self.final_norm(x)
        patches = self.head(x)  # (B, N, C * P * P)
        P, size = self.config.patch_size, self.config.image_size
        return F.fold(patches.transpose(1, 2), (size, size), kernel_size=P, stride=P)

    def _in_context(self, x, cond, context, mask) -> torch.Tensor:
        """[c, prompt tokens, image tokens] through the self-attention blocks, the image tokens
        kept: x (B, N, E), cond (B, E), context (B, S, E), mask (B, 1, 1, S) -> (B, N, E)."""
        B, S = context.shape[:2]
        sequence = torch.cat((cond.unsqueeze(1), context, x), dim=1)  # (B, 1 + S + N, E)
        visible = torch.ones(B, 1, 1, 1 + S + x.shape[1], dtype=torch.bool, device=x.device)
        visible[..., 1 : 1 + S] = mask  # the prompt's padding, as keys
        for block in self.blocks:
            sequence = block(sequence, mask=visible)  # (B, 1 + S + N, E)
        return self.final_norm(sequence[:, 1 + S :])  # (B, N, E)


def _denoiser_block(config: DiffusionConfig) -> nn.Module:
    """One block: adaLN-Zero (Peebles & Xie 2023, s3.2), or plain pre-norm (Xiong et al. 2020)
    self-attention, cross-attention (not in context) and FFN."""
    sizes = (config.embed_dim, config.num_heads, config.ffn_dim)
    if config.conditioning == "adaln_zero":
        return AdaLNZeroBlock(*sizes, activation=config.activation, dropout=config.dropout,
                              eps=config.norm_eps)  # fmt: skip
    if config.conditioning == "in_context":
        return EncoderBlock(*sizes, activation=config.activation, dropout=config.dropout,
                            norm_first=True, eps=config.norm_eps)  # fmt: skip
    return DecoderBlock(*sizes, activation=config.activation, dropout=config.dropout,
                        norm_first=True, eps=config.norm_eps)  # fmt: skip


def classifier_free_guidance(
    eps_cond: torch.Tensor, eps_uncond: torch.Tensor, scale: float
) -> torch.Tensor:
    """eps_u + s (eps_c - eps_u) (Ho & Salimans 2022, eq. 6, with s = 1 + w).

    Computed as (1 - s) eps_u + s eps_c, the same line, which gives eps_u at s = 0 and eps_c at
    s = 1 exactly (no rounding of eps_u + (eps_c - eps_u)); s > 1 moves past the conditional
    prediction, away from the unconditional one."""
    _check_scale("scale", scale)
    if eps_cond.shape != eps_uncond.shape:
        raise ValueError(f"eps_cond, eps_uncond: shapes differ, {tuple(eps_cond.shape)} and "
                         f"{tuple(eps_uncond.shape)}; expected the same")  # fmt: skip
    return (1 - scale) * eps_uncond + scale * eps_cond


def guided_noise(
    model: DiffusionTransformer,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    null_ids: torch.Tensor,
    null_mask: torch.Tensor,
    *,
    guidance: float,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A noise predictor (x_t, t) -> eps for `qkv.models.ddpm`'s samplers, guided by
    classifier-free guidance at scale `guidance`: prompt_ids/mask (B, S) the condition,
    null_ids/mask (B, S) the null prompt. At 0 only the unconditional model runs, at 1 only the
    conditional one; otherwise one forward pass over both halves of a doubled batch."""
    _check_scale("guidance", guidance)
    if null_ids.shape != prompt_ids.shape:
        raise ValueError(f"null_ids: expected the shape of prompt_ids {tuple(prompt_ids.shape)} "
                         f"(pad both alike), got {tuple(null_ids.shape)}")  # fmt: skip
    both_ids = torch.cat((prompt_ids, null_ids))  # (2B, S)
    both_mask = torch.cat((prompt_mask, null_mask))  # (2B, S)

    def predict(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if guidance == 0:
            return model(x_t, t, null_ids, null_mask)
        if guidance == 1:
            return model(x_t, t, prompt_ids, prompt_mask)
        eps = model(torch.cat((x_t, x_t)), torch.cat((t, t)), both_ids, both_mask)
        eps_cond, eps_uncond = eps.chunk(2)
        return classifier_free_guidance(eps_cond, eps_uncond, guidance)

    return predict


def _check_scale(name: str, scale: object) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
        raise ValueError(f"{name}: expected a number >= 0, got {scale!r}")


@contextmanager
def recording_cross_attention(
    model: DiffusionTransformer, recorded: list[list[torch.Tensor]]
) -> Iterator[None]:
    """While inside, each forward pass of `model` appends one list to `recorded`: every
    block's cross-attention weights (B, H, N, S), first block first, the softmax(QK^T / sqrt(D))
    of Vaswani et al. 2017 s3.2.1 over the prompt's tokens, padding masked (detached)."""
    if model.config.conditioning == "in_context":
        raise ValueError("model: its conditioning is 'in_context', which has no cross-attention "
                         "(the prompt's tokens are in the self-attention's sequence)")  # fmt: skip
    layers = [block.cross_attn for block in model.blocks]
    handles = [layer.register_attention_hook(_append_weights(recorded, index, len(layers)))
               for index, layer in enumerate(layers)]  # fmt: skip
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _append_weights(recorded: list[list[torch.Tensor]], index: int, count: int):
    def hook(module: MultiHeadAttention, q, k, *, mask, causal, window, bias, cross, pattern):
        with torch.no_grad():
            _, weights = attention(q, k, k, mask=mask, bias=bias, return_weights=True)
        if index == 0:
            recorded.append([])
        recorded[-1].append(weights)  # (B, H, N, S)
        assert len(recorded[-1]) <= count

    return hook


register_model_class(DiffusionTransformer, DiffusionConfig)
