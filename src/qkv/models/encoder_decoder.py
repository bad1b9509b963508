"""The encoder-decoder Transformer of Vaswani et al. 2017 ("Attention Is All You Need").

    source ids -> embedding * sqrt(E) + PE -> dropout -> N x EncoderBlock -> LayerNorm = memory
    target ids -> embedding * sqrt(E) + PE -> dropout -> N x DecoderBlock(memory) -> LayerNorm
              -> output projection -> logits over the target vocabulary

Training uses teacher forcing: the whole ground-truth target, shifted one position to the right
behind a start token (`shift_right`), is fed to the decoder at once, and the look-ahead (causal)
mask keeps position i from seeing the tokens after it, so all positions train in parallel. Inference
is autoregressive: `encode` once, then call `decode` on the growing prefix, one token more each
step. With a `DecoderCache` (`decode(..., cache=)`) each step feeds only the newest token: the
self-attention keys/values of the prefix are cached, and the memory's cross-attention projections
are computed once.

The blocks are `qkv.layers.EncoderBlock` / `DecoderBlock` (post-norm "Add & Norm" as in the
paper, or pre-norm with `norm_first`); `from_torch` builds the same stacks from an
`nn.Transformer`, which is how the tests prove them against PyTorch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qkv.layers import DecoderBlock, EncoderBlock, LayerNorm
from qkv.layers._dropout import make_dropout
from qkv.layers.torch_interop import copy_weight_and_bias
from qkv.models._inputs import check_ids, key_mask
from qkv.models.decoder_cache import DecoderCache
from qkv.models.encoder_decoder_config import TRANSFORMER_PRESETS, TransformerConfig
from qkv.models.losses import IGNORE_INDEX, sequence_cross_entropy
from qkv.models.outputs import Seq2SeqOutput
from qkv.models.serialization import register_model_class
from qkv.models.sizes import check_model_fits
from qkv.positional import SinusoidalPositionalEncoding
from qkv.validation import describe

__all__ = [
    "TRANSFORMER_PRESETS",
    "DecoderCache",
    "DecoderStack",
    "EncoderStack",
    "Transformer",
    "TransformerConfig",
    "decode_masks",
    "shift_right",
    "teacher_forcing_inputs",
]


def shift_right(labels: torch.Tensor, *, bos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Teacher forcing's decoder input: the labels moved one step right behind `bos_token_id`.

    labels (B, L) -> (B, L): [bos, y_0, ..., y_{L-2}]; the label -100 (ignored by the loss) becomes
    `pad_token_id`, since it is no token. For the target "a b c <eos>" the decoder input is
    "<bos> a b c".
    """
    check_ids("labels", labels, allow_ignored=True)
    shifted = labels.new_empty(labels.shape)  # (B, L)
    shifted[:, :1] = bos_token_id
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad_token_id)


def teacher_forcing_inputs(
    decoder_input_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    *,
    start_token_id: int,
    pad_token_id: int,
) -> torch.Tensor:
    """The decoder's input of a teacher-forced pass: decoder_input_ids when given, else the
    labels shifted right behind `start_token_id` (`shift_right`)."""
    if decoder_input_ids is not None:
        return decoder_input_ids
    if labels is None:
        raise ValueError(
            "decoder_input_ids: got None and labels=None; expected decoder_input_ids, "
            "or labels to shift right (teacher forcing)"
        )
    return shift_right(labels, bos_token_id=start_token_id, pad_token_id=pad_token_id)


def decode_masks(
    decoder_input_ids: torch.Tensor,
    memory: torch.Tensor,
    decoder_attention_mask: torch.Tensor | None,
    memory_mask: torch.Tensor | None,
    cache: DecoderCache | None,
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(start, target key mask, memory key mask) of a decode call: start is the position of
    the first new target token (cache.length with a cache, else 0); the target mask covers
    every target key, (B, 1, 1, start + L_tgt), the memory mask (B, 1, 1, L_src)."""
    B, L_tgt = decoder_input_ids.shape
    start = 0 if cache is None else DecoderCache.check_step(cache, B, L_tgt)
    if not isinstance(memory, torch.Tensor) or memory.dim() != 3:
        raise ValueError(f"memory: expected a (B, L_src, E) tensor, got {describe(memory)}")
    target_keys = key_mask("decoder_attention_mask", decoder_attention_mask, (B, start + L_tgt))
    memory_keys = key_mask("memory_mask", memory_mask, tuple(memory.shape[:2]))
    return start, target_keys, memory_keys


class EncoderStack(nn.Module):
    """N encoder blocks, then a final LayerNorm: (B, L_src, E) -> memory (B, L_src, E).

    The final norm is what `nn.TransformerEncoder(norm=...)` has inside `nn.Transformer`. With
    pre-norm blocks it is needed: the residual stream x + f(norm(x)) is never normalised
    otherwise, and its scale grows with depth. With the paper's post-norm blocks the last block
    already ends in a LayerNorm, so this one only adds a learned per-feature affine map; qkv keeps
    it in both cases so that an `nn.Transformer` maps onto this model weight for weight.
    """

    def __init__(self, blocks: list[EncoderBlock], norm: LayerNorm) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L_src, E); mask: a qkv key mask, e.g. (B, 1, 1, L_src), True = real token."""
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.norm(x)

    @classmethod
    def from_torch(cls, encoder: nn.TransformerEncoder) -> EncoderStack:
        """The stack of `nn.Transformer().encoder`, weights copied (batch-first)."""
        blocks = [EncoderBlock.from_torch(layer) for layer in encoder.layers]
        return cls(blocks, _norm_from_torch("encoder.norm", encoder.norm))


class DecoderStack(nn.Module):
    """N decoder blocks, then a final LayerNorm: (B, L_tgt, E) -> (B, L_tgt, E).

    The final norm exists for the reasons given in `EncoderStack`; it is also what the output
    projection reads, so in pre-norm models it sets the scale of the logits.
    """

    def __init__(self, blocks: list[DecoderBlock], norm: LayerNorm) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """x (B, L_tgt, E) attends causally to itself (the look-ahead mask) and to memory.

        mask: qkv key mask over the target, memory_mask over the memory ((B, 1, 1, L) each).
        cache: incremental decoding; x is then the new tokens only, and mask (if any) covers
        every cached target key, (B, 1, 1, cache.length + L_tgt).
        """
        for index, block in enumerate(self.blocks):
            self_cache, cross_cache = (None, None) if cache is None else cache.layer(index)
            x = block(
                x,
                memory,
                mask=mask,
                memory_mask=memory_mask,
                causal=True,
                self_cache=self_cache,
                cross_cache=cross_cache,
            )
        if cache is not None:
            cache.advance(x.shape[1])
        return self.norm(x)

    @classmethod
    def from_torch(cls, decoder: nn.TransformerDecoder) -> DecoderStack:
        """The stack of `nn.Transformer().decoder`, weights copied (batch-first)."""
        blocks = [DecoderBlock.from_torch(layer) for layer in decoder.layers]
        return cls(blocks, _norm_from_torch("decoder.norm", decoder.norm))


class Transformer(nn.Module):
    """The encoder-decoder Transformer (Vaswani et al. 2017), built from a config.

    Submodules: source_embedding and target_embedding (nn.Embedding; one module when
    `share_embeddings`), positions (sinusoidal), embedding_dropout, encoder (`EncoderStack`),
    decoder (`DecoderStack`) and lm_head (E -> V_tgt, no bias; its weight IS the target
    embedding's when `tie_output`, Press & Wolf 2017).

    Embeddings are multiplied by sqrt(E) before the positions are added (section 3.4): they are
    initialised with std E^-1/2, as fairseq does for tied embeddings, so the scaled embedding has
    unit scale, like the sinusoids it is summed with.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config: expected a TransformerConfig, got {type(config).__name__}")
        check_model_fits(config)  # before allocating: sizes may come from a file
        self.config = config
        E, pad = config.embed_dim, config.pad_token_id
        self.embedding_scale = math.sqrt(E)
        self.source_embedding = nn.Embedding(config.src_vocab_size, E, padding_idx=pad)
        self.target_embedding = (
            self.source_embedding
            if config.share_embeddings
            else nn.Embedding(config.tgt_vocab_size, E, padding_idx=pad)
        )
        self.positions = SinusoidalPositionalEncoding(E, config.max_positions)
        self.embedding_dropout = make_dropout(config.dropout)
        self.encoder = EncoderStack(_encoder_blocks(config), LayerNorm(E))
        self.decoder = DecoderStack(_decoder_blocks(config), LayerNorm(E))
        self.lm_head = nn.Linear(E, config.tgt_vocab_size, bias=False)
        self._init_weights()
        if config.tie_output:
            self.lm_head.weight = self.target_embedding.weight

    def embed_source(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Source ids (B, L) -> dropout(embedding * sqrt(E) + PE): (B, L, E)."""
        check_ids("input_ids", input_ids, vocab_size=self.config.src_vocab_size)
        return self._embed(input_ids, self.source_embedding)

    def embed_target(self, decoder_input_ids: torch.Tensor, *, start: int = 0) -> torch.Tensor:
        """Target ids (B, L) at positions start .. start + L - 1 -> dropout(embedding * sqrt(E)
        + PE): (B, L, E). `start` > 0 embeds the new tokens of an incremental decoding step."""
        check_ids("decoder_input_ids", decoder_input_ids, vocab_size=self.config.tgt_vocab_size)
        return self._embed(decoder_input_ids, self.target_embedding, start=start)

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Source ids (B, L_src) -> memory (B, L_src, E). attention_mask: (B, L_src), 1/True on
        real tokens (padding keys are not attended to)."""
        mask = key_mask("attention_mask", attention_mask, tuple(input_ids.shape))
        return self.encoder(self.embed_source(input_ids), mask=mask)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        *,
        memory_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Target ids (B, L_tgt) and memory (B, L_src, E) -> logits (B, L_tgt, V_tgt).

        memory_mask: the source's (B, L_src) attention mask; decoder_attention_mask: (B, L_tgt).
        Both 1/True on real tokens. The look-ahead mask is always applied.

        cache (autoregressive inference): a `DecoderCache` (`new_decoder_cache`);
        decoder_input_ids then holds only the tokens after the `cache.length` already decoded,
        at positions cache.length onwards, and decoder_attention_mask, if given, covers all of
        them: (B, cache.length + L_tgt). The logits equal those of the full prefix's decode.
        """
        check_ids("decoder_input_ids", decoder_input_ids)  # the shape; embed_target the values
        start, target_keys, memory_keys = decode_masks(
            decoder_input_ids, memory, decoder_attention_mask, memory_mask, cache
        )
        x = self.embed_target(decoder_input_ids, start=start)
        hidden = self.decoder(x, memory, mask=target_keys, memory_mask=memory_keys, cache=cache)
        return self.lm_head(hidden)  # (B, L_tgt, V_tgt)

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
        """Teacher-forced pass: logits for every target position, and the loss if labels given.

        Without decoder_input_ids they are `shift_right(labels)`. labels (B, L_tgt) hold the
        next token at each position, -100 where nothing is predicted (padding). loss: the
        label-smoothed cross-entropy over the labelled positions (section 5.4).
        """
        if labels is not None:
            check_ids("labels", labels, vocab_size=self.config.tgt_vocab_size, allow_ignored=True)
        decoder_input_ids = teacher_forcing_inputs(
            decoder_input_ids, labels, start_token_id=self.config.bos_token_id,
            pad_token_id=self.config.pad_token_id,
        )  # fmt: skip
        memory = self.encode(input_ids, attention_mask)
        logits = self.decode(
            decoder_input_ids,
            memory,
            memory_mask=attention_mask,
            decoder_attention_mask=decoder_attention_mask,
        )
        loss = None
        if labels is not None:
            loss = sequence_cross_entropy(
                logits, labels, label_smoothing=self.config.label_smoothing
            )
        return Seq2SeqOutput(logits=logits, loss=loss, encoder_last_hidden_state=memory)

    @classmethod
    def from_torch(cls, module: nn.Transformer, config: TransformerConfig) -> Transformer:
        """A qkv Transformer whose encoder and decoder stacks (final norms included) are those of
        `module`, weights copied. `nn.Transformer` has no embeddings or output projection: those
        are freshly initialised from `config`, whose sizes must match `module`'s."""
        mismatches = _torch_mismatches(module, config)
        if mismatches:
            raise ValueError("config: does not match module: " + "; ".join(mismatches))
        model = cls(config)
        model.encoder = EncoderStack.from_torch(module.encoder)
        model.decoder = DecoderStack.from_torch(module.decoder)
        return model

    def _embed(self, ids: torch.Tensor, embedding: nn.Embedding, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)  # (L,)
        x = embedding(ids) * self.embedding_scale + self.positions(positions)  # (B, L, E)
        return self.embedding_dropout(x)

    def _init_weights(self) -> None:
        """Xavier-uniform for the stacks' matrices (as `nn.Transformer._reset_parameters`),
        N(0, E^-1/2) for embeddings and the output projection, a zero padding row."""
        for stack in (self.encoder, self.decoder):
            for parameter in stack.parameters():
                if parameter.dim() > 1:
                    nn.init.xavier_uniform_(parameter)
        std = self.config.embed_dim**-0.5
        for matrix in (self.source_embedding, self.target_embedding, self.lm_head):
            nn.init.normal_(matrix.weight, mean=0.0, std=std)
        with torch.no_grad():
            self.source_embedding.weight[self.config.pad_token_id].zero_()
            self.target_embedding.weight[self.config.pad_token_id].zero_()


def _encoder_blocks(config: TransformerConfig) -> list[EncoderBlock]:
    return _blocks(EncoderBlock, config, config.num_encoder_layers)


def _decoder_blocks(config: TransformerConfig) -> list[DecoderBlock]:
    return _blocks(DecoderBlock, config, config.num_decoder_layers)


def _blocks(block: type, config: TransformerConfig, count: int) -> list:
    """`count` blocks of the paper's sizes: ReLU FFN, post-norm unless config.norm_first."""
    E, H, F = config.embed_dim, config.num_heads, config.ffn_dim
    return [
        block(E, H, F, dropout=config.dropout, activation="relu", norm_first=config.norm_first)
        for _ in range(count)
    ]


def _torch_mismatches(module: nn.Transformer, config: TransformerConfig) -> list[str]:
    """What differs between an nn.Transformer and a config (empty when they agree)."""
    if not isinstance(module, nn.Transformer):
        raise TypeError(f"module: expected nn.Transformer, got {type(module).__name__}")
    first = module.encoder.layers[0]
    seen = {
        "embed_dim": module.d_model,
        "num_heads": module.nhead,
        "num_encoder_layers": len(module.encoder.layers),
        "num_decoder_layers": len(module.decoder.layers),
        "ffn_dim": first.linear1.out_features,
        "dropout": float(first.dropout.p),
        "norm_first": bool(first.norm_first),
    }
    return [
        f"{name}={getattr(config, name)!r} but module has {value!r}"
        for name, value in seen.items()
        if getattr(config, name) != value
    ]


def _norm_from_torch(name: str, norm: nn.LayerNorm | None) -> LayerNorm:
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(
            f"{name}: expected an nn.LayerNorm (nn.Transformer always has one), got {norm!r}"
        )
    weight = norm.weight
    layer = LayerNorm(
        norm.normalized_shape[-1],
        eps=norm.eps,
        bias=norm.bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    copy_weight_and_bias(layer, norm)
    return layer


register_model_class(Transformer, TransformerConfig)
