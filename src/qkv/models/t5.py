"""T5, the Text-to-Text Transfer Transformer (Raffel et al. 2020), as qkv modules.

    input ids  -> embedding -> dropout -> N x T5Block -> RMSNorm -> dropout = memory
    target ids -> embedding -> dropout -> N x T5Block(memory) -> RMSNorm -> dropout
               -> (x d_model ** -0.5 when the output layer is the embedding) -> lm_head -> logits

What T5 changes in the encoder-decoder of Vaswani et al. 2017 (Raffel et al. 2020, s2.1):
- every sub-layer is pre-norm, x + dropout(f(norm(x))), with a scale-only norm (RMSNorm: no
  mean subtraction, no bias), and no projection has a bias;
- no position embeddings: each self-attention adds a learned scalar per head and bucket of the
  key-minus-query offset to its scores (`qkv.positional.T5RelativeBias`). Each stack has one
  table, evaluated once per call and shared by all its layers: bidirectional buckets in the
  encoder, causal ones in the decoder; cross-attention has no position bias;
- the scores are not divided by sqrt(D): the initialisation of the query projection absorbs it;
- one embedding matrix, unscaled, serves the encoder and the decoder (and is the output layer
  when `tie_word_embeddings`; T5 v1.1 unties it and uses a gated-GELU FFN).

Decoding with a cache (`decode(..., cache=new_decoder_cache(...))`) feeds only the new target
tokens: their self-attention keys and values join a `DecoderCache`, the cross-attention keys and
values of the memory are projected once, and the relative bias of the new queries uses their
true offsets to every cached key (T5RelativeBias aligns queries bottom-right).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.attention import attention
from qkv.layers._dropout import make_dropout
from qkv.layers.feedforward import ACTIVATIONS, FeedForward
from qkv.layers.kv_cache import CrossAttentionCache, LayerCache
from qkv.layers.norms import RMSNorm
from qkv.layers.residual import pre_norm
from qkv.models._inputs import check_ids, key_mask
from qkv.models.decoder_cache import DecoderCache
from qkv.models.encoder_decoder import decode_masks, teacher_forcing_inputs
from qkv.models.losses import sequence_cross_entropy
from qkv.models.outputs import Seq2SeqOutput
from qkv.models.pretrained import PretrainedIO
from qkv.models.serialization import register_model_class
from qkv.models.sizes import check_model_fits
from qkv.models.t5_config import T5_PRESETS, T5Config
from qkv.positional import T5RelativeBias
from qkv.validation import check_positive_int, check_probability

__all__ = [
    "T5_PRESETS",
    "GatedGeluFeedForward",
    "T5Attention",
    "T5Block",
    "T5Config",
    "T5Stack",
    "T5Transformer",
]


class T5Attention(nn.Module):
    """softmax(Q K^T + bias) V over H heads of size D, with unscaled scores (Raffel et al.
    2020): projections without biases, q_proj/k_proj/v_proj (E -> H * D), out_proj (H * D -> E).

    Self-attention reads x; cross-attention reads keys and values from `context`. The attention
    is `qkv.attention` with scale=1.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, head_dim: int, *, dropout: float = 0.0
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        check_positive_int("head_dim", head_dim)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.num_kv_heads = num_heads  # what a DecoderCache sizes its keys and values by
        self.dropout = check_probability("dropout", dropout)
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=False)
        self.k_proj = nn.Linear(embed_dim, inner, bias=False)
        self.v_proj = nn.Linear(embed_dim, inner, bias=False)
        self.out_proj = nn.Linear(inner, embed_dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        bias: torch.Tensor | None = None,
        cache: LayerCache | CrossAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, L_q, E) -> (B, L_q, E). mask: a qkv key mask (B, 1, 1, L_k), True = real.
        bias: (1, H, L_q, L_k) scores added before the softmax. cache: a `LayerCache` (the new
        keys and values are written, all cached ones attended to) or a `CrossAttentionCache`
        (the context's keys and values are projected once)."""
        B, L_q, _ = x.shape
        source = x if context is None else context
        q = self._split_heads(self.q_proj(x))  # (B, H, L_q, D)

        def project_keys_values() -> tuple[torch.Tensor, torch.Tensor]:
            return self._split_heads(self.k_proj(source)), self._split_heads(self.v_proj(source))

        if isinstance(cache, CrossAttentionCache):
            k, v = cache.keys_values(project_keys_values)  # (B, H, L_k, D) each
        elif cache is not None:
            q, k, v = cache.attend_inputs(q, *project_keys_values(), None, None)
        else:
            k, v = project_keys_values()
        output = attention(
            q, k, v, mask=mask, causal=causal, bias=bias, scale=1.0,
            dropout_p=self.dropout if self.training else 0.0,
        )  # fmt: skip
        output = output.transpose(1, 2).reshape(B, L_q, -1)  # (B, L_q, H * D): concat heads
        return self.out_proj(output)  # (B, L_q, E)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)


class GatedGeluFeedForward(nn.Module):
    """down_proj(dropout(gelu(gate_proj(x)) * up_proj(x))): GEGLU (Shazeer 2020), the FFN of
    T5 v1.1, GELU in its tanh approximation. No biases. (..., E) -> (..., d_ff) -> (..., E)."""

    def __init__(self, embed_dim: int, hidden_dim: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.dropout = make_dropout(dropout)
        self.down_proj = nn.Linear(hidden_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = ACTIVATIONS["gelu_tanh"](self.gate_proj(x)) * self.up_proj(x)  # (..., d_ff)
        return self.down_proj(self.dropout(hidden))  # (..., E)


class T5Block(nn.Module):
    """One T5 layer of pre-norm sub-layers x + dropout(f(norm(x))) (Raffel et al. 2020, s2.1):
    self-attention, cross-attention over the encoder's output (decoder blocks), then the FFN.

    Submodules: attn_norm, self_attn, cross_norm and cross_attn (None in the encoder),
    ffn_norm, ffn, and `dropout` on each sub-layer's output.
    """

    def __init__(
        self,
        *,
        attn_norm: RMSNorm,
        self_attn: T5Attention,
        ffn_norm: RMSNorm,
        ffn: nn.Module,
        dropout: nn.Module,
        cross_norm: RMSNorm | None = None,
        cross_attn: T5Attention | None = None,
    ) -> None:
        super().__init__()
        if (cross_norm is None) != (cross_attn is None):
            raise ValueError("cross_norm, cross_attn: expected both (a decoder block) or neither")
        self.attn_norm, self.self_attn = attn_norm, self_attn
        self.cross_norm, self.cross_attn = cross_norm, cross_attn
        self.ffn_norm, self.ffn = ffn_norm, ffn
        self.dropout = dropout

    def forward(
        self,
        x: torch.Tensor,
        *,
        bias: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        self_cache: LayerCache | None = None,
        cross_cache: CrossAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) -> (B, L, E); bias: the stack's relative bias (1, H, L, L_k)."""

        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, mask=mask, causal=causal, bias=bias, cache=self_cache)

        def attend_memory(h: torch.Tensor) -> torch.Tensor:
            return self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache)

        x = pre_norm(x, attend, self.attn_norm, self.dropout)
        if self.cross_attn is not None:
            x = pre_norm(x, attend_memory, self.cross_norm, self.dropout)
        return pre_norm(x, self.ffn, self.ffn_norm, self.dropout)


class T5Stack(nn.Module):
    """dropout -> blocks -> final_norm -> dropout, with one `relative_bias` for all the blocks.

    The stack is causal (a decoder) when its relative bias is (bidirectional=False).
    """

    def __init__(
        self,
        blocks: list[T5Block],
        *,
        relative_bias: T5RelativeBias,
        final_norm: RMSNorm,
        dropout: nn.Module,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.relative_bias = relative_bias
        self.final_norm = final_norm
        self.dropout = dropout
        self.causal = not relative_bias.bidirectional

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) embedded tokens -> (B, L, E). mask: key mask (B, 1, 1, L_k) over every
        key attended to (cached ones included); memory (B, L_src, E) and its memory_mask for
        decoder blocks; cache: x then holds the tokens after the cache.length cached ones."""
        L = x.shape[1]
        start = 0 if cache is None else cache.length
        bias = self.relative_bias(L, start + L)  # (1, H, L, start + L): once for every layer
        x = self.dropout(x)
        for index, block in enumerate(self.blocks):
            self_cache, cross_cache = (None, None) if cache is None else cache.layer(index)
            x = block(
                x, bias=bias, mask=mask, causal=self.causal, memory=memory,
                memory_mask=memory_mask, self_cache=self_cache, cross_cache=cross_cache,
            )  # fmt: skip
        if cache is not None:
            cache.advance(L)
        return self.dropout(self.final_norm(x))


class T5Transformer(PretrainedIO, nn.Module):
    """T5 (Raffel et al. 2020) for conditional generation, built from a `T5Config`.

    Submodules: token_embedding (V, E), shared by both stacks; encoder and decoder
    (`T5Stack`s); lm_head (E -> V, no bias), whose weight IS token_embedding's when
    config.tie_word_embeddings. `from_pretrained(path)` reads a Hugging Face T5 folder.
    """

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        if not isinstance(config, T5Config):
            raise TypeError(f"config: expected a T5Config, got {type(config).__name__}")
        check_model_fits(config)  # before allocating: sizes may come from a file
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = _stack(config, config.num_layers, decoder=False)
        self.decoder = _stack(config, config.num_decoder_layers, decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids (B, L_src) -> memory (B, L_src, E). attention_mask: (B, L_src), 1/True on
        real tokens."""
        check_ids("input_ids", input_ids, vocab_size=self.config.vocab_size)
        mask = key_mask("attention_mask", attention_mask, tuple(input_ids.shape))
        return self.encoder(self.token_embedding(input_ids), mask=mask)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        *,
        memory_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """decoder_input_ids (B, L_tgt) and memory (B, L_src, E) -> logits (B, L_tgt, V).

        memory_mask: the source's (B, L_src) attention mask; decoder_attention_mask: (B, L_tgt),
        or (B, cache.length + L_tgt) with a cache, whose decoder_input_ids are then only the
        tokens after the cached ones. The logits equal those of the full prefix's decode.
        """
        check_ids("decoder_input_ids", decoder_input_ids, vocab_size=self.config.vocab_size)
        _, target_keys, memory_keys = decode_masks(
            decoder_input_ids, memory, decoder_attention_mask, memory_mask, cache
        )
        hidden = self.decoder(
            self.token_embedding(decoder_input_ids), mask=target_keys, memory=memory,
            memory_mask=memory_keys, cache=cache,
        )  # fmt: skip
        if self.config.tie_word_embeddings:  # the embedding's scale is not the logits' scale
            hidden = hidden * self.config.d_model**-0.5
        return self.lm_head(hidden)  # (B, L_tgt, V)

    def new_decoder_cache(self, batch_size: int, max_length: int) -> DecoderCache:
        """An empty `DecoderCache` for `decode(..., cache=)`: batch_size rows, up to max_length
        target tokens (the start token included)."""
        return DecoderCache.for_decoder(self.decoder, batch_size=batch_size, max_length=max_length)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> Seq2SeqOutput:
        """Teacher-forced pass: logits (B, L_tgt, V) and, with labels (B, L_tgt; -100 where
        nothing is predicted), the mean cross-entropy. Without decoder_input_ids they are the
        labels shifted right behind config.decoder_start_token_id."""
        if labels is not None:
            check_ids("labels", labels, vocab_size=self.config.vocab_size, allow_ignored=True)
        decoder_input_ids = teacher_forcing_inputs(
            decoder_input_ids, labels, start_token_id=self.config.decoder_start_token_id,
            pad_token_id=self.config.pad_token_id,
        )  # fmt: skip
        memory = self.encode(input_ids, attention_mask)
        logits = self.decode(
            decoder_input_ids, memory, memory_mask=attention_mask,
            decoder_attention_mask=decoder_attention_mask,
        )  # fmt: skip
        loss = None if labels is None else sequence_cross_entropy(logits, labels)
        return Seq2SeqOutput(logits=logits, loss=loss, encoder_last_hidden_state=memory)

    def _init_weights(self) -> None:
        """Mesh TensorFlow's initialisation, which T5 was trained with: N(0, 1) embeddings,
        N(0, 1 / fan_in) matrices, and N(0, 1 / (E * D)) queries, which stand in for the
        1/sqrt(D) the scores do not have; the relative biases N(0, 1 / E); norms 1."""
        E, D = self.config.d_model, self.config.d_kv
        nn.init.normal_(self.token_embedding.weight, std=1.0)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5)
            elif isinstance(module, T5RelativeBias):
                nn.init.normal_(module.relative_attention_bias.weight, std=E**-0.5)
        for module in self.modules():
            if isinstance(module, T5Attention):
                nn.init.normal_(module.q_proj.weight, std=(E * D) ** -0.5)


def _stack(config: T5Config, num_blocks: int, *, decoder: bool) -> T5Stack:
    relative_bias = T5RelativeBias(
        config.num_heads, bidirectional=not decoder,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )  # fmt: skip
    blocks = [_block(config, decoder=decoder) for _ in range(num_blocks)]
    return T5Stack(
        blocks, relative_bias=relative_bias, final_norm=_norm(config),
        dropout=make_dropout(config.dropout_rate),
    )  # fmt: skip


def _block(config: T5Config, *, decoder: bool) -> T5Block:
    def attention_layer() -> T5Attention:
        return T5Attention(
            config.d_model, config.num_heads, config.d_kv, dropout=config.dropout_rate
        )

    return T5Block(
        attn_norm=_norm(config),
        self_attn=attention_layer(),
        cross_norm=_norm(config) if decoder else None,
        cross_attn=attention_layer() if decoder else None,
        ffn_norm=_norm(config),
        ffn=_feed_forward(config),
        dropout=make_dropout(config.dropout_rate),
    )


def _feed_forward(config: T5Config) -> nn.Module:
    """T5's ReLU FFN or T5 v1.1's gated GELU, without biases, dropout on the hidden units."""
    E, F, p = config.d_model, config.d_ff, config.dropout_rate
    if config.feed_forward_proj == "gated-gelu":
        return GatedGeluFeedForward(E, F, dropout=p)
    return FeedForward(E, F, activation="relu", dropout=p, bias=False)


def _norm(config: T5Config) -> RMSNorm:
    return RMSNorm(config.d_model, eps=config.layer_norm_epsilon)


register_model_class(T5Transformer, T5Config)
