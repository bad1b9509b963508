"""`auto` chooses its backend at every call, from the checked request: repeated calls of one
signature give PyTorch's SDPA results, an option of another type is refused however often the
call went through before, and a backend registered between two calls is seen by the second."""

import pytest
import torch

import qkv
from tests.attention.reference_math import sdpa_reference


def _qkv(L_q=5, L_k=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, L_q, 8), (2, 2, L_k, 8), (2, 2, L_k, 8))  # q, k, v: GQA, 4 heads over 2
    return [torch.randn(shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"window": 3},
        {"mask": torch.tensor([[True] * 7] * 4 + [[False] * 7])},  # the last query sees nothing
        {"scale": 0.3},
    ],
)
def test_repeated_signatures_with_new_values_match_sdpa(options):
    for seed in range(3):
        q, k, v = _qkv(seed=seed)
        expected = sdpa_reference(q, k, v, **options)
        torch.testing.assert_close(qkv.attention(q, k, v, **options), expected)


@pytest.mark.parametrize(
    ("good", "bad", "error", "match"),
    [
        ({"causal": True}, {"causal": 1}, TypeError, "causal: expected a bool, got int 1"),
        ({"scale": 1}, {"scale": True}, TypeError, "scale: expected a float or None, got bool"),
        ({"dropout_p": 0}, {"dropout_p": False}, TypeError, "dropout_p: expected a float"),
        ({"window": (1, 1)}, {"window": (True, 1)}, ValueError, "window: expected an int >= 1"),
        ({"return_weights": False}, {"return_weights": 0}, TypeError, "return_weights"),
    ],
)
def test_a_repeated_signature_still_refuses_an_option_of_another_type(good, bad, error, match):
    """True == 1 == 1.0 in Python, but not for the checks, however often the good call ran."""
    q, k, v = _qkv()
    qkv.attention(q, k, v, **good)
    qkv.attention(q, k, v, **good)
    with pytest.raises(error, match=match):
        qkv.attention(q, k, v, **bad)


def test_a_new_backend_is_seen_by_a_repeated_signature():
    """A faster backend registered between two calls of one signature gets the second."""
    q, k, v = _qkv()
    qkv.attention(q, k, v, causal=True)
    calls = []

    class Eager:  # serves everything, with the outside reference
        name, summary = "test-eager", "SDPA reference, recording its calls"

        @staticmethod
        def why_not(request):
            return None

        @staticmethod
        def notes(request):
            return []

        @staticmethod
        def run(request):
            calls.append(request)
            return sdpa_reference(request.q, request.k, request.v, causal=request.causal), None

    before = dict(qkv.BACKENDS)
    try:
        qkv.register_backend(Eager, before="triton")
        output = qkv.attention(q, k, v, causal=True)
        assert len(calls) == 1
        torch.testing.assert_close(output, sdpa_reference(q, k, v, causal=True))
        assert qkv.explain(q, k, v, causal=True).startswith("backend 'test-eager'")
    finally:
        qkv.BACKENDS.clear()
        qkv.BACKENDS.update(before)
        qkv.register_backend(before["reference"])  # back in place, last
    assert list(qkv.BACKENDS) == list(before)
    qkv.attention(q, k, v, causal=True)
    assert len(calls) == 1


PLAIN_OPTIONS = {  # (L_q, L_k) -> options
    "none": lambda L_q, L_k: {},
    "causal": lambda L_q, L_k: {"causal": True},
    "bool mask": lambda L_q, L_k: {"mask": torch.rand(L_q, L_k) > 0.3},
    "float mask": lambda L_q, L_k: {"mask": torch.randn(L_q, L_k)},
    "bias": lambda L_q, L_k: {"bias": torch.randn(1, 4, L_q, L_k)},
    "lengths": lambda L_q, L_k: {"lengths": torch.tensor([L_k, L_k // 2])},
    "dropout": lambda L_q, L_k: {"dropout_p": 0.1},
    "weights": lambda L_q, L_k: {"return_weights": True},
}


@pytest.mark.parametrize("kind", PLAIN_OPTIONS)
@pytest.mark.parametrize("sizes", [(5, 7), (1, 700), (600, 600)], ids=["small", "step", "large"])
def test_a_plain_call_takes_what_the_walk_over_every_backend_takes(sizes, kind):
    """`auto` sends a plain call to SDPA without asking the backends ahead of it: each of them
    passes such a call over, so the whole walk gives the same backend (and explain says so)."""
    from qkv.attention.core import _why_not_auto
    from qkv.attention.request import AttentionRequest

    q, k, v = _qkv(*sizes)
    options = PLAIN_OPTIONS[kind](*sizes)
    request = AttentionRequest(q, k, v, **options)
    assert request.plain
    walked = next(b for b in qkv.BACKENDS.values() if _why_not_auto(b, request) is None)
    text = qkv.explain(q, k, v, **options)
    assert text.startswith(f"backend {walked.name!r}")
    taken_at_once = "taken without asking the others" in text
    assert taken_at_once == (walked.name == "sdpa")
