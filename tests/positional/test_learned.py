"""Learned position embeddings against torch.nn.Embedding, the GPT-2/BERT initialisation
(checked statistically) and the hard length limit."""

import pytest
import torch
from torch import nn

from qkv.positional import LearnedPositionalEmbedding


def test_lookup_and_gradients_match_nn_embedding():
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(12, 6)
    reference = nn.Embedding(12, 6)
    reference.weight.data.copy_(module.weight.data)
    positions = torch.tensor([[0, 5, 11], [3, 3, 7]])
    out = module(positions)
    expected = reference(positions)
    assert out.shape == (2, 3, 6)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(module.weight.grad, reference.weight.grad)
    assert list(module.state_dict()) == ["weight"]
    assert isinstance(module.weight, nn.Parameter) and module.weight.shape == (12, 6)


def test_initialisation_is_normal_with_std_002():
    """N(0, 0.02^2) as in GPT-2/BERT: with n = 262144 draws, the sample std lies within 1% of
    0.02 (its standard error is 0.02 / sqrt(2n) ~ 0.14%) and the mean within 5 standard errors."""
    torch.manual_seed(1)
    weight = LearnedPositionalEmbedding(4096, 64).weight.detach().double()
    n = weight.numel()
    assert abs(weight.std().item() - 0.02) < 0.01 * 0.02
    assert abs(weight.mean().item()) < 5 * 0.02 / n**0.5


def test_out_of_range_positions_raise():
    module = LearnedPositionalEmbedding(10, 4)
    with pytest.raises(ValueError, match=r"positions: got a maximum of 10.*max_positions=10"):
        module(torch.tensor([[0, 9], [10, 2]]))
    with pytest.raises(ValueError, match=r"positions: got a maximum of 57.*max_positions=10"):
        module(torch.tensor([57]))
    with pytest.raises(ValueError, match=r"positions: expected positions >= 0.*minimum of -3"):
        module(torch.tensor([1, -3]))
    assert module(torch.tensor([9])).shape == (1, 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"max_positions: expected an int >= 1, got 0"):
        LearnedPositionalEmbedding(0, 4)
    with pytest.raises(TypeError, match=r"dim: expected an int >= 1, got str '4'"):
        LearnedPositionalEmbedding(8, "4")
    module = LearnedPositionalEmbedding(8, 4)
    with pytest.raises(TypeError, match=r"positions: expected an integer tensor.*float32"):
        module(torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"positions: expected a torch.Tensor, got list"):
        module([1, 2])
