"""Positional information for attention: RoPE, ALiBi and absolute encodings.

- Absolute, added to the token embeddings: `sinusoidal_table` / `SinusoidalPositionalEncoding`
  (Vaswani et al. 2017) and `LearnedPositionalEmbedding` (BERT, GPT-2); over a grid of image
  patches, `sinusoidal_2d_table` / `Sinusoidal2DPositionalEncoding` (half the channels per axis).
- Relative, inside attention: RoPE rotates queries and keys (`rope_cos_sin`, `apply_rope`,
  `RotaryEmbedding`; Su et al. 2021; `RopeScaling` stretches it past the training context),
  ALiBi biases the scores (`alibi_slopes`, `alibi_bias`; Press et al. 2022), passed to
  `qkv.attention(..., bias=alibi_bias(...))`; T5's bucketed bias (`T5RelativeBias`, Raffel et
  al. 2020) and Shaw et al.'s relative keys (`ShawRelativeKeys`, 2018), as a bias or a
  `score_mod` (qkv.positional.relative).
"""

from qkv.positional.alibi import alibi_bias, alibi_slopes
from qkv.positional.learned import LearnedPositionalEmbedding
from qkv.positional.relative import ShawRelativeKeys, T5RelativeBias, t5_relative_bucket
from qkv.positional.rope_layout import half_split_to_interleaved, interleaved_to_half_split
from qkv.positional.rope_scaling import ROPE_SCALING_KINDS, RopeScaling
from qkv.positional.rotary import RotaryEmbedding, apply_rope, rope_cos_sin
from qkv.positional.sinusoidal import SinusoidalPositionalEncoding, sinusoidal_table
from qkv.positional.sinusoidal2d import Sinusoidal2DPositionalEncoding, sinusoidal_2d_table

__all__ = [
    "LearnedPositionalEmbedding",
    "ROPE_SCALING_KINDS",
    "RopeScaling",
    "RotaryEmbedding",
    "ShawRelativeKeys",
    "Sinusoidal2DPositionalEncoding",
    "SinusoidalPositionalEncoding",
    "T5RelativeBias",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "half_split_to_interleaved",
    "interleaved_to_half_split",
    "rope_cos_sin",
    "sinusoidal_2d_table",
    "sinusoidal_table",
    "t5_relative_bucket",
]
