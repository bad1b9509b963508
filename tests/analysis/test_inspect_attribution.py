"""Direct logit attribution, head ablation, patching sweeps and attention vs gradient x input,
checked against the model's own forward, edits of a copy's weights in plain torch,
scipy.stats.spearmanr, and autograd through the transformers twin of each tiny model."""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats

from qkv import inspect
from qkv.models import GPT
from tests.generation.reference_models import VOCAB, hf_model

H, N, L = 4, 2, 7


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def pair(request, tmp_path_factory):
    """(transformers model, the same weights loaded into qkv)."""
    reference = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    return reference, GPT.from_pretrained(path)


def _ids(seed: int = 1, length: int = L, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # (B, L, V)


@pytest.mark.parametrize("position", [-1, 3])
def test_direct_logit_attribution_sums_to_the_models_own_logit(pair, position):
    _, model = pair
    ids, targets = _ids(), torch.tensor([5, 42])
    parts = inspect.direct_logit_attribution(model, ids, targets, position=position)
    assert parts.heads.shape == (2, N, H) and parts.mlps.shape == (2, N)
    assert parts.embed.shape == parts.rest.shape == (2,)
    logit = _logits(model, ids)[torch.arange(2), position, targets].double()  # (B,)
    torch.testing.assert_close(parts.total, logit, rtol=1e-5, atol=1e-4)
    has_bias = model.blocks[0].self_attn.out_proj.bias is not None
    assert bool((parts.rest != 0).all()) == has_bias  # GPT-2's biases; Llama has none


def test_direct_logit_attribution_of_a_head_is_its_share_of_the_attention_term(pair):
    """Summed over heads plus out_proj's bias, the head terms are attn.out read the same way."""
    _, model = pair
    ids, targets = _ids(2), torch.tensor([7, 9])
    parts = inspect.direct_logit_attribution(model, ids, targets)
    _, cache = inspect.run_with_cache(model, ids, ["blocks.*.attn.out", "blocks.1.resid_post"])
    x = cache["blocks.1.resid_post"][:, -1].double()  # (B, E)
    norm, rows = model.final_norm, model.lm_head.weight[targets].double()
    centred = hasattr(norm, "bias")  # LayerNorm (GPT-2) vs RMSNorm

    def read(term):
        term = term - term.mean(-1, keepdim=True) if centred else term
        scale = (x.var(-1, unbiased=False) if centred else x.square().mean(-1)) + norm.eps
        return (term * norm.weight.double() * rows).sum(-1) / scale.sqrt()

    for i, block in enumerate(model.blocks):
        bias = block.self_attn.out_proj.bias
        bias_term = 0 if bias is None else read(bias.double().expand(2, -1))
        expected = read(cache[f"blocks.{i}.attn.out"][:, -1].double())
        torch.testing.assert_close(parts.heads[:, i].sum(1) + bias_term, expected)


def test_zero_ablation_equals_zeroing_out_proj_columns_by_hand(pair):
    _, model = pair
    ids, D = _ids(3), model.blocks[0].self_attn.head_dim
    with inspect.ablate_heads(model, {0: [1], 1: [0, 3]}):
        ablated = _logits(model, ids)
    by_hand = copy.deepcopy(model)
    with torch.no_grad():
        for layer, head in [(0, 1), (1, 0), (1, 3)]:
            by_hand.blocks[layer].self_attn.out_proj.weight[:, head * D : (head + 1) * D] = 0
    torch.testing.assert_close(ablated, _logits(by_hand, ids))
    assert not torch.allclose(ablated, _logits(model, ids))  # and the hooks are gone


@pytest.mark.parametrize("reference", [False, True])
def test_mean_ablation_equals_adding_the_mean_through_out_proj_by_hand(pair, reference):
    _, model = pair
    ids, other = _ids(4), _ids(5, length=5, batch=3)
    mean_from = other if reference else ids
    _, cache = inspect.run_with_cache(model, mean_from, ["blocks.1.attn.head_out"])
    mean = cache["blocks.1.attn.head_out"][:, :, 2].mean((0, 1))  # (D,)
    with inspect.ablate_heads(model, [(1, 2)], mode="mean", mean_over=other if reference else None):
        ablated = _logits(model, ids)
    by_hand, D = copy.deepcopy(model), model.blocks[0].self_attn.head_dim
    out_proj = by_hand.blocks[1].self_attn.out_proj
    with torch.no_grad():
        columns = out_proj.weight[:, 2 * D : 3 * D]  # (E, D)
        added = columns @ mean  # (E,)
        columns.zero_()
        if out_proj.bias is None:
            out_proj.bias = torch.nn.Parameter(added)
        else:
            out_proj.bias += added
    torch.testing.assert_close(ablated, _logits(by_hand, ids), rtol=1e-5, atol=1e-5)


def _logit_difference(logits: torch.Tensor) -> float:
    return (logits[:, -1, 11] - logits[:, -1, 13]).sum().item()


def test_patching_the_last_token_is_causal(pair):
    """Inputs differing at the last token only: at layer 0, patching an earlier position
    changes nothing (the corrupt value exactly), patching the last one gives the clean value."""
    _, model = pair
    clean = _ids(6)
    corrupt = clean.clone()
    corrupt[:, -1] = (clean[:, -1] + 1) % VOCAB
    sweep = inspect.patch_sweep(model, clean, corrupt, _logit_difference)
    assert sweep.effects.shape == (N, L)
    assert sweep.clean == _logit_difference(_logits(model, clean))
    assert sweep.corrupt == _logit_difference(_logits(model, corrupt))
    assert sweep.clean != sweep.corrupt
    assert (sweep.effects[0, :-1] == sweep.corrupt).all()
    assert sweep.effects[0, -1] == sweep.clean


@pytest.mark.parametrize("point", ["resid_pre", "resid_post"])
def test_patching_every_position_at_once_gives_the_clean_value(pair, point):
    """With one-token inputs, patching position 0 is patching the whole stream."""
    _, model = pair
    clean, corrupt = _ids(7, length=1), _ids(8, length=1)
    sweep = inspect.patch_sweep(model, clean, corrupt, _logit_difference, point=point)
    torch.testing.assert_close(sweep.effects, torch.full((N, 1), sweep.clean))


def test_patching_a_head_equals_patching_its_o_proj_input_in_transformers(pair):
    reference, model = pair
    clean, corrupt = _ids(9), _ids(10)
    sweep = inspect.patch_sweep(model, clean, corrupt, _logit_difference, point="head_out")
    assert sweep.effects.shape == (N, H)
    blocks = (
        reference.transformer.h if hasattr(reference, "transformer") else reference.model.layers
    )
    o_proj = [b.attn.c_proj if hasattr(b, "attn") else b.self_attn.o_proj for b in blocks]
    D = model.blocks[0].self_attn.head_dim
    seen = {}
    handle = o_proj[1].register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    _logits(reference, clean)
    handle.remove()

    def put_back(module, args):
        x = args[0].clone()
        x[..., 2 * D : 3 * D] = seen["x"][..., 2 * D : 3 * D]
        return (x,)

    handle = o_proj[1].register_forward_pre_hook(put_back)
    try:
        theirs = _logit_difference(_logits(reference, corrupt))
    finally:
        handle.remove()
    assert sweep.effects[1, 2].item() == pytest.approx(theirs, rel=1e-4, abs=1e-4)


def test_spearman_equals_scipy_on_data_with_ties():
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (6, 20), generator=generator).float()
    y = x + torch.randint(-3, 4, (6, 20), generator=generator).float()
    rho = inspect.spearman(x, y)  # (6,)
    expected = [stats.spearmanr(a.numpy(), b.numpy()).statistic for a, b in zip(x, y, strict=True)]
    torch.testing.assert_close(rho, torch.tensor(expected, dtype=torch.float64))
    with pytest.raises(ValueError, match="x, y"):
        inspect.spearman(x, y[:, :3])


def test_gradient_x_input_equals_autograd_through_transformers(pair):
    reference, model = pair
    ids, targets, position = _ids(11), torch.tensor([3, 17]), 5
    result = inspect.attention_vs_attribution(model, ids, targets, position=position)
    embed = reference.get_input_embeddings()(ids).detach().requires_grad_(True)
    output = reference(inputs_embeds=embed, output_hidden_states=True)
    chosen = output.logits[torch.arange(2), position, targets].sum()
    (grad,) = torch.autograd.grad(chosen, embed)  # d/d(token embeddings) = d/d(block 0's input)
    expected = (grad * output.hidden_states[0]).sum(-1)[:, : position + 1]  # (B, S)
    torch.testing.assert_close(result.attribution, expected.detach(), rtol=1e-4, atol=1e-4)
    _, cache = inspect.run_with_cache(model, ids, "blocks.*.attn.pattern")
    for i in range(N):
        pattern = cache[f"blocks.{i}.attn.pattern"][:, :, position, : position + 1].mean(1)
        torch.testing.assert_close(result.attention[i], pattern)
        rho = [
            stats.spearmanr(a.numpy(), b.numpy()).statistic
            for a, b in zip(pattern, expected.detach(), strict=True)
        ]
        torch.testing.assert_close(result.correlation[:, i], torch.tensor(rho, dtype=torch.float64))


def test_bad_arguments_are_refused_by_name(pair):
    _, model = pair
    ids = _ids()
    with pytest.raises(ValueError, match="target_ids"):
        inspect.direct_logit_attribution(model, ids, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="target_ids"):
        inspect.direct_logit_attribution(model, ids, torch.tensor([1, VOCAB]))
    with pytest.raises(ValueError, match="position"):
        inspect.attention_vs_attribution(model, ids, torch.tensor([1, 2]), position=L)
    with pytest.raises(ValueError, match="head 4 of layer 0"):
        inspect.ablate_heads(model, [(0, 4)]).__enter__()
    with pytest.raises(ValueError, match="layer 2"):
        inspect.ablate_heads(model, {2: [0]}).__enter__()
    with pytest.raises(ValueError, match="mode"):
        inspect.ablate_heads(model, [(0, 0)], mode="resample").__enter__()
    with pytest.raises(ValueError, match="point"):
        inspect.patch_sweep(model, ids, ids, _logit_difference, point="mlp.out")
    with pytest.raises(ValueError, match="corrupt_ids"):
        inspect.patch_sweep(model, ids, ids[:, :3], _logit_difference)
