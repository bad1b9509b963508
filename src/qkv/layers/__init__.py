"""`qkv.layers`: the modules a Transformer is built from, each on top of `qkv.attention`.

- `MultiHeadAttention`: MHA, GQA and MQA; self- and cross-attention; optional RoPE or ALiBi.
- `DifferentialAttention`: the difference of two softmax maps per head (Ye et al. 2024).
- `FeedForward` (ReLU/GELU) and `SwiGLU`: the position-wise sub-layer.
- `LayerNorm` and `RMSNorm`.
- `BatchNorm`: per-channel statistics over the batch's tokens, padding excluded on request.
- `EncoderBlock` and `DecoderBlock`: sub-layers in "Add & Norm", post-norm or pre-norm.
- `GRU` and `GRUCell` (Cho et al. 2014), and the attention of recurrent encoder-decoders:
  `AdditiveAttention` (Bahdanau et al. 2015), `DotAttention` and `GeneralAttention` (Luong
  et al. 2015).
- `PatchEmbedding`: image patches as tokens (Dosovitskiy et al. 2021), equal to a strided conv.
- `AdaLNZeroBlock`: self-attention, cross-attention and FFN gated by adaLN-Zero (Peebles &
  Xie 2023, DiT), the block of a diffusion Transformer.
- `LatentPooling`: learned queries cross-attend to a long input (the Perceiver, Jaegle et al.
  2021); one query is attention pooling.
- `FactorizedBlock` and `SpaceTimeBlock`: video tokens (B, T, N, E) attended within each frame
  then across frames, or jointly (Bertasius et al. 2021; Arnab et al. 2021).

`MultiHeadAttention` and the blocks have `from_torch` (and `MultiHeadAttention.to_torch`) to
cross over to PyTorch's own modules. Projections are plain `nn.Linear` and dropout `nn.Dropout`;
CPU speed-ups swap modules in from outside (`qkv.acceleration.speed_up`).
"""

from qkv.layers.adaln import AdaLNModulation, AdaLNZeroBlock
from qkv.layers.attention import MultiHeadAttention
from qkv.layers.batch_norm import BatchNorm
from qkv.layers.blocks import DecoderBlock, EncoderBlock
from qkv.layers.differential import DifferentialAttention
from qkv.layers.factorized_attention import FactorizedBlock, SpaceTimeBlock
from qkv.layers.feedforward import FeedForward, SwiGLU
from qkv.layers.kv_cache import CrossAttentionCache, LayerCache, StaticKVCache
from qkv.layers.latent_pooling import LatentPooling
from qkv.layers.norms import LayerNorm, RMSNorm
from qkv.layers.patch_embedding import PatchEmbedding
from qkv.layers.recurrent import GRU, GRUCell
from qkv.layers.residual import post_norm, pre_norm
from qkv.layers.rnn_attention import AdditiveAttention, DotAttention, GeneralAttention
from qkv.layers.sink_cache import SinkKVCache

__all__ = [
    "AdaLNModulation",
    "AdaLNZeroBlock",
    "AdditiveAttention",
    "BatchNorm",
    "CrossAttentionCache",
    "DecoderBlock",
    "DifferentialAttention",
    "DotAttention",
    "EncoderBlock",
    "FactorizedBlock",
    "FeedForward",
    "GRU",
    "GRUCell",
    "GeneralAttention",
    "LatentPooling",
    "LayerCache",
    "LayerNorm",
    "MultiHeadAttention",
    "PatchEmbedding",
    "RMSNorm",
    "SinkKVCache",
    "SpaceTimeBlock",
    "StaticKVCache",
    "SwiGLU",
    "post_norm",
    "pre_norm",
]
