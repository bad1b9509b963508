"""Beam search and scored greedy search: the best hypotheses with their scores.

Both run the one decoding loop (qkv.generation.loop) with `generate`'s step sources, for
decoder-only models and for the encoder-decoder `Transformer` alike: `beam_search` with the
`BeamSearch` strategy, `greedy_decode` with greedy `TokenChoice`. They differ from `generate`
in what they return: several hypotheses per prompt and the length-normalised log-probability
each is ranked by (see qkv.generation.beam_strategy).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.generation.generate import beam_strategy, prepare, token_strategy
from qkv.generation.options import DecodeOptions
from qkv.models.encoder_decoder import Transformer
from qkv.models.gpt import GPT

__all__ = ["beam_search", "greedy_decode"]


def beam_search(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    early_stopping: bool = True,
    num_return_sequences: int = 1,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best hypotheses per prompt under beam search (qkv.generation.beam_strategy).

    model: an encoder-decoder `Transformer` (input_ids: the source (B, L_src), attention_mask
    1/True on real tokens; hypotheses start with the config's bos_token_id and end with its
    eos_token_id) or a decoder-only `GPT` (input_ids: left-padded prompts (B, L) as `generate`
    takes them; hypotheses start with the prompt; eos_token_id None: they end only at
    max_new_tokens). eos_token_id given replaces the config's.

    Returns (sequences (B * n, L_out), scores (B * n,) fp32), n = num_return_sequences
    (<= num_beams): the n best hypotheses of prompt b in rows b * n .. b * n + n - 1, best
    first, padded after their end token (encoder-decoder: with pad_token_id; decoder-only: with
    eos_token_id). Scores are the sums of log-probabilities / new tokens ** length_penalty. A
    prompt stops once it has num_beams finished hypotheses (early_stopping=True) or once no beam
    can beat them. Call `model.eval()` first (dropout).
    """
    _check_model(model)
    options = DecodeOptions(
        max_new_tokens=max_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
        early_stopping=early_stopping, eos_token_id=eos_token_id,
    )  # fmt: skip
    _check_return_count(num_return_sequences, num_beams)
    prepared = prepare(model, input_ids, options, attention_mask)
    # one beam still runs BeamSearch (not generate's greedy TokenChoice): the result is its own
    strategy = beam_strategy(prepared, options, _fill(model, prepared.eos_token_id))
    for _ in prepared.run(strategy, options):
        pass
    return strategy.result(num_return_sequences)


def greedy_decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    length_penalty: float = 1.0,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely next token at every step, with the score beam search would give it.

    Same arguments and results as `beam_search` with one beam: (sequences (B, L_out), scores
    (B,)), each sequence padded after its end token as there, scored as there.
    """
    _check_model(model)
    options = DecodeOptions(
        max_new_tokens=max_new_tokens, length_penalty=length_penalty, eos_token_id=eos_token_id
    )
    prepared = prepare(model, input_ids, options, attention_mask)
    eos = prepared.eos_token_id
    strategy = token_strategy(prepared, options, _fill(model, eos))
    B = prepared.prompt.shape[0]
    alive = torch.ones(B, dtype=torch.bool, device=prepared.prompt.device)  # before the step
    sum_logprobs = torch.zeros(B, device=alive.device)
    lengths = torch.zeros(B, dtype=torch.long, device=alive.device)
    tokens = [prepared.prompt]
    for step in prepared.run(strategy, options):
        logprobs = torch.log_softmax(step.logits, dim=-1)  # (B, V) fp32
        chosen = logprobs.gather(1, step.tokens[:, None])[:, 0]  # (B,)
        sum_logprobs += torch.where(alive, chosen, 0.0)
        lengths += alive.long()
        if eos is not None:
            alive &= step.tokens != eos
        tokens.append(step.tokens[:, None])
    scores = sum_logprobs / lengths.clamp(min=1).float() ** length_penalty
    return torch.cat(tokens, dim=1), scores


def _fill(model, eos: int | None) -> int:
    """What follows a hypothesis's end: an encoder-decoder's pad_token_id; for a decoder-only
    model, its end token (generate's rule; 0 where there is none, never seen)."""
    if isinstance(model, Transformer):
        return model.config.pad_token_id
    return 0 if eos is None else eos


def _check_model(model: object) -> None:
    if not isinstance(model, (Transformer, GPT)):
        raise TypeError(
            f"model: expected a qkv.models.Transformer (encoder-decoder) or a qkv.models.GPT "
            f"(decoder-only), got {type(model).__name__}"
        )


def _check_return_count(num_return_sequences: object, num_beams: int) -> None:
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int):
        raise TypeError(
            f"num_return_sequences: expected an int, got {type(num_return_sequences).__name__}"
        )
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(
            f"num_return_sequences: expected 1 .. num_beams={num_beams}, got {num_return_sequences}"
        )
