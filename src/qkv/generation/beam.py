"""Beam search and greedy decoding for the encoder-decoder `Transformer`.

At inference the encoder runs once and the decoder produces the target one token at a time, each
step feeding back what it chose. Both searches here keep a `DecoderCache`, so a step feeds only the
newest token: the target's self-attention keys/values are cached, and each layer's cross-attention
keys/values are projected from the memory once per source sentence (on the first step) and then
shared by every beam.

Beam search (Vaswani et al. 2017 section 6.1 decode with 4 beams and GNMT's length penalty,
alpha = 0.6) keeps the `num_beams` best unfinished prefixes per sentence. Each step adds every
prefix's next-token log-probabilities to its score, takes the top 2 * num_beams (prefix, token)
pairs over beams x vocabulary, moves the pairs that end in EOS to a list of finished hypotheses,
and keeps the best num_beams others as the new beams; the cache follows them with one gather.
Finished hypotheses are ranked by

    score = sum of log-probabilities / generated_length ** length_penalty

where generated_length counts the new tokens, EOS included, not the start token. This is the
convention of Hugging Face transformers' `BeamHypotheses` (`generated_len`), a simpler form of
the length normalisation of Wu et al. 2016 (GNMT, section 7: lp(Y) = (5 + |Y|)^a / 6^a); the
bookkeeping (2 * num_beams candidates, an EOS candidate counts only if it ranks among the best
num_beams, `early_stopping`) also follows transformers, so num_beams=1 is exactly greedy search.
"""

from __future__ import annotations

import logging
import math

import torch

from qkv.models.decoder_cache import DecoderCache
from qkv.models.encoder_decoder import Transformer
from qkv.validation import check_int

__all__ = ["beam_search", "greedy_decode"]

logger = logging.getLogger(__name__)


class _FinishedHypotheses:
    """The best `num_beams` finished hypotheses of one sentence (transformers' BeamHypotheses)."""

    def __init__(self, num_beams: int, length_penalty: float) -> None:
        self.num_beams, self.length_penalty = num_beams, length_penalty
        self.hypotheses: list[tuple[float, list[int]]] = []  # (score, tokens), best first

    def add(self, tokens: list[int], sum_logprob: float, generated_length: int) -> None:
        score = sum_logprob / generated_length**self.length_penalty
        self.hypotheses.append((score, tokens))
        self.hypotheses.sort(key=lambda hypothesis: hypothesis[0], reverse=True)
        del self.hypotheses[self.num_beams :]

    def is_done(
        self, best_alive_sum_logprob: float, generated_length: int, early_stop: bool
    ) -> bool:
        """Full, and (unless early_stop) no unfinished beam can still beat the worst finished
        one if it ended now (transformers' heuristic: exact for length_penalty <= 0 only)."""
        if len(self.hypotheses) < self.num_beams:
            return False
        if early_stop:
            return True
        best_possible = best_alive_sum_logprob / generated_length**self.length_penalty
        return self.hypotheses[-1][0] >= best_possible


@torch.no_grad()
def beam_search(
    model: Transformer,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    early_stopping: bool = True,
    num_return_sequences: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best target per source sentence under beam search; see the module docstring.

    input_ids (B, L_src) with attention_mask (B, L_src) (1/True on real tokens) when sentences
    are padded. Returns (sequences (B * n, L_out), scores (B * n,)), n = num_return_sequences
    (<= num_beams): the n best hypotheses of sentence b in rows b * n .. b * n + n - 1, best
    first. Each sequence starts with the config's bos_token_id, ends with eos_token_id unless
    it reached max_new_tokens, and is padded with pad_token_id to L_out <= 1 + max_new_tokens;
    scores are the length-normalised log-probabilities (float32). A sentence stops once it has
    num_beams finished hypotheses (early_stopping=True) or once no beam can beat them. The start,
    end and padding ids come from `model.config`; call `model.eval()` first (dropout).
    """
    _check_arguments(model, max_new_tokens, num_beams, length_penalty, early_stopping)
    _check_return_count(num_return_sequences, num_beams)
    config = model.config
    memory = model.encode(input_ids, attention_mask)  # (B, L_src, E)
    B = memory.shape[0]
    finished = [_FinishedHypotheses(num_beams, length_penalty) for _ in range(B)]
    if max_new_tokens == 0:  # the empty target is the only hypothesis: log-probability 0
        for hypotheses in finished:
            hypotheses.hypotheses.append((0.0, [config.bos_token_id]))
        return _best(finished, num_return_sequences, config, memory.device)
    cache = model.new_decoder_cache(B, max_new_tokens)
    done = torch.zeros(B, dtype=torch.bool, device=memory.device)
    prefixes = _start_tokens(config, B, memory.device)  # (B * K_cur, t + 1); K_cur = 1 at first
    beam_scores = memory.new_zeros(B, 1, dtype=torch.float32)  # (B, K_cur): sum of log-probs
    for step in range(max_new_tokens):
        K_cur = beam_scores.shape[1]
        logprobs = _next_logprobs(model, prefixes, memory, attention_mask, cache)  # (B*K_cur, V)
        candidates = beam_scores[:, :, None] + logprobs.view(B, K_cur, -1)  # (B, K_cur, V)
        top_scores, parents, tokens, is_eos = _top_candidates(candidates, num_beams, config)
        _add_finished(finished, done, prefixes, top_scores, parents, is_eos, step + 1, config)
        beam_scores, parents, tokens = _keep_unfinished(top_scores, parents, tokens, is_eos)
        first_row = torch.arange(B, device=parents.device)[:, None] * K_cur  # (B, 1)
        rows = (first_row + parents).view(-1)  # (B * K,): each new beam's parent in `prefixes`
        prefixes = torch.cat([prefixes[rows], tokens.view(-1, 1)], dim=1)  # (B * K, t + 2)
        memory, attention_mask = _follow_parents(cache, rows, memory, attention_mask, step)
        done |= _sentences_done(finished, beam_scores, step + 1, early_stopping)
        if bool(done.all()):
            logger.debug("beam search: every sentence done after %d steps", step + 1)
            break
    _add_unfinished(finished, done, prefixes, beam_scores)
    return _best(finished, num_return_sequences, config, memory.device)


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    length_penalty: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely next token at every step (beam search with one beam), cached.

    Same arguments and results as `beam_search`: (sequences (B, L_out), scores (B,)), each
    sequence [bos, ..., eos] padded with pad_token_id, scored as there.
    """
    _check_arguments(model, max_new_tokens, 1, length_penalty, True)
    config = model.config
    memory = model.encode(input_ids, attention_mask)  # (B, L_src, E)
    B = memory.shape[0]
    sequences = _start_tokens(config, B, memory.device)  # (B, 1)
    sum_logprobs = memory.new_zeros(B, dtype=torch.float32)
    lengths = torch.zeros(B, dtype=torch.long, device=memory.device)
    finished = torch.zeros(B, dtype=torch.bool, device=memory.device)
    cache = model.new_decoder_cache(B, max(1, max_new_tokens))
    for _ in range(max_new_tokens):
        logprobs = _next_logprobs(model, sequences, memory, attention_mask, cache)  # (B, V)
        best_logprob, chosen = logprobs.max(dim=-1)  # (B,), (B,)
        chosen = torch.where(finished, config.pad_token_id, chosen)
        sum_logprobs += torch.where(finished, 0.0, best_logprob)
        lengths += (~finished).long()
        finished |= chosen == config.eos_token_id
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)  # (B, t + 2)
        if bool(finished.all()):
            break
    scores = sum_logprobs / lengths.clamp(min=1).float() ** length_penalty
    return sequences, scores


def _follow_parents(cache: DecoderCache, rows: torch.Tensor, memory, attention_mask, step: int):
    """Reorder the cache so that row i holds the keys/values of beam i's parent, rows[i]."""
    if step > 0:  # beams only move within their sentence, which shares one cross-attention
        cache.reorder_self_attention(rows)
        return memory, attention_mask
    # the first step: B sentences become B * K beams, the memory's keys/values are repeated once
    cache.reorder(rows)
    return memory[rows], None if attention_mask is None else attention_mask[rows]


def _next_logprobs(model, prefixes, memory, attention_mask, cache: DecoderCache):
    """Feed each row's newest token; log-probabilities of the token after it, (rows, V), fp32."""
    logits = model.decode(prefixes[:, -1:], memory, memory_mask=attention_mask, cache=cache)
    return torch.log_softmax(logits[:, -1].float(), dim=-1)


def _top_candidates(candidates: torch.Tensor, num_beams: int, config):
    """The best 2K (beam, token) pairs of each sentence, best first, from candidates
    (B, K_cur, V): (scores, parents, tokens, is_eos), each (B, 2K).

    With fewer than 2K pairs (first steps, tiny vocabularies) the rest is filled with
    impossible (-inf, non-EOS) pairs, so that K non-EOS pairs always exist: at most K_cur <= K
    of the pairs end in EOS (one per beam).
    """
    B, K_cur, V = candidates.shape
    width = 2 * num_beams
    top_scores, top_index = candidates.view(B, K_cur * V).topk(min(width, K_cur * V), dim=1)
    parents, tokens = top_index // V, top_index % V  # (B, width'): which beam, which token
    is_eos = tokens == config.eos_token_id
    missing = width - top_scores.shape[1]
    if missing:
        top_scores = torch.cat([top_scores, top_scores.new_full((B, missing), -math.inf)], 1)
        parents = torch.cat([parents, parents.new_zeros(B, missing)], dim=1)
        tokens = torch.cat([tokens, tokens.new_full((B, missing), config.pad_token_id)], dim=1)
        is_eos = torch.cat([is_eos, is_eos.new_zeros(B, missing)], dim=1)
    return top_scores, parents, tokens, is_eos


def _add_finished(finished, done, prefixes, top_scores, parents, is_eos, length: int, config):
    """Move the EOS pairs ranked among the best K of a sentence not yet done to its finished
    list (a lower-ranked EOS pair is beaten by K unfinished ones, as in transformers)."""
    num_beams = top_scores.shape[1] // 2
    B = top_scores.shape[0]
    eligible = is_eos[:, :num_beams] & torch.isfinite(top_scores[:, :num_beams]) & ~done[:, None]
    sentences, ranks = eligible.nonzero().unbind(dim=1)  # (N,), (N,)
    if sentences.numel() == 0:
        return
    rows = sentences * (prefixes.shape[0] // B) + parents[sentences, ranks]  # rows of `prefixes`
    for sentence, tokens, score in zip(
        sentences.tolist(), prefixes[rows].tolist(), top_scores[sentences, ranks].tolist(),
        strict=True,
    ):  # fmt: skip
        finished[sentence].add(tokens + [config.eos_token_id], score, length)


def _keep_unfinished(top_scores, parents, tokens, is_eos):
    """The K best non-EOS pairs of each sentence, best first: (scores, parents, tokens) (B, K)."""
    width = top_scores.shape[1]
    rank = torch.arange(width, device=top_scores.device)  # (2K,)
    order = (is_eos.long() * width + rank).argsort(dim=1)[:, : width // 2]  # non-EOS first
    return top_scores.gather(1, order), parents.gather(1, order), tokens.gather(1, order)


def _sentences_done(finished, beam_scores, length: int, early_stopping: bool) -> torch.Tensor:
    best_alive = beam_scores.max(dim=1).values.tolist()  # (B,) sums of log-probs
    flags = [
        hyps.is_done(best, length, early_stopping)
        for hyps, best in zip(finished, best_alive, strict=True)
    ]
    return torch.tensor(flags, dtype=torch.bool, device=beam_scores.device)


def _add_unfinished(finished, done, prefixes, beam_scores) -> None:
    """Sentences cut by max_new_tokens: their live beams compete with the finished ones."""
    B, K = beam_scores.shape
    length = prefixes.shape[1] - 1  # new tokens, the start token excluded
    scores = beam_scores.tolist()
    for sentence in (~done).nonzero().flatten().tolist():
        for beam in range(K):
            if math.isfinite(scores[sentence][beam]):
                tokens = prefixes[sentence * K + beam].tolist()
                finished[sentence].add(tokens, scores[sentence][beam], length)


def _best(finished, count: int, config, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` best hypotheses of each sentence, padded with pad_token_id: (B * count,
    L_out), (B * count,). A sentence with fewer (a vocabulary smaller than the beam) gets
    [bos] rows scored -inf."""
    start = (-math.inf, [config.bos_token_id])
    best = [(hyps.hypotheses + [start] * count)[:count] for hyps in finished]
    best = [hypothesis for hypotheses in best for hypothesis in hypotheses]
    L_out = max(len(tokens) for _, tokens in best)
    sequences = torch.full((len(best), L_out), config.pad_token_id, dtype=torch.long)
    for row, (_, tokens) in enumerate(best):
        sequences[row, : len(tokens)] = torch.tensor(tokens)
    scores = torch.tensor([score for score, _ in best], dtype=torch.float32)
    return sequences.to(device), scores.to(device)


def _start_tokens(config, batch: int, device) -> torch.Tensor:
    return torch.full((batch, 1), config.bos_token_id, dtype=torch.long, device=device)


def _check_return_count(num_return_sequences: object, num_beams: int) -> None:
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int):
        raise TypeError(
            f"num_return_sequences: expected an int, got {type(num_return_sequences).__name__}"
        )
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(
            f"num_return_sequences: expected 1 .. num_beams={num_beams}, got {num_return_sequences}"
        )


def _check_arguments(model, max_new_tokens, num_beams, length_penalty, early_stopping) -> None:
    if not isinstance(model, Transformer):
        raise TypeError(
            f"model: expected a qkv.models.Transformer (encoder-decoder), got "
            f"{type(model).__name__}; decoder-only models decode with qkv.generate"
        )
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_int("num_beams", num_beams, minimum=1)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise TypeError(f"length_penalty: expected a float, got {type(length_penalty).__name__}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty: expected a finite float, got {length_penalty}")
    if not isinstance(early_stopping, bool):
        raise TypeError(f"early_stopping: expected a bool, got {type(early_stopping).__name__}")
