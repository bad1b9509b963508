"""Sampling: seeds reproduce, top-k / top-p never leave their kept set, temperature -> 0 is greedy.

The kept sets and probabilities are computed here from scratch in float64 with numpy (sort the
probabilities, accumulate), not with qkv's filters; draws are checked against them over many
samples, and frequencies against the probabilities within 5 standard deviations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv.generation import decode_steps, generate, next_token
from tests.generation.reference_models import qkv_model

V = 50
DRAWS = 20_000


def _logits(seed: int = 0) -> torch.Tensor:
    """(2, V) logits, two different rows, spread enough for a long tail."""
    return torch.randn(2, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def _top_k_set(probs: np.ndarray, top_k: int) -> set[int]:
    return set(np.argsort(-probs, kind="stable")[:top_k].tolist())


def _top_p_set(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose probabilities sum to >= top_p."""
    kept, total = set(), 0.0
    for token in np.argsort(-probs, kind="stable"):
        kept.add(int(token))
        total += probs[token]
        if total >= top_p:
            break
    return kept


def _draw(logits: torch.Tensor, **sampling) -> np.ndarray:
    """DRAWS samples for each row of logits (R, V) -> (R, DRAWS), in one batched call."""
    rows = logits.shape[0]
    repeated = logits.repeat_interleave(DRAWS, dim=0)  # (R * DRAWS, V)
    generator = torch.Generator().manual_seed(1234)
    tokens = next_token(repeated, generator=generator, **sampling)
    return tokens.view(rows, DRAWS).numpy()


def _assert_frequencies(draws: np.ndarray, probs: np.ndarray) -> None:
    """Empirical frequencies within 5 sigma (+ a small floor) of the expected probabilities."""
    frequencies = np.bincount(draws, minlength=len(probs)) / len(draws)
    sigma = np.sqrt(probs * (1 - probs) / len(draws))
    assert np.all(np.abs(frequencies - probs) <= 5 * sigma + 1e-4)


def _renormalised(probs: np.ndarray, kept: set[int]) -> np.ndarray:
    inside = np.zeros_like(probs)
    inside[sorted(kept)] = probs[sorted(kept)]
    return inside / inside.sum()


@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k_draws_only_from_the_k_most_likely(top_k):
    logits = _logits()
    draws = _draw(logits, temperature=1.0, top_k=top_k)
    for row in range(logits.shape[0]):
        probs = _softmax(logits[row].double().numpy())
        kept = _top_k_set(probs, top_k)
        assert set(draws[row].tolist()) == kept  # never outside, and every kept token is seen
        _assert_frequencies(draws[row], _renormalised(probs, kept))


@pytest.mark.parametrize("quantile", [0.3, 0.75, 0.95])
def test_top_p_draws_only_from_the_nucleus(quantile):
    logits = _logits(seed=1)
    for row in range(logits.shape[0]):
        probs = _softmax(logits[row].double().numpy())
        # top_p halfway between two cumulative sums, so float rounding cannot move the boundary
        cumulative = np.cumsum(np.sort(probs)[::-1])
        boundary = int(np.searchsorted(cumulative, quantile))
        top_p = float((cumulative[boundary] + cumulative[boundary - 1]) / 2) if boundary else 0.01
        kept = _top_p_set(probs, top_p)
        draws = _draw(logits[row : row + 1], temperature=1.0, top_p=top_p)[0]
        likely = {t for t in kept if _renormalised(probs, kept)[t] > 1e-3}  # >= 20 expected
        assert likely <= set(draws.tolist()) <= kept
        _assert_frequencies(draws, _renormalised(probs, kept))


def test_temperature_then_top_k_then_top_p():
    """The order transformers' warpers use too: scale by 1/T, keep the top k, renormalise, then
    keep the nucleus of what is left."""
    logits, temperature, top_k, top_p = _logits(seed=2)[:1], 0.7, 8, 0.8
    probs = _softmax(logits[0].double().numpy() / temperature)
    after_k = _renormalised(probs, _top_k_set(probs, top_k))
    kept = _top_p_set(after_k, top_p)
    assert len(kept) < top_k  # the nucleus really cut into the top k
    draws = _draw(logits, temperature=temperature, top_k=top_k, top_p=top_p)[0]
    assert set(draws.tolist()) <= kept
    _assert_frequencies(draws, _renormalised(after_k, kept))


@pytest.mark.parametrize("temperature", [2.0, 1.0, 0.5, 0.1])
def test_temperature_draws_follow_softmax_of_logits_over_temperature(temperature):
    logits = _logits(seed=3)[:1]
    draws = _draw(logits, temperature=temperature)[0]
    _assert_frequencies(draws, _softmax(logits[0].double().numpy() / temperature))


def test_temperature_towards_zero_approaches_greedy():
    """P(draw = argmax) follows softmax(logits / T)[argmax], which rises to 1 as T -> 0."""
    logits = _logits(seed=4)
    greedy = logits.argmax(dim=-1).numpy()
    expected_rates = []
    for temperature in (1.0, 0.3, 0.1, 1e-3):
        draws = _draw(logits, temperature=temperature)
        for row in range(logits.shape[0]):
            p_greedy = _softmax(logits[row].double().numpy() / temperature)[greedy[row]]
            sigma = np.sqrt(p_greedy * (1 - p_greedy) / DRAWS)
            assert abs((draws[row] == greedy[row]).mean() - p_greedy) <= 5 * sigma + 1e-4
            expected_rates.append(p_greedy)
    rates = np.array(expected_rates).reshape(4, logits.shape[0])
    assert np.all(np.diff(rates, axis=0) > 0) and rates[0].max() < 0.6  # from far, towards 1
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.05  # at T = 1e-3, P(miss) < V * exp(-50)
    assert np.all(_draw(logits, temperature=1e-3) == greedy[:, None])


def test_a_tiny_temperature_generates_the_greedy_tokens():
    model = qkv_model("tiny-llama")
    prompt = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(5))
    greedy_steps = list(decode_steps(model, prompt, max_new_tokens=20))
    margins = [s.logits.topk(2, dim=-1).values for s in greedy_steps]
    smallest_margin = min(float((m[:, 0] - m[:, 1]).min()) for m in margins)
    temperature = 1e-5
    assert smallest_margin / temperature > 50  # P(any other token) < 20 * V * exp(-50)
    sampled = generate(model, prompt, max_new_tokens=20, temperature=temperature, seed=0)
    greedy = torch.stack([s.tokens for s in greedy_steps], dim=1)
    assert torch.equal(sampled[:, 6:], greedy)


def _sample(model, prompt, seed, **sampling):
    return generate(model, prompt, max_new_tokens=40, temperature=1.0, seed=seed, **sampling)


@pytest.mark.parametrize("sampling", [{}, {"top_k": 20}, {"top_p": 0.9}], ids=["plain", "k", "p"])
def test_a_seed_reproduces_the_tokens_and_another_seed_does_not(sampling):
    model = qkv_model("tiny-llama")
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(100)  # the global generator's state must not matter
    first = _sample(model, prompt, seed=7, **sampling)
    torch.manual_seed(200)
    again = _sample(model, prompt, seed=7, **sampling)
    other = _sample(model, prompt, seed=8, **sampling)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # each of the two rows differs: a different seed changes whole runs, not one token
    assert bool((first[:, 5:] != other[:, 5:]).sum(dim=1).ge(5).all())


def _awkward_logits() -> torch.Tensor:
    """(6, V) rows where an argmax can go wrong: ties for the max, a NaN (two, with a larger
    value between them), +inf, -inf everywhere, -inf but one, -0.0 tied with 0.0."""
    logits = _logits(3).repeat(3, 1)  # (6, V)
    logits[0, [4, 9, 30]] = 10.0
    logits[1, 7], logits[1, 8], logits[1, 20] = float("nan"), 1e30, float("nan")
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")
    logits[4] = float("-inf")
    logits[4, 42] = -5.0
    logits[5] = -1.0
    logits[5, 3], logits[5, 6] = -0.0, 0.0
    return logits


@pytest.mark.parametrize("layout", ["contiguous", "strided", "bf16", "no rows"])
def test_greedy_picks_what_torch_argmax_picks(layout):
    """temperature 0 is torch.argmax's choice, first index on ties and a NaN counting as the
    largest, whichever path computes it (NumPy for fp32 CPU logits, torch otherwise)."""
    logits = _awkward_logits()
    if layout == "strided":
        logits = logits.t().contiguous().t()  # the same values, column-major
    elif layout == "bf16":
        logits = logits.bfloat16()
    elif layout == "no rows":
        logits = logits[:0]
    chosen = next_token(logits)
    expected = logits.argmax(dim=-1)
    assert chosen.dtype == torch.int64 and chosen.device == logits.device
    assert torch.equal(chosen, expected)
    if layout != "no rows":
        assert chosen.tolist()[:3] == [4, 7, 11]


@pytest.mark.parametrize("temperature", [1e-45, 1e-30])
def test_the_smallest_temperatures_draw_the_largest_logit(temperature):
    """logits / 1e-45 overflowed to inf, and softmax gave NaN ("probability tensor contains
    inf"); shifted by the row's maximum first, the draw is the argmax."""
    logits = _logits(seed=4)
    draws = next_token(logits, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws, logits.argmax(dim=-1))
