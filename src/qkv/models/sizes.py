"""How much memory a model's config asks for, known before a single tensor is allocated.

A config read from a file decides how much is allocated: `num_layers=10**9` in a config.json
would grow memory for minutes until the allocator gives up. `check_model_fits(config)` runs
first in every model constructor: it counts the parameters of the config from formulas (the
shapes the constructors build, with tied matrices counted once, as `qkv.analysis.cost.layout`
counts them in detail) and refuses a model that cannot fit in the memory of the device it is
built on, naming the sizes that make it so:

    num_layers=1000000000 blocks (embed_dim=32, ffn_dim=64): the GPT would need ~37,272.1 GiB
    (10,000,148,832,000 parameters), more than the 23.4 GiB of memory here; ...

Memory is the machine's physical memory (or a smaller cgroup limit) for CPU models, the GPU's
for a CUDA default device; models built on the "meta" device hold no memory and are never
refused. The check only stops the impossible: a model within memory may still leave too
little room for training (gradients and optimizer moments take two to three times more).
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.models.bert_config import BertConfig
from qkv.models.diffusion_config import DiffusionConfig
from qkv.models.encoder_decoder_config import TransformerConfig
from qkv.models.gpt_config import GPTConfig
from qkv.models.t5_config import T5Config, t5_parameter_count
from qkv.models.vit_config import ViTConfig

__all__ = [
    "FALLBACK_MEMORY_BYTES",
    "LABEL_NAME_BYTES",
    "SizePart",
    "can_size",
    "check_model_fits",
    "config_of",
    "memory_bytes",
    "model_bytes",
    "parameter_count",
    "size_parts",
]

logger = logging.getLogger(__name__)

GIB = 2**30
# When the machine does not say how much memory it has: more than any single host of today.
FALLBACK_MEMORY_BYTES = 2**40
# The Python objects of one block (about 13 modules, their parameters, dicts and hooks) take
# 24-40 KiB on CPython 3.12, whatever the widths: a lower bound, so that a billion tiny blocks
# count for what they cost.
BLOCK_OBJECT_BYTES = 16 * 1024
# A default label name ("LABEL_12345", a str in a list): ~60 bytes on CPython.
LABEL_NAME_BYTES = 56
_CGROUP_LIMITS = (  # cgroup v2, then v1: a container may hold less than the machine
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


_CAPTURING = contextvars.ContextVar("capturing_model_config", default=False)


class _ConfigCaptured(Exception):  # noqa: N818 (a signal, not an error)
    def __init__(self, config: object) -> None:
        super().__init__("config captured")
        self.config = config


@dataclass(frozen=True)
class SizePart:
    """One part of a model: what it is (with the config fields that size it), its parameters,
    and the bytes it takes besides them (buffers, Python objects)."""

    what: str
    parameters: int
    extra_bytes: int = 0


def size_parts(config: object) -> list[SizePart]:
    """The parts of the model a `GPTConfig`, `BertConfig`, `TransformerConfig`, `T5Config`,
    `ViTConfig` or `DiffusionConfig` builds."""
    parts = _parts_function(config)
    if parts is None:
        raise TypeError(
            f"config: expected a GPTConfig, BertConfig, TransformerConfig, T5Config, "
            f"ViTConfig or DiffusionConfig, got {type(config).__name__}"
        )
    return parts(config)


def can_size(config: object) -> bool:
    """Whether `size_parts` knows the model of `config` (a user's own config class: no)."""
    return _parts_function(config) is not None


def _parts_function(config: object):
    for config_class, parts in (
        (GPTConfig, _gpt_parts),
        (BertConfig, _bert_parts),
        (TransformerConfig, _transformer_parts),
        (T5Config, _t5_parts),
        (ViTConfig, _vit_parts),
        (DiffusionConfig, _diffusion_parts),
    ):
        if isinstance(config, config_class):
            return parts
    return None


def parameter_count(config: object) -> int:
    """The number of parameters of the model `config` builds (tied matrices once)."""
    return sum(part.parameters for part in size_parts(config))


def model_bytes(config: object, *, dtype: torch.dtype | None = None) -> int:
    """Bytes of the model `config` builds, its parameters of `dtype` (default: torch's default
    dtype), its buffers and the Python objects of its blocks."""
    return _bytes(size_parts(config), dtype)


def _bytes(parts: list[SizePart], dtype: torch.dtype | None = None) -> int:
    itemsize = (dtype or torch.get_default_dtype()).itemsize
    return sum(part.parameters * itemsize + part.extra_bytes for part in parts)


def check_model_fits(
    config: object, *, extra: tuple[SizePart, ...] = (), memory: int | None = None
) -> None:
    """Raise ValueError when the model of `config` (plus `extra` parts, such as a classifier)
    needs more than `memory` bytes (default: `memory_bytes()` of the default device)."""
    if _CAPTURING.get():
        raise _ConfigCaptured(config)  # `config_of`: stop the constructor here
    if memory is None:
        if torch.get_default_device().type == "meta":
            return  # shapes only: nothing is allocated
        memory = memory_bytes()
    parts = [*size_parts(config), *extra]
    needed = _bytes(parts)
    if needed <= memory:
        return
    largest = max(parts, key=lambda part: _bytes([part]))
    count = sum(part.parameters for part in parts)
    raise ValueError(
        f"{largest.what}: the model would need ~{needed / GIB:,.1f} GiB ({count:,} "
        f"parameters), more than the {memory / GIB:,.1f} GiB of memory here; expected a model "
        f"that fits"
    )


def config_of(build: Callable[[], object]) -> object | None:
    """The config that `build()` (such as a task's `build_model`) gives its model, with nothing
    built: the model's constructor stops at its first line, `check_model_fits(config)`. None
    when `build` returns without calling it (a model sized elsewhere, built on the "meta"
    device here, so that nothing is allocated either)."""
    token = _CAPTURING.set(True)
    try:
        with torch.device("meta"):
            build()
    except _ConfigCaptured as captured:
        return captured.config
    finally:
        _CAPTURING.reset(token)
    return None


def memory_bytes(device: torch.device | None = None) -> int:
    """Memory of `device` (default: torch's default device): a CUDA device's total memory,
    else the machine's physical memory or a smaller cgroup limit; FALLBACK_MEMORY_BYTES when
    the system does not tell."""
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    known = [size for size in (_physical_memory(), _cgroup_limit()) if size]
    return min(known) if known else FALLBACK_MEMORY_BYTES


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        pass
    try:
        import psutil  # optional: not a dependency of qkv
    except ImportError:
        return None
    return int(psutil.virtual_memory().total)


def _cgroup_limit() -> int | None:
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" means no limit
            return int(text)
    return None


def _gpt_parts(config) -> list[SizePart]:
    """qkv.models.GPT: token embedding (+ lm_head unless tied), learned positions, blocks."""
    E, V, F, N = config.embed_dim, config.vocab_size, config.ffn_dim, config.num_layers
    kv = config.num_kv_heads * config.head_dim
    norm = 2 * E if config.norm == "layernorm" and config.bias else E
    attention = 2 * E * E + 2 * E * kv + ((E + 2 * kv + E) if config.bias else 0)
    matrices = 3 if config.ffn == "swiglu" else 2
    ffn = matrices * E * F + (((matrices - 1) * F + E) if config.bias else 0)
    tables = 1 if config.tie_embeddings else 2
    positions, position_part = config.max_positions * E, f"max_positions={config.max_positions}"
    if config.position == "t5":
        positions, position_part = config.relative_buckets * config.num_heads, "T5 buckets"
    elif config.position != "learned":
        positions = 0
    return [
        SizePart(f"vocab_size={V} token embedding (embed_dim={E})", tables * V * E),
        SizePart(f"{position_part} position parameters", positions),
        SizePart(
            f"num_layers={N} blocks (embed_dim={E}, ffn_dim={F})",
            N * (attention + ffn + 2 * norm) + norm,
            N * BLOCK_OBJECT_BYTES,
        ),
    ]


def _diffusion_parts(config) -> list[SizePart]:
    """qkv.models.DiffusionTransformer, from above (a bound, up to 2x, not a count: each
    block as adaLN-Zero's, whose attention, cross-attention, FFN and modulation take at most
    17 E^2 + 2 E F + 32 E + F): the prompt's tables and encoder blocks, the denoiser blocks,
    the time MLP, final modulation and head, and the T-step schedule and time table."""
    E, F, T = config.embed_dim, config.ffn_dim, config.num_timesteps
    block = 17 * E * E + 2 * E * F + 32 * E + F
    text_block = 4 * E * E + 2 * E * F + 9 * E + F
    patches = config.num_patches * E + config.channels * config.patch_size**2 * (E + 1)
    return [
        SizePart(
            f"vocab_size={config.vocab_size} prompt table (embed_dim={E})",
            (config.vocab_size + config.max_prompt_length) * E + patches + 5 * E * E + 8 * E,
        ),
        SizePart(
            f"text_layers={config.text_layers} prompt blocks (embed_dim={E}, ffn_dim={F})",
            config.text_layers * text_block,
            config.text_layers * BLOCK_OBJECT_BYTES,
        ),  # fmt: skip
        SizePart(
            f"num_layers={config.num_layers} blocks (embed_dim={E}, ffn_dim={F})",
            config.num_layers * block,
            config.num_layers * BLOCK_OBJECT_BYTES,
        ),  # fmt: skip
        SizePart(f"num_timesteps={T} schedule and time table", 0, 8 * T * (E + 16)),
    ]


def _bert_parts(config) -> list[SizePart]:
    """qkv.models.BertModel: three embedding tables and their norm, blocks, pooler."""
    E, F, N = config.embed_dim, config.ffn_dim, config.num_layers
    blocks = 1 if config.share_layers else N
    block = 4 * E * E + 4 * E + 2 * E * F + F + E + 4 * E
    return [
        SizePart(f"vocab_size={config.vocab_size} token embedding (embed_dim={E})",
                 config.vocab_size * E),
        SizePart(f"max_positions={config.max_positions} learned positions",
                 (config.max_positions + config.type_vocab_size) * E + 2 * E),
        SizePart(f"num_layers={N} blocks (embed_dim={E}, ffn_dim={F})",
                 blocks * block + E * E + E, blocks * BLOCK_OBJECT_BYTES),
    ]  # fmt: skip


def _transformer_parts(config) -> list[SizePart]:
    """qkv.models.Transformer: embeddings (one when shared), the sinusoid table (a float32
    buffer), encoder and decoder blocks with their final norms, lm_head unless tied."""
    E, F = config.embed_dim, config.ffn_dim
    V_src, V_tgt = config.src_vocab_size, config.tgt_vocab_size
    attention, ffn = 4 * E * E + 4 * E, 2 * E * F + F + E
    tables = V_src * E + (0 if config.share_embeddings else V_tgt * E)
    tables += 0 if config.tie_output else V_tgt * E
    N_enc, N_dec = config.num_encoder_layers, config.num_decoder_layers
    sizes = f"embed_dim={E}, ffn_dim={F}"
    return [
        SizePart(f"src_vocab_size={V_src}, tgt_vocab_size={V_tgt} embeddings (embed_dim={E})",
                 tables),
        SizePart(f"max_positions={config.max_positions} sinusoid table (embed_dim={E})", 0,
                 config.max_positions * E * 4),
        SizePart(f"num_encoder_layers={N_enc} encoder blocks ({sizes})",
                 N_enc * (attention + ffn + 4 * E) + 2 * E, N_enc * BLOCK_OBJECT_BYTES),
        SizePart(f"num_decoder_layers={N_dec} decoder blocks ({sizes})",
                 N_dec * (2 * attention + ffn + 6 * E) + 2 * E, N_dec * BLOCK_OBJECT_BYTES),
    ]  # fmt: skip


def _t5_parts(config) -> list[SizePart]:
    """qkv.models.T5Transformer, counted whole (`t5_parameter_count`)."""
    what = (
        f"vocab_size={config.vocab_size}, d_model={config.d_model}, d_ff={config.d_ff}, "
        f"num_layers={config.num_layers} + {config.num_decoder_layers} T5"
    )
    return [SizePart(what, t5_parameter_count(config))]


def _vit_parts(config) -> list[SizePart]:
    """qkv.models.ViT: the patch projection, the [class] token and positions (a float32
    buffer when sinusoidal), pre-norm blocks and the final norm, latent pooling and the head."""
    E, F, N, C = config.embed_dim, config.ffn_dim, config.num_layers, config.num_classes
    block = 4 * E * E + 4 * E + 2 * E * F + F + E + 4 * E
    learned = config.position == "learned"
    positions = config.num_tokens * E if learned else 0
    table = 0 if learned else config.num_patches * E * 4
    latent = 0
    if config.pooling == "latent":  # latents, cross-attention, FFN, 4 norms, latent blocks
        latent = config.num_latents * E + block + 2 * E * 2 + config.latent_blocks * block
    cls = E if config.pooling == "cls" else 0
    patch_dim = config.channels * config.patch_size**2
    return [
        SizePart(f"image_size={config.image_size}, patch_size={config.patch_size} patch "
                 f"embedding (embed_dim={E})", patch_dim * E + E + cls + positions, table),
        SizePart(f"num_layers={N} blocks (embed_dim={E}, ffn_dim={F})",
                 N * block + 2 * E, N * BLOCK_OBJECT_BYTES),
        SizePart(f"num_classes={C} head ({config.pooling} pooling)", latent + E * C + C),
    ]  # fmt: skip
