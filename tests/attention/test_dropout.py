"""qkv's dropout (16 random bits per element on the CPU) against PyTorch's F.dropout: the same
distribution (checked statistically), exact scaling and gradients, reproducible masks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.attention.dropout import dropout
from qkv.layers._dropout import make_dropout

N = 1 << 22  # elements per statistical check: 5 sigma of a fraction is ~0.0012 at p = 0.5


def _within_sigmas(fraction: float, probability: float, n: int, sigmas: float = 5.0) -> bool:
    return abs(fraction - probability) < sigmas * (probability * (1 - probability) / n) ** 0.5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_and_mean_match_pytorch_dropout(p):
    torch.manual_seed(0)
    x = torch.ones(N)
    ours, theirs = dropout(x, p), F.dropout(x, p)
    for y in (ours, theirs):
        assert _within_sigmas((y == 0).double().mean().item(), p, N)
    # each kept element is x / (1 - p), to within the 2^-16 grid of the keep probability: the
    # keep probability is off by at most 2^-17, its inverse by 2^-17 / (1 - p) relatively
    kept_value, their_kept_value = ours[ours != 0].unique(), theirs[theirs != 0].unique()
    assert kept_value.numel() == their_kept_value.numel() == 1
    rtol = 2**-17 / (1 - p) + 1e-7
    torch.testing.assert_close(kept_value, their_kept_value, rtol=rtol, atol=0)
    assert abs(ours.mean().item() - 1.0) < 5 * (p / (1 - p) / N) ** 0.5  # unbiased


def test_the_four_lanes_of_a_draw_are_independent():
    """One 64-bit draw masks four neighbouring elements: each lane keeps at the asked rate, and
    neighbours are kept together at rate (1 - p)^2, as independent draws would be."""
    torch.manual_seed(1)
    p = 0.3
    kept = dropout(torch.ones(N), p) != 0
    lanes = kept.view(-1, 4)  # (N / 4, 4): the four lanes of each draw
    for lane in range(4):
        assert _within_sigmas(lanes[:, lane].double().mean().item(), 1 - p, N // 4)
    both = (lanes[:, :3] & lanes[:, 1:]).double().mean().item()
    assert _within_sigmas(both, (1 - p) ** 2, 3 * N // 4)


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(2)
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    y = dropout(x, 0.25)  # 0.75 * 2^16 is whole: keep probability and scale 4/3 are exact
    upstream = torch.randn_like(y)
    y.backward(upstream)
    kept = y != 0
    assert torch.equal(y, torch.where(kept, x * (4 / 3), 0.0))
    assert torch.equal(x.grad, torch.where(kept, upstream * (4 / 3), 0.0))


def test_masks_are_reproducible_from_a_seed_or_a_generator():
    x = torch.randn(1000)
    torch.manual_seed(3)
    first = dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.5), first)
    generator = torch.Generator().manual_seed(4)
    a = dropout(x, 0.5, generator=generator)
    assert torch.equal(dropout(x, 0.5, generator=torch.Generator().manual_seed(4)), a)
    assert not torch.equal(dropout(x, 0.5, generator=generator), a)  # the generator advanced


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_edges_and_dtypes(dtype):
    x = torch.randn(3, 5).to(dtype)
    assert dropout(x, 0.0) is x and dropout(x, 0.7, training=False) is x
    assert dropout(x, 0.5).dtype == dtype
    inf = torch.full((4,), float("inf"), dtype=dtype, requires_grad=True)
    gone = dropout(inf, 1.0)
    assert torch.equal(gone, torch.zeros(4, dtype=dtype))
    gone.sum().backward()
    assert torch.equal(inf.grad, torch.zeros(4, dtype=dtype))
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="p: expected a probability in"):
            dropout(x, bad)


def test_the_module_is_an_nn_dropout_and_follows_train_and_eval():
    module = make_dropout(0.2)
    assert type(module) is nn.Dropout and module.p == 0.2  # PyTorch's own block
    x = torch.ones(10_000)
    torch.manual_seed(5)
    assert (module(x) == 0).any()
    assert module.eval()(x) is x
    assert isinstance(make_dropout(0.0), nn.Identity)


def test_auto_runs_cpu_attention_dropout_on_the_reference_backend():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    text = qkv.explain(q, k, v, dropout_p=0.1)
    assert text.startswith("backend 'reference'") and "bernoulli_" in text
    assert qkv.explain(q, k, v).startswith("backend 'sdpa'")  # without dropout: SDPA as before
