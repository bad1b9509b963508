"""PatchEmbedding against PyTorch: `F.unfold` + `F.linear`, and `nn.Conv2d` with stride = kernel
(`from_conv`, `to_conv`), and against patches cut by hand."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import PatchEmbedding


def test_equals_unfold_then_linear():
    torch.manual_seed(0)
    layer = PatchEmbedding(image_size=(6, 8), patch_size=2, channels=3, embed_dim=5).double()
    images = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    patches = F.unfold(images, kernel_size=2, stride=2).transpose(1, 2)  # (2, 12, 12)
    expected = F.linear(patches, layer.proj.weight, layer.proj.bias)
    torch.testing.assert_close(layer(images), expected, rtol=0, atol=1e-12)
    assert layer.grid == (3, 4) and layer.num_patches == 12


def test_patches_are_row_major_and_flattened_channel_then_row_then_column():
    layer = PatchEmbedding(image_size=4, patch_size=2, channels=2, embed_dim=8, bias=False)
    with torch.no_grad():
        layer.proj.weight.copy_(torch.eye(8))  # the output is the flattened patch itself
    images = torch.arange(32.0).view(1, 2, 4, 4)
    out = layer(images)[0]  # (4 patches, 8)
    for index, (row, column) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        patch = images[0, :, 2 * row : 2 * row + 2, 2 * column : 2 * column + 2]  # (2, 2, 2)
        assert torch.equal(out[index], patch.reshape(-1)), index


@pytest.mark.parametrize("bias", [True, False])
def test_from_conv_and_to_conv_equal_a_strided_convolution(bias):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, kernel_size=4, stride=4, bias=bias).double()
    images = torch.randn(2, 3, 8, 12, dtype=torch.float64)
    layer = PatchEmbedding.from_conv(conv, image_size=(8, 12))
    expected = conv(images).flatten(2).transpose(1, 2)  # (2, 6, 16)
    torch.testing.assert_close(layer(images), expected, rtol=0, atol=1e-12)
    back = layer.to_conv()
    torch.testing.assert_close(back(images), conv(images), rtol=0, atol=1e-12)
    assert (back.bias is None) == (not bias)


def test_gradients_match_the_convolution():
    torch.manual_seed(1)
    conv = nn.Conv2d(1, 4, kernel_size=2, stride=2).double()
    layer = PatchEmbedding.from_conv(conv, image_size=4)
    images = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    conv(images).flatten(2).transpose(1, 2).square().sum().backward()
    layer(images).square().sum().backward()
    torch.testing.assert_close(layer.proj.weight.grad, conv.weight.grad.reshape(4, -1))
    torch.testing.assert_close(layer.proj.bias.grad, conv.bias.grad)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="image_size: the width 10 is not a multiple"):
        PatchEmbedding(image_size=(8, 10), patch_size=4, channels=1, embed_dim=4)
    with pytest.raises(ValueError, match="patch_size"):
        PatchEmbedding(image_size=8, patch_size=0, channels=1, embed_dim=4)
    layer = PatchEmbedding(image_size=8, patch_size=2, channels=1, embed_dim=4)
    with pytest.raises(ValueError, match=r"images: expected shape \(B, 1, 8, 8\)"):
        layer(torch.zeros(2, 3, 8, 8))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.zeros(2, 1, 8, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="stride"):
        PatchEmbedding.from_conv(nn.Conv2d(1, 4, kernel_size=2, stride=1), image_size=8)
    with pytest.raises(ValueError, match="padding"):
        PatchEmbedding.from_conv(nn.Conv2d(1, 4, 2, stride=2, padding=1), image_size=8)
    with pytest.raises(TypeError, match="conv"):
        PatchEmbedding.from_conv(nn.Linear(4, 4), image_size=8)
