"""The `diffusion` task: a text-conditioned DDPM learns the 8x8 digits from their prompts.

Each training digit (`qkv.data.digit_splits`, the vit task's split) is scaled to [-1, 1] and
paired with one phrasing of its label ("a handwritten seven", "number 7", ...;
`qkv.data.prompts`), tokenised by a WordPiece tokenizer trained on those phrasings. A step
draws, for each image, a timestep t uniform in [0, T), Gaussian noise, and with probability
condition_dropout swaps its prompt for the null prompt "" (classifier-free guidance, Ho &
Salimans 2022, s3.2: one model learns the conditional and the unconditional noise). The model,
`qkv.models.DiffusionTransformer`, predicts the noise of x_t = sqrt(alpha_bar_t) x_0 +
sqrt(1 - alpha_bar_t) eps, and the loss is the squared error per pixel (Ho et al. 2020, eq.
14, L_simple), averaged over each image's pixels and summed over the images.

Every draw of an example is a pure function of (data_seed, step, the example's index), so a
resumed run, or the same batch split over micro-batches or processes, draws the same ones.
Evaluation reports the loss on the validation digits, with their prompts and with the null
prompt, at timesteps and noise fixed by data_seed: the gap is what the prompt tells the model.

`sample_digits` turns prompts into images with the trained model: DDPM ancestral sampling
(Ho et al. 2020, Algorithm 2) or DDIM (Song et al. 2021), guided at a chosen scale.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from tokenizers import Tokenizer

from qkv.data import digit_splits
from qkv.data.prompts import (
    NULL_PROMPT,
    digit_prompts,
    encode_prompts,
    train_prompt_tokenizer,
)
from qkv.data.tokenizers import load_tokenizer, save_tokenizer
from qkv.models import DiffusionConfig, DiffusionTransformer, DiffusionUNet, load, save
from qkv.models.ddpm import ddim_sample, ddpm_sample, q_sample
from qkv.models.diffusion import guided_noise
from qkv.models.diffusion_config import CONDITIONING_KINDS
from qkv.models.diffusion_prompt import PromptDenoiser
from qkv.validation import check_choice, check_probability

__all__ = ["SAMPLERS", "DiffusionOptions", "DiffusionTask", "load_sampler", "sample_digits"]

DENOISERS = ("transformer", "unet")

TASK_FILE = "task.json"
TOKENIZER_FILE = "tokenizer.json"
SAMPLERS = ("ddpm", "ddim")
_EVAL_BATCH = 512
_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DiffusionOptions:
    """Data, model and noise schedule of the diffusion task (`qkv train diffusion --help`)."""

    patch_size: int = 2
    embed_dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 256
    text_layers: int = 0  # 0: the prompt's embeddings alone, each key one word's own
    conditioning: str = "adaln_zero"  # "adaln_zero", "add" or "in_context"
    denoiser: str = "transformer"  # "transformer" (the DiT) or "unet" (conditioning "add")
    condition_dropout: float = 0.1  # share of prompts replaced by the null prompt
    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    dropout: float = 0.0
    valid_fraction: float = 0.1
    test_fraction: float = 0.2
    data_seed: int = 0  # the data split, and every draw of timesteps, noise and prompts

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "patch_size": "side of the square patches the 8x8 digits are cut into",
        "num_layers": "denoiser blocks",
        "text_layers": "encoder blocks over the prompt's tokens (0: cross-attention reads the "
        "token and position embeddings, each key one word's own)",
        "conditioning": "how the timestep enters: 'adaln_zero' (shift, scale and gate of every "
        "sub-layer, DiT), 'add' (added to the image tokens) or 'in_context' (it and the prompt "
        "as tokens before the image tokens, no cross-attention)",
        "denoiser": "the noise predictor's body: 'transformer' (DiT, over patches) or 'unet' "
        "(convolutions at two resolutions with self- and cross-attention; needs --conditioning "
        "add)",
        "condition_dropout": "share of training prompts replaced by the null prompt "
        "(classifier-free guidance)",
        "num_timesteps": "diffusion steps T",
        "beta_start": "the first beta of the linear schedule",
        "beta_end": "the last beta of the linear schedule",
        "valid_fraction": "share of each digit held out for validation",
        "test_fraction": "share of each digit held out (the vit task's test digits)",
        "data_seed": "seed of the data split and of the timesteps, noise and prompts drawn",
    }


class DiffusionTask:
    """Digits, prompts, tokenizer and model of the diffusion task; see the module docstring."""

    name = "diffusion"
    # `qkv train diffusion` defaults: recognisable digits in a few CPU minutes
    training_defaults = {
        "steps": 3000, "batch_size": 64, "learning_rate": 2e-3, "schedule": "cosine",
        "weight_decay": 0.0, "warmup_fraction": 0.05,
    }  # fmt: skip

    def __init__(self, options: DiffusionOptions = DiffusionOptions()) -> None:
        check_choice("conditioning", options.conditioning, CONDITIONING_KINDS)
        check_choice("denoiser", options.denoiser, DENOISERS)
        if options.denoiser == "unet" and options.conditioning != "add":
            raise ValueError(
                f"conditioning: {options.conditioning!r} with denoiser 'unet'; the U-Net adds "
                "the timestep in its residual blocks and reads the prompt by cross-attention: "
                "expected 'add'"
            )
        check_probability("condition_dropout", options.condition_dropout)
        self.options = options
        self.tokenizer = train_prompt_tokenizer()
        self.config = self._config()  # checks the sizes before the data is read
        splits = digit_splits(
            valid_fraction=options.valid_fraction, test_fraction=options.test_fraction,
            seed=options.data_seed,
        )  # fmt: skip
        self.train_set, self.valid_set = splits.train, splits.valid

    def __len__(self) -> int:
        return len(self.train_set)

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.options)}

    def _config(self) -> DiffusionConfig:
        options = self.options
        return DiffusionConfig.from_name(
            "diffusion-digits", patch_size=options.patch_size, embed_dim=options.embed_dim,
            num_layers=options.num_layers, num_heads=options.num_heads,
            ffn_dim=options.ffn_dim, vocab_size=self.tokenizer.get_vocab_size(),
            text_layers=options.text_layers, conditioning=options.conditioning,
            num_timesteps=options.num_timesteps, beta_start=options.beta_start,
            beta_end=options.beta_end, dropout=options.dropout,
        )  # fmt: skip

    def build_model(self) -> PromptDenoiser:
        if self.options.denoiser == "unet":
            return DiffusionUNet(self.config)
        return DiffusionTransformer(self.config)

    def collate(self, indices: list[int], *, step: int = 0) -> dict[str, torch.Tensor]:
        """{"images" x_0 in [-1, 1] (B, 1, 8, 8), "timesteps" (B,), "noise" (B, 1, 8, 8),
        "prompt_ids" and "prompt_mask" (B, S)}: each example's draws seeded by (data_seed,
        step, its index)."""
        C, size = self.config.channels, self.config.image_size
        timesteps, noise, prompts = [], [], []
        for index in indices:
            seed = (self.options.data_seed * _SEED_STRIDE + step) * _SEED_STRIDE + index
            generator = torch.Generator().manual_seed(seed)
            timesteps.append(torch.randint(self.config.num_timesteps, (1,), generator=generator))
            noise.append(torch.randn((C, size, size), generator=generator))
            phrasings = digit_prompts(int(self.train_set.labels[index]))
            choice = int(torch.randint(len(phrasings), (1,), generator=generator))
            dropped = float(torch.rand((), generator=generator)) < self.options.condition_dropout
            prompts.append(NULL_PROMPT if dropped else phrasings[choice])
        ids, mask = encode_prompts(self.tokenizer, prompts,
                                   max_length=self.config.max_prompt_length)  # fmt: skip
        images = self.train_set.images[torch.tensor(indices, dtype=torch.long)]
        return {"images": images * 2 - 1, "timesteps": torch.cat(timesteps),
                "noise": torch.stack(noise), "prompt_ids": ids, "prompt_mask": mask}  # fmt: skip

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {"images": len(batch["images"])}

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return len(batch["images"]) * self.config.num_patches

    def loss_sums(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each image's mean squared error between the true and the predicted noise, summed
        over the images (in fp32)."""
        noisy = q_sample(model.schedule, batch["images"], batch["timesteps"], batch["noise"])
        predicted = model(noisy, batch["timesteps"], batch["prompt_ids"], batch["prompt_mask"])
        error = (predicted.float() - batch["noise"].float()) ** 2  # (B, 1, 8, 8)
        return {"images": error.flatten(1).mean(dim=1).sum()}

    @torch.no_grad()
    def evaluate(self, model: DiffusionTransformer) -> dict[str, float]:
        """The validation loss with each digit's first phrasing and with the null prompt, at
        timesteps and noise drawn once from data_seed. Call it with the model in eval mode."""
        data = self.valid_set
        generator = torch.Generator().manual_seed(self.options.data_seed)
        timesteps = torch.randint(self.config.num_timesteps, (len(data),), generator=generator)
        noise = torch.randn(data.images.shape, generator=generator)
        prompts = [digit_prompts(int(label))[0] for label in data.labels]
        images = data.images * 2 - 1
        return {
            name: _mean_loss(model, self.tokenizer, images, timesteps, noise, texts)
            for name, texts in (("valid_loss", prompts),
                                ("valid_loss_null", [NULL_PROMPT] * len(data)))
        }  # fmt: skip

    def save(self, model: DiffusionTransformer, path: str | os.PathLike) -> Path:
        """The model as a qkv checkpoint, its tokenizer.json and task.json beside it: what
        `load_sampler` (and `qkv sample --model`) reads."""
        path = save(model, path)
        save_tokenizer(self.tokenizer, path / TOKENIZER_FILE)
        (path / TASK_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path


def _mean_loss(model, tokenizer, images, timesteps, noise, texts: list[str]) -> float:
    """Mean over the images of the per-pixel squared noise error, in batches."""
    device = next(model.parameters()).device
    total = 0.0
    for start in range(0, len(images), _EVAL_BATCH):
        part = slice(start, start + _EVAL_BATCH)
        ids, mask = encode_prompts(tokenizer, texts[part])
        t = timesteps[part].to(device)
        noisy = q_sample(model.schedule, images[part].to(device), t, noise[part].to(device))
        predicted = model(noisy, t, ids.to(device), mask.to(device)).float()
        total += float(((predicted - noise[part].to(device)) ** 2).flatten(1).mean(1).sum())
    return total / max(len(images), 1)


def load_sampler(path: str | os.PathLike) -> tuple[DiffusionTransformer, Tokenizer]:
    """The model (eval mode) and tokenizer that `DiffusionTask.save` wrote to the folder `path`."""
    model = load(path)
    if not isinstance(model, PromptDenoiser):
        raise ValueError(f"path: {str(path)!r} holds a {type(model).__name__}; expected a "
                         f"DiffusionTransformer or DiffusionUNet (from qkv train "
                         f"diffusion)")  # fmt: skip
    return model, load_tokenizer(Path(path) / TOKENIZER_FILE)


@torch.no_grad()
def sample_digits(
    model: DiffusionTransformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    guidance: float,
    seed: int = 0,
    sampler: str = "ddpm",
    steps: int = 50,
    on_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """One image per prompt, (B, C, H, W) in [0, 1], from noise drawn with `seed`: sampler
    "ddpm" (Algorithm 2, all T steps) or "ddim" (eta = 0, `steps` steps), classifier-free
    guidance at scale `guidance` (0: the unconditional model, 1: the conditional one).
    on_step(x_t, t, eps): called with each step's input and guided noise prediction."""
    check_choice("sampler", sampler, SAMPLERS)
    config, device = model.config, next(model.parameters()).device
    ids, mask = encode_prompts(tokenizer, [*prompts, NULL_PROMPT],
                               max_length=config.max_prompt_length)  # fmt: skip
    ids, mask = ids.to(device), mask.to(device)
    B = len(prompts)
    guided = guided_noise(model, ids[:B], mask[:B], ids[B:].expand(B, -1),
                          mask[B:].expand(B, -1), guidance=guidance)  # fmt: skip

    def predict(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        eps = guided(x_t, t)
        if on_step is not None:
            on_step(x_t, t, eps)
        return eps

    shape = (B, config.channels, config.image_size, config.image_size)
    generator = torch.Generator().manual_seed(seed)
    common = {"generator": generator, "device": device}
    if sampler == "ddpm":
        x0 = ddpm_sample(predict, model.schedule, shape, **common)
    else:
        x0 = ddim_sample(predict, model.schedule, shape, steps=steps, **common)
    return ((x0.clamp(-1.0, 1.0) + 1) / 2).cpu()  # (B, C, H, W) in [0, 1]
