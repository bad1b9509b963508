"""Beam search, the decoding strategy that keeps several prefixes per prompt
(qkv.generation.loop; greedy and sampling: qkv.generation.strategies).

`BeamSearch` keeps the `num_beams` best unfinished prefixes of each prompt (Vaswani et al. 2017
section 6.1 decode with 4 beams and a length penalty of alpha = 0.6). Each step adds every
prefix's next-token log-probabilities to its score, takes the top 2 * num_beams (prefix, token)
pairs over beams x vocabulary, moves the pairs that end in EOS to a list of finished
hypotheses, and keeps the best num_beams others as the new beams, each naming its parent row so
that the model's caches follow it. Finished hypotheses are ranked by

    score = sum of log-probabilities / generated_length ** length_penalty

where generated_length counts the new tokens, EOS included, not the prompt (or start token).
This is the convention of Hugging Face transformers' beam search, a simpler form of the length
normalisation of Wu et al. 2016 (GNMT, section 7: lp(Y) = (5 + |Y|)^a / 6^a); the bookkeeping
(2 * num_beams candidates, an EOS candidate counts only if it ranks among the best num_beams,
`early_stopping`) also follows transformers, so num_beams=1 is exactly greedy search.
"""

from __future__ import annotations

import math

import torch

from qkv.generation.loop import Choice, Logits

__all__ = ["BeamSearch"]


class BeamSearch:
    """Beam search over B prompts (see the module docstring).

    prompts (B, L0): what every hypothesis starts with (a decoder-only model's prompt, or the
    encoder-decoder's start token). eos_token_id None: hypotheses end only at max_new_tokens.
    `result(count)` gives the best hypotheses once the loop has ended.
    """

    def __init__(
        self, prompts: torch.Tensor, *, num_beams: int, length_penalty: float,
        early_stopping: bool, eos_token_id: int | None, fill_token_id: int,
    ) -> None:  # fmt: skip
        B = prompts.shape[0]
        self.prompts, self.prefixes = prompts, prompts  # prefixes (B * K_cur, L0 + t)
        self.num_beams, self.early_stopping = num_beams, early_stopping
        self.eos_token_id, self.fill_token_id = eos_token_id, fill_token_id
        self.hypotheses = [_FinishedHypotheses(num_beams, length_penalty) for _ in range(B)]
        self.done = torch.zeros(B, dtype=torch.bool, device=prompts.device)
        self.beam_scores = torch.zeros(B, 1, device=prompts.device)  # (B, K_cur): sum log-probs

    def choose(self, logits: Logits, step: int) -> Choice:
        B, K_cur = self.beam_scores.shape
        logprobs = torch.log_softmax(logits.logits.float(), dim=-1)  # (B * K_cur, V)
        candidates = self.beam_scores[:, :, None] + logprobs.view(B, K_cur, -1)
        top_scores, parents, tokens, is_eos = self._top_candidates(candidates)  # (B, 2K) each
        self._add_finished(top_scores, parents, is_eos, length=step + 1)
        self.beam_scores, parents, tokens = _keep_unfinished(top_scores, parents, tokens, is_eos)
        first_row = torch.arange(B, device=parents.device)[:, None] * K_cur  # (B, 1)
        rows = (first_row + parents).view(-1)  # (B * K,): each new beam's parent row
        self.prefixes = torch.cat([self.prefixes[rows], tokens.view(-1, 1)], dim=1)
        self.done |= self._sentences_done(length=step + 1)
        # the first step turns B prompts into B * K rows: rows are then their prompts too
        return Choice(tokens.view(-1), rows, rows if step == 0 else None, self.done)

    def result(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `count` best hypotheses of each prompt, best first, padded with fill_token_id:
        (sequences (B * count, L_out), scores (B * count,) fp32). A prompt with fewer
        hypotheses (a vocabulary smaller than the beam) gets its bare prompt scored -inf; with
        no step taken (max_new_tokens=0), the bare prompt is the only hypothesis, scored 0."""
        L0 = self.prompts.shape[1]
        if self.prefixes.shape[1] == L0:
            best = [(0.0, row) for row in self.prompts.tolist() for _ in range(count)]
        else:
            self._add_unfinished()
            prompts = self.prompts.tolist()
            best = []
            for hypotheses, prompt in zip(self.hypotheses, prompts, strict=True):
                found = hypotheses.best[:count]
                best += found + [(-math.inf, prompt)] * (count - len(found))
        L_out = max(len(tokens) for _, tokens in best)
        sequences = torch.full((len(best), L_out), self.fill_token_id, dtype=torch.long)
        for row, (_, tokens) in enumerate(best):
            sequences[row, : len(tokens)] = torch.tensor(tokens)
        scores = torch.tensor([score for score, _ in best], dtype=torch.float32)
        return sequences.to(self.prompts.device), scores.to(self.prompts.device)

    def _top_candidates(self, candidates: torch.Tensor):
        """The best 2K (beam, token) pairs of each prompt, best first, from candidates
        (B, K_cur, V): (scores, parents, tokens, is_eos), each (B, 2K).

        With fewer than 2K pairs (first steps, tiny vocabularies) the rest is filled with
        impossible (-inf, non-EOS) pairs, so that K non-EOS pairs always exist: at most
        K_cur <= K of the pairs end in EOS (one per beam)."""
        B, K_cur, V = candidates.shape
        width = 2 * self.num_beams
        top_scores, top_index = candidates.view(B, K_cur * V).topk(min(width, K_cur * V), dim=1)
        parents, tokens = top_index // V, top_index % V  # (B, width'): which beam, which token
        if self.eos_token_id is None:
            is_eos = torch.zeros_like(tokens, dtype=torch.bool)
        else:
            is_eos = tokens == self.eos_token_id
        missing = width - top_scores.shape[1]
        if missing:
            top_scores = torch.cat([top_scores, top_scores.new_full((B, missing), -math.inf)], 1)
            parents = torch.cat([parents, parents.new_zeros(B, missing)], dim=1)
            tokens = torch.cat([tokens, tokens.new_full((B, missing), self.fill_token_id)], 1)
            is_eos = torch.cat([is_eos, is_eos.new_zeros(B, missing)], dim=1)
        return top_scores, parents, tokens, is_eos

    def _add_finished(self, top_scores, parents, is_eos, length: int) -> None:
        """Move the EOS pairs ranked among the best K of a prompt not yet done to its finished
        list (a lower-ranked EOS pair is beaten by K unfinished ones, as in transformers)."""
        K = self.num_beams
        eligible = is_eos[:, :K] & torch.isfinite(top_scores[:, :K]) & ~self.done[:, None]
        sentences, ranks = eligible.nonzero().unbind(dim=1)  # (N,), (N,)
        if sentences.numel() == 0:
            return
        B = top_scores.shape[0]
        rows = sentences * (self.prefixes.shape[0] // B) + parents[sentences, ranks]
        for sentence, tokens, score in zip(
            sentences.tolist(), self.prefixes[rows].tolist(),
            top_scores[sentences, ranks].tolist(), strict=True,
        ):  # fmt: skip
            self.hypotheses[sentence].add(tokens + [self.eos_token_id], score, length)

    def _sentences_done(self, length: int) -> torch.Tensor:
        best_alive = self.beam_scores.max(dim=1).values.tolist()  # (B,) sums of log-probs
        flags = [
            hypotheses.is_done(best, length, self.early_stopping)
            for hypotheses, best in zip(self.hypotheses, best_alive, strict=True)
        ]
        return torch.tensor(flags, dtype=torch.bool, device=self.done.device)

    def _add_unfinished(self) -> None:
        """Prompts cut by max_new_tokens: their live beams compete with the finished ones."""
        B, K = self.beam_scores.shape
        length = self.prefixes.shape[1] - self.prompts.shape[1]  # new tokens
        scores = self.beam_scores.tolist()
        for sentence in (~self.done).nonzero().flatten().tolist():
            for beam in range(K):
                if math.isfinite(scores[sentence][beam]):
                    tokens = self.prefixes[sentence * K + beam].tolist()
                    self.hypotheses[sentence].add(tokens, scores[sentence][beam], length)
        self.done[:] = True  # once: a second `result` finds them added


class _FinishedHypotheses:
    """The best `num_beams` finished hypotheses of one prompt (transformers' BeamHypotheses)."""

    def __init__(self, num_beams: int, length_penalty: float) -> None:
        self.num_beams, self.length_penalty = num_beams, length_penalty
        self.best: list[tuple[float, list[int]]] = []  # (score, tokens), best first

    def add(self, tokens: list[int], sum_logprob: float, generated_length: int) -> None:
        score = sum_logprob / generated_length**self.length_penalty
        self.best.append((score, tokens))
        self.best.sort(key=lambda hypothesis: hypothesis[0], reverse=True)
        del self.best[self.num_beams :]

    def is_done(
        self, best_alive_sum_logprob: float, generated_length: int, early_stop: bool
    ) -> bool:
        """Full, and (unless early_stop) no unfinished beam can still beat the worst finished
        one if it ended now (transformers' heuristic: exact for length_penalty <= 0 only)."""
        if len(self.best) < self.num_beams:
            return False
        if early_stop:
            return True
        best_possible = best_alive_sum_logprob / generated_length**self.length_penalty
        return self.best[-1][0] >= best_possible


def _keep_unfinished(top_scores, parents, tokens, is_eos):
    """The K best non-EOS pairs of each prompt, best first: (scores, parents, tokens) (B, K)."""
    width = top_scores.shape[1]
    rank = torch.arange(width, device=top_scores.device)  # (2K,)
    order = (is_eos.long() * width + rank).argsort(dim=1)[:, : width // 2]  # non-EOS first
    return top_scores.gather(1, order), parents.gather(1, order), tokens.gather(1, order)
