"""The text of `qkv cost --shares`, `--source-length/--target-length`, `--generate` and
`--layer-types`: one section per model, under its cost column."""

from __future__ import annotations

from qkv.analysis.cost.format import format_flops, text_table
from qkv.analysis.cost.layer_types import LayerTypes
from qkv.analysis.cost.scaling import AttentionShares, EncoderDecoderFlops, GenerationFlops

__all__ = ["format_encoder_decoder", "format_generation", "format_layer_types", "format_shares"]


def _length(value: int) -> str:
    """2048 -> "2K", 131072 -> "128K", 300 -> "300"."""
    return f"{value // 1024}K" if value >= 1024 and value % 1024 == 0 else str(value)


def format_shares(shares: AttentionShares) -> str:
    """The crossover, then a row per length: one block's FLOPs and attention's shares."""
    header = ["L", "scores", "projections", "FFN", "scores share", "attention share"]
    rows = [
        [_length(row.length), format_flops(row.score_flops), format_flops(row.projection_flops),
         format_flops(row.ffn_flops), f"{row.scores_share:.1%}", f"{row.attention_share:.1%}"]
        for row in shares.shares
    ]  # fmt: skip
    title = (
        f"{shares.name}: attention against the rest of one {shares.stack} block (one sequence)"
        f"\nscores (Q K^T, weights @ V) = projections + FFN at L = {shares.crossover_length:,.1f}"
        f" = {shares.crossover_per_embed_dim:.3g} E (E = {shares.embed_dim})"
    )
    notes = "scores share = L / (L + L*); attention share counts the projections too"
    return f"{title}\n{text_table([header, *rows])}\n{notes}"


def format_encoder_decoder(flops: EncoderDecoderFlops) -> str:
    """One block of each kind, then the stacks and the whole forward."""
    S, T = flops.source_length, flops.target_length
    rows = [
        ["per block", "scores", "projections", "FFN"],
        [f"encoder self-attention (S^2, S={S})", format_flops(flops.encoder_self_scores),
         format_flops(flops.encoder_projections), format_flops(flops.encoder_ffn)],
        [f"decoder self-attention (T^2, T={T})", format_flops(flops.decoder_self_scores),
         format_flops(flops.decoder_self_projections), format_flops(flops.decoder_ffn)],
        ["cross-attention (S x T)", format_flops(flops.cross_scores),
         format_flops(flops.cross_projections), "-"],
    ]  # fmt: skip
    totals = (
        f"encoder ({flops.num_encoder_layers} blocks) {format_flops(flops.encoder_flops)}, "
        f"decoder ({flops.num_decoder_layers} blocks) {format_flops(flops.decoder_flops)}, "
        f"head {format_flops(flops.head_flops)}: forward {format_flops(flops.forward_flops)}"
    )
    title = f"{flops.name}: {S} source x {T} target tokens, one sequence"
    return f"{title}\n{text_table(rows)}\n{totals}"


def format_generation(flops: GenerationFlops) -> str:
    """Both ways of generating, and their ratio."""
    rows = [
        ["", "FLOPs"],
        [f"with KV cache: prefill of {flops.prompt_length}", format_flops(flops.prefill_flops)],
        [f"  + {flops.new_tokens - 1} one-token steps", format_flops(flops.step_flops)],
        ["  = with KV cache", format_flops(flops.cached_flops)],
        [f"without: {flops.new_tokens} forwards over the prefix",
         format_flops(flops.recomputed_flops)],
    ]  # fmt: skip
    title = (
        f"{flops.name}: {flops.new_tokens} new tokens after a {flops.prompt_length}-token "
        f"prompt, one sequence"
    )
    ratio = f"without / with the cache: {flops.ratio:.3g}x"
    return f"{title}\n{text_table(rows)}\n{ratio}"


def format_layer_types(table: LayerTypes) -> str:
    """Table 1 of Vaswani et al. 2017 at the model's length and width: each order, then its
    value."""
    header = ["layer", "per layer", "FLOPs", "sequential ops", "max path length"]
    rows = [
        [row.name, row.complexity, format_flops(row.flops),
         f"{row.sequential} = {row.sequential_operations:,}",
         f"{row.path} = {row.max_path_length:,}"]
        for row in table.rows
    ]  # fmt: skip
    title = (
        f"{table.name}: layer types at n = {table.length}, d = {table.width}, k = {table.kernel}"
        f", r = {table.neighbourhood} (Vaswani et al. 2017, Table 1)"
    )
    notes = (
        "FLOPs: 2 per multiply-add; self-attention counts Q K^T and weights @ V, not the "
        "projections\nmax path length: layers until output n-1 depends on input 0 (recurrent: "
        "steps); causal convolutions,\nthe dilated ones dilated 1, k, k^2, ...; restricted: r "
        "keys centred on each query"
    )
    return f"{title}\n{text_table([header, *rows])}\n{notes}"
