"""What a model is made of, for counting: the layout of a config, and its exact formulas.

A config (`GPTConfig`, `BertConfig`, `TransformerConfig`, `T5Config`, `ViTConfig`) becomes a
`ModelLayout`: embedding tables (or a ViT's patch projection), one or two stacks of blocks
(self-attention, optional cross-attention, FFN, norms), an optional pooling and an output
head. Every count below is a formula of that layout, never a measurement; the tests check the
formulas against instantiated qkv models (parameters), `FlopCounterMode` (FLOPs) and the KV
caches' own sizes.

Conventions (the usual ones of FLOP counts, e.g. Kaplan et al. 2020, s2.1):
- A multiply-add is 2 FLOPs: (L x E) @ (E x E) costs 2 L E^2. Only the matrix products are
  counted (projections, Q K^T, weights @ V, FFN, output head), as `FlopCounterMode` does;
  norms, softmax, activations, biases and embedding lookups add O(L E), not O(L E^2).
- The score matrix is counted dense, L_q x L_k, even under a causal mask: the textbook
  4 B L^2 E term, and what a backend that materialises the scores computes.
- One MHA layer then costs 8 B L E^2 (the four projections) + 4 B L^2 E (Q K^T, weights @ V).
- T5's relative position bias (Raffel et al. 2020, s2.1) is looked up and added to the scores:
  no matrix product, so no FLOPs; its table is a parameter like any embedding table.
- A ViT (Dosovitskiy et al. 2021, s3.1) projects each of its L - 1 patches (L with mean or
  latent pooling) of C P^2 pixels to E channels, 2 C P^2 E FLOPs each, and its head reads one
  pooled vector per image: 2 E classes FLOPs, not per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qkv.models.bert import BertConfig
from qkv.models.encoder_decoder_config import TransformerConfig
from qkv.models.gpt_config import GPTConfig
from qkv.models.t5_config import T5Config
from qkv.models.vit_config import ViTConfig

__all__ = [
    "AttentionLayout",
    "FFNLayout",
    "LatentPoolingLayout",
    "ModelLayout",
    "StackLayout",
    "layout_of",
]

ModelConfig = GPTConfig | BertConfig | TransformerConfig | T5Config | ViTConfig


@dataclass(frozen=True)
class AttentionLayout:
    """One attention sub-layer: q_proj E -> H D, k_proj and v_proj E -> H_kv D, out_proj
    H D -> E (qkv.layers.MultiHeadAttention), with or without biases."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool

    def parameters(self) -> int:
        E, H, H_kv, D = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim
        weights = 2 * E * H * D + 2 * E * H_kv * D  # q and out; k and v (GQA shrinks these)
        biases = H * D + 2 * H_kv * D + E if self.bias else 0
        return weights + biases

    def flops(self, L_q: int, L_k: int, *, new_keys: int | None = None) -> int:
        """Forward FLOPs of L_q queries over L_k keys (one sequence). new_keys: the key/value
        positions projected by this call (default L_k); fewer when the rest come from a cache
        (L_q when decoding with a KV cache, 0 for cross-attention over a cached memory)."""
        E, H, H_kv, D = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim
        new_keys = L_k if new_keys is None else new_keys
        projections = 2 * L_q * E * H * D + 2 * L_q * H * D * E  # q_proj, out_proj
        projections += 2 * 2 * new_keys * E * H_kv * D  # k_proj, v_proj
        scores_and_sum = 2 * 2 * L_q * L_k * H * D  # Q K^T, then weights @ V
        return projections + scores_and_sum


@dataclass(frozen=True)
class FFNLayout:
    """The feed-forward sub-layer: up and down projections (2 matrices), or the gate, up and
    down of SwiGLU or GEGLU (3 matrices; Shazeer 2020, GLU variants)."""

    embed_dim: int
    hidden_dim: int
    gated: bool
    bias: bool

    @property
    def num_matrices(self) -> int:
        return 3 if self.gated else 2

    def parameters(self) -> int:
        E, F = self.embed_dim, self.hidden_dim
        biases = (self.num_matrices - 1) * F + E if self.bias else 0
        return self.num_matrices * E * F + biases

    def flops(self, L: int) -> int:
        return self.num_matrices * 2 * L * self.embed_dim * self.hidden_dim


@dataclass(frozen=True)
class StackLayout:
    """num_layers blocks applied in turn; num_blocks of them own weights (fewer under ALBERT's
    cross-layer sharing). causal: a decoder stack, which keeps a KV cache when generating."""

    num_layers: int
    num_blocks: int
    self_attention: AttentionLayout
    ffn: FFNLayout
    norm_parameters: int  # all the norms of one block
    final_norm_parameters: int
    causal: bool
    cross_attention: AttentionLayout | None = None

    def block_parameters(self) -> int:
        attention = self.self_attention.parameters() + (
            0 if self.cross_attention is None else self.cross_attention.parameters()
        )
        return attention + self.ffn.parameters() + self.norm_parameters

    def parameters(self) -> int:
        return self.num_blocks * self.block_parameters() + self.final_norm_parameters

    def flops(self, L: int, *, keys: int, memory: int = 0, cached_memory: bool = False) -> int:
        """Forward FLOPs of L new tokens attending over `keys` keys (L itself, or the cached
        length plus L when decoding) and, with cross-attention, over `memory` encoder states
        (whose keys and values are projected once, so not again when `cached_memory`)."""
        per_layer = self.self_attention.flops(L, keys, new_keys=L) + self.ffn.flops(L)
        if self.cross_attention is not None:
            projected = 0 if cached_memory else memory
            per_layer += self.cross_attention.flops(L, memory, new_keys=projected)
        return self.num_layers * per_layer


@dataclass(frozen=True)
class LatentPoolingLayout:
    """Learned queries that cross-attend to the final tokens (qkv.layers.LatentPooling; Jaegle
    et al. 2021): the latents (num_latents x E), the cross-attention and an FFN, each pre-norm,
    `blocks` of self-attention over the latents, and four LayerNorms (latents, input, FFN,
    output) of norm_parameters in all."""

    num_latents: int
    cross_attention: AttentionLayout
    ffn: FFNLayout
    blocks: StackLayout
    norm_parameters: int

    def parameters(self) -> int:
        latents = self.num_latents * self.cross_attention.embed_dim
        return (latents + self.cross_attention.parameters() + self.ffn.parameters()
                + self.blocks.parameters() + self.norm_parameters)  # fmt: skip

    def flops(self, L: int) -> int:
        """The latents reading L tokens, then their FFN and blocks (L-independent)."""
        N = self.num_latents
        return (self.cross_attention.flops(N, L) + self.ffn.flops(N)
                + self.blocks.flops(N, keys=N))  # fmt: skip


@dataclass(frozen=True)
class ModelLayout:
    """A whole model: embedding tables, an encoder and/or a decoder stack, an output head.

    family: "decoder-only", "encoder-only" or "encoder-decoder". head_vocab_size: the width of
    the output projection (0 without one); head_parameters: its weights when not tied to an
    embedding. pooler_parameters: BERT's tanh pooler over [CLS] (E^2 + E). max_positions: the
    tokens one sequence may hold (a GPT's `context_length`: RoPE scaling extends it).

    Images (a ViT): patch_dim, the pixels of one patch (C P^2) that its projection reads (0 for
    a model whose tokens are looked up in a table); prefix_tokens, tokens the model adds before
    the patches (the [class] token); pooled_head, the head reads one vector per sequence rather
    than every token; latent_pooling, learned queries reading the final tokens (or None);
    num_classes, the classifier's classes (0 without one).
    """

    family: str
    vocab_size: int
    embed_dim: int
    max_positions: int
    embedding_parameters: int
    encoder: StackLayout | None
    decoder: StackLayout | None
    head_vocab_size: int
    head_parameters: int
    pooler_parameters: int = 0
    patch_dim: int = 0
    prefix_tokens: int = 0
    pooled_head: bool = False
    latent_pooling: LatentPoolingLayout | None = None
    num_classes: int = 0

    @property
    def stacks(self) -> tuple[StackLayout, ...]:
        return tuple(s for s in (self.encoder, self.decoder) if s is not None)

    @property
    def attention(self) -> AttentionLayout:
        """The self-attention of the stack that generates (the decoder) or of the encoder."""
        return (self.decoder or self.encoder).self_attention

    def parameters(self) -> int:
        stacks = sum(stack.parameters() for stack in self.stacks)
        pooling = 0 if self.latent_pooling is None else self.latent_pooling.parameters()
        return (self.embedding_parameters + stacks + self.head_parameters
                + self.pooler_parameters + pooling)  # fmt: skip

    def forward_flops(self, L: int) -> int:
        """Forward FLOPs of one sequence of L tokens (the source and the target both L long
        in an encoder-decoder)."""
        E = self.embed_dim
        total = sum(stack.flops(L, keys=L, memory=L) for stack in self.stacks)
        pooler = 2 * E * E if self.pooler_parameters else 0
        if self.latent_pooling is not None:
            pooler += self.latent_pooling.flops(L)
        patches = 2 * max(L - self.prefix_tokens, 0) * self.patch_dim * E
        head = 2 * (1 if self.pooled_head else L) * E * self.head_vocab_size
        return patches + total + pooler + head

    def decode_flops(self, context: int) -> int | None:
        """FLOPs of one decoding step: one new token attending over `context` cached keys (its
        own included) and, in an encoder-decoder, over a cached memory of `context` tokens."""
        if self.decoder is None:
            return None
        stack = self.decoder.flops(1, keys=context, memory=context, cached_memory=True)
        return stack + 2 * self.embed_dim * self.head_vocab_size


def layout_of(config: ModelConfig) -> ModelLayout:
    """The layout of a GPTConfig (qkv.models.GPT), a BertConfig (BertModel, with its pooler),
    a TransformerConfig (the encoder-decoder Transformer), a T5Config (qkv.models.T5Transformer)
    or a ViTConfig (qkv.models.ViT)."""
    for config_class, build in _BUILDERS.items():
        if isinstance(config, config_class):
            return build(config)
    raise TypeError(
        f"config: expected a GPTConfig, BertConfig, TransformerConfig, T5Config or ViTConfig, "
        f"got {type(config).__name__}"
    )


def _gpt_layout(config: GPTConfig) -> ModelLayout:
    """qkv.models.GPT: token (+ learned position) embedding, pre-norm blocks, final norm,
    lm_head (tied or not). LayerNorm has a bias when config.bias; RMSNorm never has one."""
    E, V = config.embed_dim, config.vocab_size
    norm = E * (2 if config.norm == "layernorm" and config.bias else 1)
    attention = AttentionLayout(
        embed_dim=E, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, bias=config.bias,
    )  # fmt: skip
    ffn = FFNLayout(
        embed_dim=E, hidden_dim=config.ffn_dim, gated=config.ffn == "swiglu", bias=config.bias
    )
    positions = _gpt_position_parameters(config)
    decoder = StackLayout(
        num_layers=config.num_layers, num_blocks=config.num_layers, self_attention=attention,
        ffn=ffn, norm_parameters=2 * norm, final_norm_parameters=norm, causal=True,
    )  # fmt: skip
    return ModelLayout(
        family="decoder-only", vocab_size=V, embed_dim=E, max_positions=config.context_length,
        embedding_parameters=V * E + positions, encoder=None, decoder=decoder,
        head_vocab_size=V, head_parameters=0 if config.tie_embeddings else V * E,
    )  # fmt: skip


def _bert_layout(config: BertConfig) -> ModelLayout:
    """qkv.models.BertModel: token + segment + position tables and their LayerNorm, post-norm
    blocks with biases (one block under share_layers), the pooler; no output head."""
    E = config.embed_dim
    tables = (config.vocab_size + config.type_vocab_size + config.max_positions) * E
    encoder = StackLayout(
        num_layers=config.num_layers,
        num_blocks=1 if config.share_layers else config.num_layers,
        self_attention=_mha(E, config.num_heads),
        ffn=FFNLayout(embed_dim=E, hidden_dim=config.ffn_dim, gated=False, bias=True),
        norm_parameters=2 * 2 * E, final_norm_parameters=0, causal=False,
    )  # fmt: skip
    return ModelLayout(
        family="encoder-only", vocab_size=config.vocab_size, embed_dim=E,
        max_positions=config.max_positions, embedding_parameters=tables + 2 * E,
        encoder=encoder, decoder=None, head_vocab_size=0, head_parameters=0,
        pooler_parameters=E * E + E,
    )  # fmt: skip


def _transformer_layout(config: TransformerConfig) -> ModelLayout:
    """qkv.models.Transformer: source and target tables (one when share_embeddings), fixed
    sinusoids (no parameters), post- or pre-norm stacks each ending in a LayerNorm, lm_head
    (the target table when tie_output)."""
    E, V_src, V_tgt = config.embed_dim, config.src_vocab_size, config.tgt_vocab_size
    ffn = FFNLayout(embed_dim=E, hidden_dim=config.ffn_dim, gated=False, bias=True)
    attention = _mha(E, config.num_heads)
    encoder = StackLayout(
        num_layers=config.num_encoder_layers, num_blocks=config.num_encoder_layers,
        self_attention=attention, ffn=ffn, norm_parameters=2 * 2 * E,
        final_norm_parameters=2 * E, causal=False,
    )  # fmt: skip
    decoder = dataclasses.replace(
        encoder, num_layers=config.num_decoder_layers, num_blocks=config.num_decoder_layers,
        norm_parameters=3 * 2 * E, causal=True, cross_attention=attention,
    )  # fmt: skip
    tables = V_src * E + (0 if config.share_embeddings else V_tgt * E)
    return ModelLayout(
        family="encoder-decoder", vocab_size=V_tgt, embed_dim=E,
        max_positions=config.max_positions, embedding_parameters=tables, encoder=encoder,
        decoder=decoder, head_vocab_size=V_tgt,
        head_parameters=0 if config.tie_output else V_tgt * E,
    )  # fmt: skip


def _t5_layout(config: T5Config) -> ModelLayout:
    """qkv.models.T5Transformer (Raffel et al. 2020, s2.1): one table for both stacks, no
    position table but a relative bias of buckets x H per stack, held once and read by all its
    layers (counted with the tables, as a GPT's T5 bias is); pre-norm blocks without biases,
    RMSNorms of a weight only (E each), the ReLU or T5 v1.1's gated-GELU FFN, and lm_head (the
    table when tie_word_embeddings). max_positions: the 512 tokens of pre-training (s3.1.2)."""
    E, V, H = config.d_model, config.vocab_size, config.num_heads
    attention = AttentionLayout(embed_dim=E, num_heads=H, num_kv_heads=H, head_dim=config.d_kv,
                                bias=False)  # fmt: skip
    ffn = FFNLayout(embed_dim=E, hidden_dim=config.d_ff,
                    gated=config.feed_forward_proj == "gated-gelu", bias=False)  # fmt: skip
    encoder = StackLayout(
        num_layers=config.num_layers, num_blocks=config.num_layers, self_attention=attention,
        ffn=ffn, norm_parameters=2 * E, final_norm_parameters=E, causal=False,
    )  # fmt: skip
    decoder = dataclasses.replace(
        encoder, num_layers=config.num_decoder_layers, num_blocks=config.num_decoder_layers,
        norm_parameters=3 * E, causal=True, cross_attention=attention,
    )  # fmt: skip
    relative_biases = 2 * config.relative_attention_num_buckets * H  # the encoder's, the decoder's
    return ModelLayout(
        family="encoder-decoder", vocab_size=V, embed_dim=E, max_positions=512,
        embedding_parameters=V * E + relative_biases, encoder=encoder, decoder=decoder,
        head_vocab_size=V, head_parameters=0 if config.tie_word_embeddings else V * E,
    )  # fmt: skip


def _vit_layout(config: ViTConfig) -> ModelLayout:
    """qkv.models.ViT: the patch projection (C P^2 -> E, with bias), a [class] token with
    pooling="cls", learned positions (none with fixed 2-D sinusoids), pre-norm blocks, the
    final LayerNorm, latent pooling when chosen, and the linear head over one pooled vector."""
    E, C = config.embed_dim, config.num_classes
    patch_dim = config.channels * config.patch_size**2
    prefix = 1 if config.pooling == "cls" else 0
    positions = config.num_tokens * E if config.position == "learned" else 0
    ffn = FFNLayout(embed_dim=E, hidden_dim=config.ffn_dim, gated=False, bias=True)
    encoder = StackLayout(
        num_layers=config.num_layers, num_blocks=config.num_layers,
        self_attention=_mha(E, config.num_heads), ffn=ffn, norm_parameters=2 * 2 * E,
        final_norm_parameters=2 * E, causal=False,
    )  # fmt: skip
    latent = None
    if config.pooling == "latent":
        blocks = dataclasses.replace(
            encoder, num_layers=config.latent_blocks, num_blocks=config.latent_blocks,
            final_norm_parameters=0,
        )  # fmt: skip
        latent = LatentPoolingLayout(
            num_latents=config.num_latents, cross_attention=_mha(E, config.num_heads), ffn=ffn,
            blocks=blocks, norm_parameters=4 * 2 * E,
        )  # fmt: skip
    return ModelLayout(
        family="encoder-only", vocab_size=0, embed_dim=E, max_positions=config.num_tokens,
        embedding_parameters=patch_dim * E + E + prefix * E + positions, encoder=encoder,
        decoder=None, head_vocab_size=C, head_parameters=E * C + C, patch_dim=patch_dim,
        prefix_tokens=prefix, pooled_head=True, latent_pooling=latent, num_classes=C,
    )  # fmt: skip


def _mha(embed_dim: int, num_heads: int) -> AttentionLayout:
    return AttentionLayout(
        embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=embed_dim // num_heads, bias=True,
    )  # fmt: skip


_BUILDERS = {
    GPTConfig: _gpt_layout,
    BertConfig: _bert_layout,
    TransformerConfig: _transformer_layout,
    T5Config: _t5_layout,
    ViTConfig: _vit_layout,
}


def _gpt_position_parameters(config: GPTConfig) -> int:
    """A learned table's max_positions * E, T5's shared buckets * H, else 0."""
    if config.position == "learned":
        return config.max_positions * config.embed_dim
    if config.position == "t5":
        return config.relative_buckets * config.num_heads
    return 0
