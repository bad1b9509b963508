"""Attention rollout against an eager reading of Abnar & Zuidema 2020 (s3): A_l = 0.5 W_l +
0.5 I with W_l the heads' mean, rollout = A_L ... A_1, one matrix entry at a time in Python
floats; the ViT's maps read from it; and the figure that draws them."""

import dataclasses

import numpy as np
import pytest
import torch

from qkv.analysis.inspection import attention_rollout, vit_rollout_map
from qkv.analysis.plots import rollout_maps
from qkv.models import ViT, ViTConfig


def _eager_rollout(layers, *, fuse="mean"):
    """rollout for one example: layers is a list of (H, L, L) nested lists of floats."""
    L = len(layers[0][0])
    result = None
    for weights in layers:
        H = len(weights)
        mixing = [[0.0] * L for _ in range(L)]
        for i in range(L):
            for j in range(L):
                values = [weights[h][i][j] for h in range(H)]
                fused = {"mean": sum(values) / H, "max": max(values), "min": min(values)}[fuse]
                mixing[i][j] = fused + (1.0 if i == j else 0.0)
            total = sum(mixing[i])
            mixing[i] = [value / total for value in mixing[i]]  # 0.5 W + 0.5 I for "mean"
        if result is None:
            result = mixing
        else:  # A_l times the rollout of the layers below
            result = [[sum(mixing[i][k] * result[k][j] for k in range(L)) for j in range(L)]
                      for i in range(L)]  # fmt: skip
    return torch.tensor(result, dtype=torch.float64)


def _random_attentions(num_layers, B, H, L, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.softmax(3 * torch.randn(B, H, L, L, generator=generator), dim=-1)
            for _ in range(num_layers)]  # fmt: skip


@pytest.mark.parametrize("fuse", ["mean", "max", "min"])
def test_rollout_equals_the_eager_product_of_the_papers_matrices(fuse):
    attentions = _random_attentions(3, 2, 4, 5)
    rollout = attention_rollout(attentions, head_fusion=fuse)
    assert rollout.shape == (2, 5, 5) and rollout.dtype == torch.float32
    for b in range(2):
        expected = _eager_rollout([a[b].double().tolist() for a in attentions], fuse=fuse)
        torch.testing.assert_close(rollout[b].double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rollout.sum(dim=-1), torch.ones(2, 5))


def test_mean_fusion_is_half_weights_plus_half_identity_and_unbatched_inputs_work():
    attentions = [a[0] for a in _random_attentions(2, 1, 3, 4, seed=1)]  # (H, L, L) each
    A = [0.5 * a.double().mean(0) + 0.5 * torch.eye(4, dtype=torch.float64) for a in attentions]
    torch.testing.assert_close(attention_rollout(attentions).double(), A[1] @ A[0], rtol=1e-6,
                               atol=1e-7)  # fmt: skip
    raw = attention_rollout(attentions, residual=False).double()
    means = [a.double().mean(0) for a in attentions]
    torch.testing.assert_close(raw, means[1] @ means[0], rtol=1e-6, atol=1e-7)


def test_bad_inputs_name_the_argument():
    attentions = _random_attentions(2, 1, 2, 3)
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout(attentions, head_fusion="sum")
    with pytest.raises(ValueError, match="layer 1 has shape"):
        attention_rollout([attentions[0], attentions[1][:, :, :2]])
    with pytest.raises(TypeError, match="attentions"):
        attention_rollout(attentions[0])
    with pytest.raises(TypeError, match="model"):
        vit_rollout_map(torch.nn.Linear(2, 2), torch.zeros(1, 1, 8, 8))


TINY = ViTConfig(image_size=8, patch_size=2, channels=1, embed_dim=16, num_layers=2,
                 num_heads=2, ffn_dim=32, num_classes=10)  # fmt: skip


@pytest.mark.parametrize("pooling", ["cls", "mean", "latent"])
def test_vit_map_reads_the_rollout_row_of_its_pooling(pooling):
    torch.manual_seed(0)
    model = ViT(dataclasses.replace(TINY, pooling=pooling)).eval()
    images = torch.rand(2, 1, 8, 8)
    maps = vit_rollout_map(model, images)
    assert maps.shape == (2, 4, 4)
    output = model(images, return_attention=True)
    for b in range(2):
        rollout = _eager_rollout([a[b].double().tolist() for a in output.attentions])
        if pooling == "cls":
            readout = rollout[0, 1:]  # the [class] token's row, its own column left out
        elif pooling == "mean":
            readout = rollout.mean(dim=0)
        else:  # the latents' cross-attention, averaged, through the rollout
            readout = output.pool_attention[b].double().mean(dim=(0, 1)) @ rollout
        torch.testing.assert_close(maps[b].double(), readout.view(4, 4), rtol=1e-5, atol=1e-6)
    total = maps.sum(dim=(1, 2))
    assert torch.all(total <= 1 + 1e-5) and (
        pooling == "cls" or torch.allclose(total, torch.ones(2))
    )


def test_rollout_figure_draws_the_images_and_each_map_row():
    images = torch.rand(3, 1, 8, 8)
    maps = {"cls": torch.rand(3, 4, 4), "mean": torch.rand(3, 4, 4)}
    fig = rollout_maps(images, maps, titles=["0 -> 0", "1 -> 7", "2 -> 2"])
    axes = fig.axes
    assert len(axes) == 9
    np.testing.assert_allclose(axes[0].images[0].get_array(), images[0, 0].numpy())
    overlay = axes[3].images[0].get_array()  # row 1 ("cls"), first image: map / its max
    np.testing.assert_allclose(overlay, (maps["cls"][0] / maps["cls"][0].max()).numpy(),
                               rtol=1e-6)  # fmt: skip
    assert axes[1].get_title() == "1 -> 7" and axes[3].get_ylabel() == "cls"
    with pytest.raises(ValueError, match="h dividing 8"):
        rollout_maps(images, torch.rand(3, 3, 3))
    with pytest.raises(ValueError, match="titles"):
        rollout_maps(images, maps, titles=["one"])
