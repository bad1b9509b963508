"""The models, built from qkv's layers, equal to the implementations the world uses.

- `Transformer` (+ `TransformerConfig`): the encoder-decoder of "Attention Is All You Need".
- `BertModel`, `BertForPreTraining`, `BertForSequenceClassification` (+ `BertConfig`).
- `GPT` (+ `GPTConfig`): decoder-only, one code path for the GPT-2, Llama, Mistral and MQA presets.
- `T5Transformer` (+ `T5Config`): T5 and T5 v1.1, with relative position biases.
- `RNNSeq2Seq` (+ `RNNSeq2SeqConfig`): GRU encoder-decoders with a fixed context vector or
  additive (Bahdanau et al. 2015) or dot/general (Luong et al. 2015) attention.
- `ViT` (+ `ViTConfig`): the Vision Transformer, images in patches, [class]/mean/latent pooling.
- `VideoClassifier` (+ `VideoClassifierConfig`): frames in patches, joint or factorised
  space-time attention (Arnab et al. 2021, ViViT; Bertasius et al. 2021, TimeSformer).
- `DiffusionTransformer` (+ `DiffusionConfig`): a text-conditioned DDPM noise predictor over
  image patches (adaLN-Zero or additive timestep conditioning, cross-attention to the prompt);
  `qkv.models.ddpm` holds the noise schedule and the DDPM and DDIM samplers; `DiffusionUNet`,
  the same predictor with a small U-Net body (self- and cross-attention at two resolutions).

One calling convention: `model(input_ids, attention_mask=None, ...)`, the mask (B, L) with
1/True on real tokens; a small dataclass comes back (`qkv.models.outputs`).
`from_pretrained(path)` reads a local Hugging Face directory and picks the class from its
config.json; `from_gguf(path)` reads llama.cpp's GGUF files; `save(model, path)` /
`load(path)` are qkv's own safetensors + JSON checkpoints.
"""

from qkv.models.bert import BertConfig, BertModel, mean_pool
from qkv.models.bert_heads import BertForPreTraining, BertForSequenceClassification
from qkv.models.checkpoints import CheckpointError, from_pretrained, save_pretrained
from qkv.models.diffusion import DiffusionTransformer
from qkv.models.diffusion_config import DiffusionConfig
from qkv.models.encoder_decoder import Transformer, TransformerConfig, shift_right
from qkv.models.gguf import GGUFError, from_gguf
from qkv.models.gpt import GPT, GPTBlock
from qkv.models.gpt_config import GPTConfig
from qkv.models.rnn_seq2seq import RNNSeq2Seq, RNNSeq2SeqConfig
from qkv.models.serialization import load, save
from qkv.models.t5 import T5Transformer
from qkv.models.t5_config import T5Config
from qkv.models.unet import DiffusionUNet
from qkv.models.video import VideoClassifier, VideoClassifierConfig
from qkv.models.vit import ImageClassificationOutput, ViT
from qkv.models.vit_config import ViTConfig

__all__ = [
    "BertConfig",
    "BertForPreTraining",
    "BertForSequenceClassification",
    "BertModel",
    "CheckpointError",
    "DiffusionConfig",
    "DiffusionTransformer",
    "DiffusionUNet",
    "GPT",
    "GPTBlock",
    "GGUFError",
    "GPTConfig",
    "ImageClassificationOutput",
    "RNNSeq2Seq",
    "RNNSeq2SeqConfig",
    "T5Config",
    "T5Transformer",
    "Transformer",
    "TransformerConfig",
    "VideoClassifier",
    "VideoClassifierConfig",
    "ViT",
    "ViTConfig",
    "from_gguf",
    "from_pretrained",
    "load",
    "mean_pool",
    "save",
    "save_pretrained",
    "shift_right",
]
