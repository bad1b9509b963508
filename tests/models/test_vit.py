"""ViT against a Vision Transformer assembled from PyTorch's own modules with the same weights:
a strided `nn.Conv2d` patch embedding, the [class] token and positions, pre-norm
`nn.TransformerEncoderLayer`s (GELU, eps 1e-6: the block of Dosovitskiy et al. 2021 eq. 2-3,
which torchvision's `EncoderBlock` also is), a final LayerNorm and a linear head.

torchvision itself is not installed here: the only torchvision 0.28.0 wheel the package index
offers is a CUDA build (it bundles libcudart and pins torch==2.13.0 from the CUDA index), so its
encoder block is stood in for by `nn.TransformerEncoderLayer`, which computes the same function.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import EncoderBlock
from qkv.models import DiffusionConfig, ViT, ViTConfig, load, save
from qkv.models.video import VideoClassifierConfig
from qkv.positional import sinusoidal_2d_table

TINY = ViTConfig(image_size=8, patch_size=2, channels=2, embed_dim=16, num_layers=2,
                 num_heads=4, ffn_dim=24, num_classes=5)  # fmt: skip


def _model_with_torch_layers(config: ViTConfig, seed: int = 0):
    """A ViT in float64 whose blocks are loaded from PyTorch encoder layers, and the layers."""
    torch.manual_seed(seed)
    model = ViT(config).double()
    layers = []
    for index in range(config.num_layers):
        layer = nn.TransformerEncoderLayer(
            config.embed_dim, config.num_heads, config.ffn_dim, dropout=0.0,
            activation="gelu", layer_norm_eps=config.norm_eps, norm_first=True,
            batch_first=True, dtype=torch.float64,
        )  # fmt: skip
        model.blocks[index] = EncoderBlock.from_torch(layer)
        layers.append(layer.eval())
    return model.eval(), layers


def _torch_vit(model: ViT, layers, images):
    """(logits, per-layer weights (B, H, L, L)) computed with PyTorch's modules."""
    config = model.config
    P = config.patch_size
    conv = nn.Conv2d(config.channels, config.embed_dim, P, stride=P, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(model.patch_embedding.proj.weight.view(conv.weight.shape))
        conv.bias.copy_(model.patch_embedding.proj.bias)
    x = conv(images).flatten(2).transpose(1, 2)  # (B, N, E)
    if config.position == "sinusoidal2d":
        # the model's table is built in float32, then cast with the model by .double()
        x = x + sinusoidal_2d_table(*config.grid, config.embed_dim).double()
    if config.pooling == "cls":
        x = torch.cat([model.cls_token.expand(len(x), -1, -1), x], dim=1)
    if config.position == "learned":
        x = x + model.position_embedding.weight
    weights = []
    for layer in layers:
        h = layer.norm1(x)
        weights.append(layer.self_attn(h, h, h, need_weights=True,
                                       average_attn_weights=False)[1])  # fmt: skip
        x = layer(x)
    norm = model.norm
    x = F.layer_norm(x, norm.weight.shape, norm.weight, norm.bias, config.norm_eps)
    features = x[:, 0] if config.pooling == "cls" else x.mean(dim=1)
    return F.linear(features, model.head.weight, model.head.bias), weights


def test_the_vits_own_block_is_pytorchs_pre_norm_gelu_layer():
    """The block ViT builds (not one loaded from PyTorch), its weights copied into
    nn.TransformerEncoderLayer(norm_first=True, activation="gelu", layer_norm_eps=1e-6)."""
    torch.manual_seed(0)
    block = ViT(TINY).double().eval().blocks[0]
    layer = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, activation="gelu",
                                       layer_norm_eps=1e-6, norm_first=True, batch_first=True,
                                       dtype=torch.float64).eval()  # fmt: skip
    attn = block.self_attn
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        layer.self_attn.in_proj_bias.copy_(
            torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        )
        pairs = [(layer.self_attn.out_proj, attn.out_proj), (layer.linear1, block.ffn.up_proj),
                 (layer.linear2, block.ffn.down_proj), (layer.norm1, block.norm1),
                 (layer.norm2, block.norm2)]  # fmt: skip
        for theirs, ours in pairs:
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
    x = torch.randn(3, 17, 16, dtype=torch.float64)
    torch.testing.assert_close(block(x), layer(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "pooling, position",
    [("cls", "learned"), ("mean", "learned"), ("cls", "sinusoidal2d"), ("mean", "sinusoidal2d")],
)
def test_equals_a_vit_built_from_pytorch_modules(pooling, position):
    config = dataclasses.replace(TINY, pooling=pooling, position=position)
    model, layers = _model_with_torch_layers(config)
    images = torch.rand(3, 2, 8, 8, dtype=torch.float64)
    expected, expected_weights = _torch_vit(model, layers, images)
    output = model(images, return_attention=True)
    torch.testing.assert_close(output.logits, expected, rtol=1e-10, atol=1e-10)
    L = 17 if pooling == "cls" else 16
    assert len(output.attentions) == 2 and output.attentions[0].shape == (3, 4, L, L)
    for ours, theirs in zip(output.attentions, expected_weights, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model(images).logits, output.logits, rtol=1e-12, atol=1e-12)


def test_latent_pooling_reads_the_final_tokens_through_the_pool():
    config = dataclasses.replace(TINY, pooling="latent", num_latents=3, latent_blocks=1)
    torch.manual_seed(0)
    model = ViT(config).double().eval()
    images = torch.rand(2, 2, 8, 8, dtype=torch.float64)
    output = model(images, return_attention=True)
    x = model.embed(images)
    for block in model.blocks:
        x = block(x)
    latents, weights = model.pool(model.norm(x), return_weights=True)  # (2, 3, 16)
    expected = F.linear(latents.mean(dim=1), model.head.weight, model.head.bias)
    torch.testing.assert_close(output.logits, expected, rtol=1e-12, atol=1e-12)
    assert output.pool_attention.shape == (2, 4, 3, 16)
    torch.testing.assert_close(output.pool_attention, weights, rtol=1e-12, atol=1e-12)
    assert not hasattr(model, "cls_token") and output.attentions[0].shape == (2, 4, 16, 16)


def test_loss_is_pytorchs_cross_entropy_and_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = ViT(dataclasses.replace(TINY, pooling="latent"))
    images, labels = torch.rand(4, 2, 8, 8), torch.tensor([0, 4, 2, 2])
    output = model(images, labels)
    torch.testing.assert_close(output.loss, F.cross_entropy(output.logits, labels))
    output.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_vit_base_16_has_the_published_parameter_count():
    # ViT-B/16 with a 1000-class head: 86,567,656 parameters, torchvision's vit_b_16 count
    with torch.device("meta"):
        model = ViT(ViTConfig.from_name("vit-base-16"))
    assert sum(p.numel() for p in model.parameters()) == 86_567_656
    assert model.config.num_tokens == 197


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = ViT(dataclasses.replace(TINY, position="sinusoidal2d")).eval()
    images = torch.rand(2, 2, 8, 8)
    loaded = load(save(model, tmp_path / "vit"))
    assert isinstance(loaded, ViT) and loaded.config == model.config
    torch.testing.assert_close(loaded(images).logits, model(images).logits, rtol=0, atol=0)


def test_bad_inputs_and_configs_name_the_argument():
    model = ViT(TINY)
    with pytest.raises(ValueError, match=r"images: expected shape \(B, 2, 8, 8\)"):
        model(torch.rand(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"labels: expected class indices in \[0, 5\)"):
        model(torch.rand(2, 2, 8, 8), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"labels: expected shape \(2,\)"):
        model(torch.rand(2, 2, 8, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="patch_size: 3 does not divide image_size=8"):
        dataclasses.replace(TINY, patch_size=3)
    with pytest.raises(ValueError, match="pooling: expected one of"):
        dataclasses.replace(TINY, pooling="max")
    with pytest.raises(ValueError, match="embed_dim: 18 is not a multiple of 4"):
        dataclasses.replace(TINY, embed_dim=18, num_heads=2, position="sinusoidal2d")
    with pytest.raises(ValueError, match="name: unknown preset"):
        ViTConfig.from_name("vit-huge")
    with pytest.raises(TypeError, match="config: expected a ViTConfig"):
        ViT({"image_size": 8})


def test_a_model_larger_than_memory_is_refused_before_anything_is_allocated():
    huge = dataclasses.replace(TINY, embed_dim=65536, num_heads=64, ffn_dim=262144, num_layers=64)
    with pytest.raises(ValueError, match=r"the model would need ~[\d,.]+ GiB"):
        ViT(huge)


@pytest.mark.parametrize(
    "preset",
    [ViTConfig.from_name("vit-tiny"), DiffusionConfig.from_name("diffusion-tiny"),
     VideoClassifierConfig.from_name("video-tiny")],
    ids=["vit", "diffusion", "video"],
)  # fmt: skip
def test_every_image_config_cuts_whole_square_patches(preset):
    """The shared patch arithmetic (qkv.models.patch_grid) of the three image configs."""
    config = dataclasses.replace(preset, image_size=12, patch_size=4)
    assert config.grid == (3, 3) and config.num_patches == 9
    with pytest.raises(ValueError, match="patch_size: 5 does not divide image_size=12"):
        dataclasses.replace(config, patch_size=5)
