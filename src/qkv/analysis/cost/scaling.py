"""How a model's FLOPs move with the lengths: attention's share against the rest of a block,
source and target lengths of an encoder-decoder, and generation with and without a KV cache.

Same conventions as `qkv.analysis.cost.layout`: 2 FLOPs per multiply-add, matrix products only,
dense L_q x L_k scores. E is the width, H and H_kv the query and key/value heads, D the head size,
F the FFN's hidden width with m = 2 matrices (3 when gated: SwiGLU, T5 v1.1's GEGLU).

Attention's share (`attention_shares`). Per layer and per token of a length-L sequence, the
scores cost 4 L H D (Q K^T then weights @ V, 2 L H D each) and grow with L; the rest of the
block does not: the projections 4 E H D + 4 E H_kv D, the FFN 2 m E F. Vaswani et al. 2017,
Table 1 gives the same split per layer: self-attention O(n^2 d), the position-wise products
O(n d^2). The scores equal the rest of the block at

    L* = (4 E H D + 4 E H_kv D + 2 m E F) / (4 H D),

6E for the standard block (H D = E, H_kv = H, F = 4E, m = 2); at length L their share of the
block is L / (L + L*). Kaplan et al. 2020, s2.1 writes the forward cost per token as
2N + 2 n_layer n_ctx d_attn: the context term counts Q K^T alone; the dense count here adds
weights @ V, so 4 n_layer n_ctx d_attn, and the crossover is where that term meets 2N's block
part.

Source and target (`encoder_decoder_flops`): an encoder-decoder reading S source tokens and
T target tokens costs, per block, 4 S^2 H D for the encoder's scores, 4 T^2 H D for the
decoder's self-attention scores and 4 T S H D for its cross-attention scores: doubling S
multiplies them by 4, 1 and 2.

Generation (`generation_flops`): a prompt of P tokens, then N new tokens. With a KV cache:
one forward over the prompt (it gives the first new token), then N - 1 steps of one token
over P + 1, ..., P + N - 1 keys. Without: a forward over the whole prefix for each new token,
P, P + 1, ..., P + N - 1 tokens. Either way the output head reads the last position only (the
next token's logits: what `qkv.generation.generate` computes). The scores grow as N P^2
without the cache against N P with it; the rest of the model as N P against P + N.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from qkv.analysis.cost.layout import AttentionLayout, FFNLayout, ModelConfig, layout_of
from qkv.analysis.cost.sources import resolve_model
from qkv.validation import check_positive_int

__all__ = [
    "SHARE_LENGTHS",
    "AttentionShares",
    "EncoderDecoderFlops",
    "GenerationFlops",
    "LengthShare",
    "attention_shares",
    "crossover_length",
    "encoder_decoder_flops",
    "generation_flops",
]

SHARE_LENGTHS = (512, 2048, 8192, 32768, 131072)


def score_flops(attention: AttentionLayout, L_q: int, L_k: int) -> int:
    """Q K^T and weights @ V of L_q queries over L_k keys: 2 x 2 L_q L_k H D."""
    return 4 * L_q * L_k * attention.num_heads * attention.head_dim


def crossover_length(attention: AttentionLayout, ffn: FFNLayout) -> Fraction:
    """L* where one self-attention layer's scores (4 L^2 H D) cost what its projections and
    the FFN cost (linear in L); exact, as a fraction."""
    rest_per_token = attention.flops(1, 1) - score_flops(attention, 1, 1) + ffn.flops(1)
    return Fraction(rest_per_token, score_flops(attention, 1, 1))


@dataclass(frozen=True)
class LengthShare:
    """One self-attention + FFN block at one length, one sequence: the scores, the four
    projections and the FFN; scores_share = scores / block, attention_share = (scores +
    projections) / block."""

    length: int
    score_flops: int
    projection_flops: int
    ffn_flops: int
    scores_share: float
    attention_share: float


@dataclass(frozen=True)
class AttentionShares:
    """Attention's share of a block as L grows. stack: the stack whose block is counted (the
    decoder of a decoder-only model, the encoder otherwise: an encoder-decoder's decoder adds
    cross-attention, see `encoder_decoder_flops`). crossover_length: L* (scores = the rest);
    crossover_per_embed_dim: L* / E (6 for the standard block)."""

    name: str
    stack: str
    embed_dim: int
    crossover_length: float
    crossover_per_embed_dim: float
    shares: tuple[LengthShare, ...]


def attention_shares(
    model: str | Path | ModelConfig, lengths: tuple[int, ...] = SHARE_LENGTHS
) -> AttentionShares:
    """Attention's share of one block of `model` at each of `lengths`, and the crossover."""
    name, config = resolve_model(model)
    layout = layout_of(config)
    stack = layout.decoder if layout.family == "decoder-only" else layout.encoder
    attention, ffn = stack.self_attention, stack.ffn
    crossover = crossover_length(attention, ffn)
    rows = []
    for length in lengths:
        L = check_positive_int("length", length)
        scores = score_flops(attention, L, L)
        projections = attention.flops(L, L) - scores
        block = attention.flops(L, L) + ffn.flops(L)
        row = LengthShare(
            length=L, score_flops=scores, projection_flops=projections, ffn_flops=ffn.flops(L),
            scores_share=scores / block, attention_share=(scores + projections) / block,
        )  # fmt: skip
        rows.append(row)
    return AttentionShares(
        name=name, stack="decoder" if stack.causal else "encoder", embed_dim=layout.embed_dim,
        crossover_length=float(crossover),
        crossover_per_embed_dim=float(crossover / layout.embed_dim), shares=tuple(rows),
    )  # fmt: skip


@dataclass(frozen=True)
class EncoderDecoderFlops:
    """One forward of an encoder-decoder over S source and T target tokens (one sequence).

    Per block: the encoder's self-attention scores (4 S^2 H D), projections and FFN; the
    decoder's self-attention scores (4 T^2 H D), cross-attention scores (4 T S H D), the
    projections of both (cross-attention's keys and values project the S encoder states) and
    its FFN. Totals: each stack, the output head (2 T E V) and the whole forward."""

    name: str
    source_length: int
    target_length: int
    num_encoder_layers: int
    num_decoder_layers: int
    encoder_self_scores: int
    encoder_projections: int
    encoder_ffn: int
    decoder_self_scores: int
    decoder_self_projections: int
    cross_scores: int
    cross_projections: int
    decoder_ffn: int
    encoder_flops: int
    decoder_flops: int
    head_flops: int
    forward_flops: int


def encoder_decoder_flops(
    model: str | Path | ModelConfig, *, source_length: int, target_length: int
) -> EncoderDecoderFlops:
    """The forward FLOPs of an encoder-decoder with S = source_length, T = target_length;
    ValueError naming `model` for a model without an encoder and a decoder."""
    name, config = resolve_model(model)
    layout = layout_of(config)
    S = check_positive_int("source_length", source_length)
    T = check_positive_int("target_length", target_length)
    if layout.family != "encoder-decoder":
        raise ValueError(
            f"model: --source-length/--target-length need an encoder-decoder; {name} is "
            f"{layout.family}"
        )
    encoder, decoder = layout.encoder, layout.decoder
    own, cross = decoder.self_attention, decoder.cross_attention
    enc_scores = score_flops(encoder.self_attention, S, S)
    self_scores, cross_scores = score_flops(own, T, T), score_flops(cross, T, S)
    encoder_total = encoder.flops(S, keys=S)
    decoder_total = decoder.flops(T, keys=T, memory=S)
    head = 2 * T * layout.embed_dim * layout.head_vocab_size
    return EncoderDecoderFlops(
        name=name, source_length=S, target_length=T, num_encoder_layers=encoder.num_layers,
        num_decoder_layers=decoder.num_layers, encoder_self_scores=enc_scores,
        encoder_projections=encoder.self_attention.flops(S, S) - enc_scores,
        encoder_ffn=encoder.ffn.flops(S), decoder_self_scores=self_scores,
        decoder_self_projections=own.flops(T, T) - self_scores, cross_scores=cross_scores,
        cross_projections=cross.flops(T, S) - cross_scores, decoder_ffn=decoder.ffn.flops(T),
        encoder_flops=encoder_total, decoder_flops=decoder_total, head_flops=head,
        forward_flops=encoder_total + decoder_total + head,
    )  # fmt: skip


@dataclass(frozen=True)
class GenerationFlops:
    """Generating new_tokens after a prompt_length-token prompt (one sequence).

    cached: prefill_flops (the prompt's forward, the head at its last position) + step_flops
    (new_tokens - 1 one-token steps over the KV cache). recomputed: a forward over the whole
    prefix for each new token. ratio: recomputed / cached."""

    name: str
    prompt_length: int
    new_tokens: int
    prefill_flops: int
    step_flops: int
    cached_flops: int
    recomputed_flops: int
    ratio: float


def generation_flops(
    model: str | Path | ModelConfig, *, prompt_length: int, new_tokens: int
) -> GenerationFlops:
    """Whole-generation FLOPs of a decoder-only model with and without a KV cache; ValueError
    naming `model` for any other."""
    name, config = resolve_model(model)
    layout = layout_of(config)
    P = check_positive_int("prompt_length", prompt_length)
    N = check_positive_int("new_tokens", new_tokens)
    if layout.family != "decoder-only":
        raise ValueError(f"model: --generate needs a decoder-only model; {name} is {layout.family}")
    head_per_token = 2 * layout.embed_dim * layout.head_vocab_size

    def last_logits_forward(L: int) -> int:  # the head reads the last position only
        return layout.forward_flops(L) - (L - 1) * head_per_token

    prefill = last_logits_forward(P)
    steps = sum(layout.decode_flops(P + step) for step in range(1, N))
    recomputed = sum(last_logits_forward(P + step) for step in range(N))
    return GenerationFlops(
        name=name, prompt_length=P, new_tokens=N, prefill_flops=prefill, step_flops=steps,
        cached_flops=prefill + steps, recomputed_flops=recomputed,
        ratio=recomputed / (prefill + steps),
    )  # fmt: skip
