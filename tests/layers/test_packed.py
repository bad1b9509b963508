"""oneDNN-packed linears: the same outputs as F.linear (float64 reference), the same greedy
tokens and logits in a whole model, and the model given back untouched."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.generation import generate
from qkv.layers import PackedLinear, packed_linears
from qkv.models import GPT, GPTConfig
from tests.layers.helpers import randomize_


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 7, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(dtype, atol, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(shape).to(dtype)
    exact = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    plain, packed = linear(x), PackedLinear(linear)(x)
    assert packed.shape == plain.shape == (*shape[:-1], 96) and packed.dtype == dtype
    # packed is as close to the float64 product as PyTorch's own kernel is
    plain_error = (plain.double() - exact).abs().max().item()
    torch.testing.assert_close(packed.double(), exact, atol=max(atol, 2 * plain_error), rtol=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_packed_model_gives_the_same_logits_and_tokens_and_is_given_back(name):
    torch.manual_seed(0)
    model = randomize_(GPT(GPTConfig.from_name(name)), std=0.1).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids).logits
    tokens = generate(model, ids, max_new_tokens=12)
    with packed_linears(model) as same:
        assert same is model and not torch.is_grad_enabled()
        swapped = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
        assert set(swapped) == set(linears)
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=0)
        assert torch.equal(generate(model, ids, max_new_tokens=12), tokens)
    assert torch.is_grad_enabled()
    assert {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)} == linears
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    if model.config.tie_embeddings:
        assert model.lm_head.weight is model.token_embedding.weight


def test_an_error_inside_the_block_still_gives_the_model_back():
    model = GPT(GPTConfig.from_name("tiny-llama")).eval()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with pytest.raises(RuntimeError, match="boom"), packed_linears(model):
        raise RuntimeError("boom")
    assert [m for m in model.modules() if isinstance(m, nn.Linear)] == linears


def test_what_cannot_be_packed_is_left_alone_or_refused_clearly():
    model = GPT(GPTConfig.from_name("tiny-llama")).double()
    with packed_linears(model):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="linear: expected a CPU float32/bfloat16 nn.Linear"):
        PackedLinear(nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match="x: expected a last dimension of 4"):
        PackedLinear(nn.Linear(4, 4))(torch.randn(2, 5))
