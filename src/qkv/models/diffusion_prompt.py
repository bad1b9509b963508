"""`PromptDenoiser`: what qkv's text-conditioned noise predictors eps_theta(x_t, t, prompt) share,
whatever their body (the DiT's Transformer, `qkv.models.diffusion`; the U-Net, `qkv.models.unet`).

    timestep t -> sinusoids (Vaswani et al. 2017, s3.5) -> MLP   (B, E)       the condition c
    prompt ids -> embeddings + positions -> text encoder         (B, S, E)    the context

and the noise schedule they are trained for (Ho et al. 2020). A subclass builds these parts with
`_build_conditioning` where its own construction order wants them (the order in which modules are
built is the order in which a seed initialises them), and starts its forward with `conditions`.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.layers import EncoderBlock, LayerNorm
from qkv.models.ddpm import NoiseSchedule
from qkv.models.diffusion_config import DiffusionConfig
from qkv.models.sizes import check_model_fits
from qkv.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from qkv.validation import describe

__all__ = ["PromptDenoiser"]


class PromptDenoiser(nn.Module):
    """The parts every denoiser here has: `schedule` (the `NoiseSchedule`), `time_embedding`
    (fixed sinusoids over T steps) and `time_mlp` (Linear, SiLU, Linear), `token_embedding`,
    `prompt_position_embedding`, `text_blocks` (pre-norm `EncoderBlock`s) and `text_norm`."""

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__()
        if not isinstance(config, DiffusionConfig):
            raise TypeError(f"config: expected a DiffusionConfig, got {type(config).__name__}")
        check_model_fits(config)  # before anything is allocated
        self.config = config
        self.schedule = NoiseSchedule.linear(
            config.num_timesteps, beta_start=config.beta_start, beta_end=config.beta_end
        )

    def _build_conditioning(self) -> None:
        """The timestep's embedding and the prompt's encoder, all of width E."""
        config, E = self.config, self.config.embed_dim
        self.time_embedding = SinusoidalPositionalEncoding(E, config.num_timesteps)
        self.time_mlp = nn.Sequential(nn.Linear(E, E), nn.SiLU(), nn.Linear(E, E))
        self.token_embedding = nn.Embedding(config.vocab_size, E)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        self.prompt_position_embedding = LearnedPositionalEmbedding(config.max_prompt_length, E)
        self.text_blocks = nn.ModuleList(
            EncoderBlock(E, config.num_heads, config.ffn_dim, dropout=config.dropout,
                         activation=config.activation, norm_first=True, eps=config.norm_eps)
            for _ in range(config.text_layers)
        )  # fmt: skip
        self.text_norm = LayerNorm(E, eps=config.norm_eps)

    def conditions(
        self,
        noisy_images: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mask (B, 1, 1, S) True on the prompt's tokens, context (B, S, E) the encoded
        prompt, cond (B, E) the timestep's embedding), the arguments checked."""
        B = noisy_images.shape[0]
        self.schedule.check_timesteps(timesteps, B)
        mask = self._prompt_mask(prompt_ids, prompt_mask, B)  # (B, 1, 1, S)
        context = self.encode_prompt(prompt_ids, mask)  # (B, S, E)
        return mask, context, self.time_mlp(self.time_embedding(timesteps))  # cond: (B, E)

    def encode_prompt(self, prompt_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The prompt's tokens as the cross-attention context: embeddings plus positions
        through the text blocks (padding masked as keys), then a LayerNorm: (B, S) -> (B, S, E).
        mask: (B, 1, 1, S), True on the prompt's tokens."""
        S = prompt_ids.shape[1]
        positions = torch.arange(S, device=prompt_ids.device)
        context = self.token_embedding(prompt_ids) + self.prompt_position_embedding(positions)
        for block in self.text_blocks:
            context = block(context, mask=mask)  # (B, S, E)
        return self.text_norm(context)

    def _prompt_mask(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None, batch: int
    ) -> torch.Tensor:
        """The prompt's key mask (B, 1, 1, S), True on its tokens; checks the ids."""
        if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids: expected shape (B, S), got {describe(prompt_ids)}")
        B, S = prompt_ids.shape
        if batch != B or prompt_ids.is_floating_point():
            raise ValueError(f"prompt_ids: expected ({batch}, S) token ids, got "
                             f"{describe(prompt_ids)}")  # fmt: skip
        if not 0 < S <= self.config.max_prompt_length:
            raise ValueError(f"prompt_ids: {S} tokens; expected 1 to max_prompt_length="
                             f"{self.config.max_prompt_length}")  # fmt: skip
        if prompt_mask is None:
            return torch.ones(B, 1, 1, S, dtype=torch.bool, device=prompt_ids.device)
        if not isinstance(prompt_mask, torch.Tensor) or prompt_mask.shape != (B, S):
            raise ValueError(f"prompt_mask: expected shape ({B}, {S}) like prompt_ids, got "
                             f"{describe(prompt_mask)}")  # fmt: skip
        mask = prompt_mask.bool()
        if B and not bool(mask.any(dim=1).all()):
            raise ValueError("prompt_mask: a row masks every token; expected at least one")
        return mask[:, None, None, :]  # (B, 1, 1, S)
