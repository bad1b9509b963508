"""`GPT`: the decoder-only language model (GPT-2, Llama, Mistral) in one code path.

    x_0 = token_embedding(input_ids) [+ position_embedding(positions)]    learned, sinusoidal
    x_l = x_{l-1} + SelfAttention_causal(norm(x_{l-1}))        pre-norm (Xiong et al. 2020)
    x_l = x_l + FFN(norm(x_l))
    logits = lm_head(final_norm(x_N))                          lm_head = token_embedding^T if tied

Causal self-attention is what makes it a language model: position i sees only positions j <= i
(the look-ahead mask), so logits[:, i] predict token i + 1 and the loss compares them with the
labels shifted by one. Which norm, which FFN and which position encoding a block uses is the
config's choice, made once by the factory functions of gpt_parts.py; the forward pass never asks
which family it runs. Keys and values may have fewer heads than queries (GQA, Ainslie et al. 2023;
MQA, Shazeer 2019), and the output head may share the token embedding matrix (weight tying,
Press & Wolf 2017).

Decoding with a KV cache feeds only the new tokens, at their absolute positions (offset by the
cached length), and attends over the cached keys too: `qkv.attention` aligns causal and window
masks bottom-right for L_q < L_k, which is exactly that case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qkv.attention.sparse import SparsePattern
from qkv.layers import MultiHeadAttention, pre_norm
from qkv.layers._dropout import make_dropout
from qkv.layers.kv_cache import LayerCache, StaticKVCache
from qkv.layers.sink_cache import SinkKVCache
from qkv.models.gpt_config import GPTConfig
from qkv.models.gpt_packed import packed_call
from qkv.models.gpt_parts import (
    make_ffn,
    make_norm,
    make_position_embedding,
    make_relative_bias,
    make_rope,
    once_per_shape,
)
from qkv.models.losses import IGNORE_INDEX, cross_entropy
from qkv.models.outputs import CausalLMOutput
from qkv.models.pretrained import PretrainedIO
from qkv.models.serialization import register_model_class
from qkv.models.sizes import check_model_fits
from qkv.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
)

__all__ = ["GPT", "GPTBlock", "GPTConfig", "make_ffn", "make_norm", "make_rope", "next_token_loss"]


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits[:, i] against labels[:, i + 1], skipping labels == -100.

    logits (B, L, V), labels (B, L): the labels are the input ids themselves (shifted here), as
    in Hugging Face's `ForCausalLMLoss`. Computed in fp32 whatever the logits' dtype; no
    labelled position gives 0 rather than NaN.

    The labels move, not the logits: slicing logits[:, :-1] would copy the largest tensor of
    the model (B * L * V), so the last position gets the label -100 instead.
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, L): target of logits[:, i]
    return cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B * L, V), a view


class GPTBlock(nn.Module):
    """One pre-norm decoder block: x + attn(attn_norm(x)), then x + ffn(ffn_norm(x)).

    Submodules: attn_norm, self_attn (`MultiHeadAttention`, causal, optional RoPE and sliding
    window), ffn_norm, ffn, and `dropout` on each residual branch (GPT-2's resid_pdrop).
    Input and output (B, L, E).
    """

    def __init__(self, config: GPTConfig, rope: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.self_attn = MultiHeadAttention(
            config.embed_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.bias,
            dropout=config.attention_dropout,
            rope=make_rope(config) if rope is None else rope,  # a shared one, or its own
            alibi=config.position == "alibi",
        )
        self.ffn_norm = make_norm(config)
        self.ffn = make_ffn(config)
        self.dropout = make_dropout(config.dropout)
        self.window = config.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        pattern: SparsePattern | None = None,
        bias=None,
    ) -> torch.Tensor:
        """x (B, L, E) -> (B, L, E). mask: a qkv key mask (B, 1, 1, L_k), True = real token.
        positions: (L,) or (B, L) for RoPE; None means 0 .. L - 1. cache: this layer's KV
        cache when decoding (x then holds only the new tokens). pattern: a sparse pattern
        (`qkv.sparse.Packed` for sequences packed along L), intersected with causal. bias: a
        score bias or a callable (L_q, L_k) -> bias (`MultiHeadAttention`'s), e.g. T5's."""

        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(
                h, mask=mask, causal=True, window=self.window, positions=positions, cache=cache,
                pattern=pattern, bias=bias,
            )  # fmt: skip

        x = pre_norm(x, attend, self.attn_norm, self.dropout)
        return pre_norm(x, self.ffn, self.ffn_norm, self.dropout)


class GPT(PretrainedIO, nn.Module):
    """Decoder-only Transformer language model: GPT-2, Llama or Mistral by its `GPTConfig`.

    Submodules: token_embedding (V, E), position_embedding (learned or sinusoidal positions,
    else None), relative_bias (T5's, shared by the layers, else None), dropout, blocks
    (num_layers `GPTBlock`s), final_norm, lm_head (E -> V, no bias; its weight
    is token_embedding.weight when config.tie_embeddings).

    Load and save Hugging Face checkpoints (GPT2LMHeadModel, LlamaForCausalLM,
    MistralForCausalLM) with `GPT.from_pretrained(path)` and `model.save_pretrained(path)`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config: expected a GPTConfig, got {type(config).__name__}")
        check_model_fits(config)  # before allocating: sizes may come from a file
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.embed_dim)
        self.position_embedding = make_position_embedding(config)
        self.relative_bias = make_relative_bias(config)
        self.dropout = make_dropout(config.dropout)
        rope = make_rope(config)  # one module, shared by the blocks
        self.blocks = nn.ModuleList(GPTBlock(config, rope) for _ in range(config.num_layers))
        self.final_norm = make_norm(config)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight  # one (V, E) matrix (weight tying)

    def reset_parameters(self) -> None:
        """GPT-2's initialisation (Radford et al. 2019, section 2.3): N(0, 0.02^2) weights,
        zero biases, and the projections that write into the residual stream (out_proj,
        down_proj) scaled by 1/sqrt(2 * num_layers) so the stream's variance does not grow
        with depth. Norms keep weight 1 and bias 0. With sinusoidal positions the token
        embeddings are N(0, 1/E) and multiplied by sqrt(E) (Vaswani et al. 2017, s3.4), so that
        they are as large as the unit sinusoids added to them."""
        std = 0.02
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, LearnedPositionalEmbedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if self.relative_bias is not None:  # T5's tables start at 0: no position preference
            nn.init.zeros_(self.relative_bias.relative_attention_bias.weight)
        if self.config.position == "sinusoidal":  # scaled by sqrt(E) in forward: unit scale
            nn.init.normal_(self.token_embedding.weight, std=self.config.embed_dim**-0.5)
        residual_std = std / (2 * self.config.num_layers) ** 0.5
        for block in self.blocks:
            nn.init.normal_(block.self_attn.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.ffn.down_proj.weight, mean=0.0, std=residual_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: StaticKVCache | SinkKVCache | None = None,
        *,
        logits_to_keep: int | None = None,
        check_ids: bool = True,
        sequence_lengths: Sequence[int] | None = None,
    ) -> CausalLMOutput:
        """Next-token logits for every position.

        input_ids (B, L) integer token ids in [0, V). attention_mask (B, L): 1/True on real
        tokens, 0/False on padding (the polarity of `qkv.masks`); padded keys are never
        attended to. labels (B, L): token ids, shifted inside, -100 where no loss is wanted.
        position_ids (B, L) or (L,): absolute positions, default 0 .. L - 1.
        cache: a KV cache (`qkv.layers.kv_cache`) when decoding: input_ids are then only the new
        tokens, attention_mask covers the cached tokens and the new ones (B, cached + L), and
        position_ids should be given (`qkv.generate` does all of this).
        logits_to_keep: the logits of the last n positions only, (B, n, V), as transformers'
        argument of that name: decoding reads only the last position's, and the lm_head over
        a whole prompt is the model's largest matrix product. None (every position) with labels.
        check_ids: False skips what reads the inputs back to the host (a synchronisation per
        call): the check that input_ids lie in [0, V), and dropping an attention_mask with no
        padding. `qkv.generate` checks the prompt and passes False for the tokens it chose
        itself, which are in range by construction (and which a compiled step cannot read).
        sequence_lengths: several sequences packed along L without padding (their lengths sum
            to L): each attends only to itself (`qkv.sparse.Packed`: tiles across sequences
            are skipped), positions restart at 0 for each (unless position_ids are given), and
            no loss is taken on a sequence's first token predicted from the one before it.

        Returns CausalLMOutput(logits (B, L, V), loss (mean next-token cross-entropy) or None,
        last_hidden_state (B, L, E) after the final norm).
        """
        B, L = _check_input_ids(input_ids, self.config, check_ids)
        mask = _key_mask(attention_mask, B, L + (0 if cache is None else cache.length), check_ids)
        _check_labels(labels, B, L, logits_to_keep)
        _check_position_ids(position_ids, B, L)
        pattern = None
        if sequence_lengths is not None:  # several sequences along L, each on its own
            pattern, position_ids, labels = packed_call(
                sequence_lengths, L, cache, position_ids, labels, input_ids.device
            )
        x = self.token_embedding(input_ids)  # (B, L, E)
        if self.config.position == "sinusoidal":  # as large as the sinusoids (Vaswani s3.4)
            x = x * self.config.embed_dim**0.5
        # RoPE rotates at the positions; ALiBi's and T5's biases need only the keys' order
        rope_positions = position_ids if self.config.position == "rope" else None
        if self.position_embedding is not None:
            positions = (  # (L,) or (B, L)
                torch.arange(L, device=input_ids.device) if position_ids is None else position_ids
            )
            x = x + self.position_embedding(positions)  # (B, L, E): added once, here
        x = self.dropout(x)
        relative_bias = None if self.relative_bias is None else once_per_shape(self.relative_bias)
        for index, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layer(index)
            x = block(
                x, mask=mask, positions=rope_positions, cache=layer_cache, pattern=pattern,
                bias=relative_bias,
            )  # fmt: skip
        if cache is not None:
            cache.advance(L)
        hidden = self.final_norm(x)  # (B, L, E)
        kept = hidden if logits_to_keep is None else hidden[:, -logits_to_keep:]  # (B, n, E)
        logits = self.lm_head(kept)  # (B, L, V), or (B, n, V)
        loss = None if labels is None else next_token_loss(logits, labels)
        return CausalLMOutput(logits=logits, loss=loss, last_hidden_state=hidden)


def _check_input_ids(input_ids: object, config: GPTConfig, check_values: bool) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids: expected an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids: expected shape (B, L) with L >= 1, got {tuple(input_ids.shape)}"
        )
    if check_values and input_ids.numel():
        smallest, largest = int(input_ids.min()), int(input_ids.max())
        if smallest < 0 or largest >= config.vocab_size:
            raise ValueError(
                f"input_ids: expected token ids in [0, {config.vocab_size}) (vocab_size), "
                f"got values in [{smallest}, {largest}]"
            )
    return input_ids.shape[0], input_ids.shape[1]


def _check_labels(labels: torch.Tensor | None, B: int, L: int, logits_to_keep: int | None) -> None:
    _check_same_shape("labels", labels, B, L)
    if labels is not None and (labels.is_floating_point() or labels.dtype == torch.bool):
        raise TypeError(f"labels: expected integer token ids (-100 = ignore), got {labels.dtype}")
    if logits_to_keep is None:
        return
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"logits_to_keep: expected an int >= 1 or None, got {logits_to_keep!r}")
    if logits_to_keep < 1:
        raise ValueError(f"logits_to_keep: expected an int >= 1 or None, got {logits_to_keep}")
    if labels is not None:
        raise ValueError(
            f"logits_to_keep: the loss needs the logits of every position; expected None "
            f"when labels are given, got {logits_to_keep}"
        )


def _key_mask(mask: torch.Tensor | None, B: int, L: int, read_back: bool) -> torch.Tensor | None:
    """(B, L) 1/True = real token -> a qkv key mask (B, 1, 1, L), True = may attend, or None.

    With `read_back`, an all-real mask is dropped, so that attention can take the mask-free
    causal fast path (as transformers does for SDPA): a test on the host, a synchronisation."""
    if mask is None:
        return None
    _check_same_shape("attention_mask", mask, B, L)
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"attention_mask: expected a bool or 0/1 integer tensor, got {mask.dtype}")
    keep = mask.bool()  # (B, L)
    if read_back and bool(keep.all()):
        return None
    return keep[:, None, None, :]  # (B, 1, 1, L_k): broadcast over heads and queries


def _check_same_shape(name: str, tensor: torch.Tensor | None, B: int, L: int) -> None:
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(tensor).__name__}")
    if tuple(tensor.shape) != (B, L):
        raise ValueError(
            f"{name}: expected shape (B, L) = ({B}, {L}) like input_ids, got {tuple(tensor.shape)}"
        )


def _check_position_ids(position_ids: torch.Tensor | None, B: int, L: int) -> None:
    if position_ids is None:
        return
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids: expected a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids: expected an integer tensor, got {position_ids.dtype}")
    if tuple(position_ids.shape) not in ((L,), (B, L), (1, L)):
        raise ValueError(
            f"position_ids: expected shape (L,) = ({L},) or (B, L) = ({B}, {L}), got "
            f"{tuple(position_ids.shape)}"
        )


register_model_class(GPT, GPTConfig)
