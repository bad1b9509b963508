"""The diffusion U-Net against PyTorch: its attention blocks against nn.TransformerDecoderLayer
(nn.MultiheadAttention inside) with the same weights over the grid's positions, its residual
blocks written out with torch.nn.functional, and the whole model's contract: the DiT's
signature and prompt encoder, no noise predicted at initialisation, a checkpoint round trip, the
diffusion task training it, and the configs it refuses by name."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import DecoderBlock
from qkv.models import DiffusionConfig, DiffusionUNet, load, save
from qkv.models.ddpm import q_sample
from qkv.models.unet import ResBlock, SpatialTransformer


def _config(**changes) -> DiffusionConfig:
    fields = {"conditioning": "add", "embed_dim": 16, "num_heads": 2, "ffn_dim": 32, **changes}
    return DiffusionConfig.from_name("diffusion-tiny", **fields)


def _redrawn(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter redrawn (the zero-initialised output conv too), so that each one counts."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def test_the_attention_block_is_torchs_decoder_layer_over_the_grid_positions():
    """A SpatialTransformer equals GroupNorm, then nn.TransformerDecoderLayer (pre-norm, its
    self- and cross-attention nn.MultiheadAttention) over the H*W positions as tokens with the
    prompt's padding as key_padding_mask, back to the grid, plus the input: weights copied
    from the torch layer, float64."""
    torch.manual_seed(0)
    config = _config()
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, activation="gelu",
                                       layer_norm_eps=config.norm_eps, batch_first=True,
                                       norm_first=True, dtype=torch.float64)  # fmt: skip
    block = SpatialTransformer(config).double()
    block.block = DecoderBlock.from_torch(layer)
    _redrawn(block.norm, seed=1)
    x = torch.randn(3, 16, 4, 4, dtype=torch.float64)  # (B, E, H, W)
    context = torch.randn(3, 5, 16, dtype=torch.float64)  # (B, S, E)
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    tokens = block.norm(x).flatten(2).transpose(1, 2)  # (B, 16, E)
    out = layer(tokens, context, memory_key_padding_mask=~keep)  # (B, 16, E)
    expected = x + out.transpose(1, 2).reshape(3, 16, 4, 4)
    got = block(x, context, keep[:, None, None, :])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_a_residual_block_adds_the_timestep_per_channel_between_its_convolutions():
    torch.manual_seed(0)
    block = _redrawn(ResBlock(16, 8, 12, dropout=0.0), seed=2).double()
    x, time = torch.randn(2, 16, 6, 6).double(), torch.randn(2, 12).double()

    def group_norm(h, norm):
        return F.group_norm(h, 8, norm.weight, norm.bias, norm.eps)

    h = F.conv2d(
        F.silu(group_norm(x, block.norm1)), block.conv1.weight, block.conv1.bias, padding=1
    )
    h = h + (time @ block.time.weight.T + block.time.bias)[:, :, None, None]
    h = F.conv2d(
        F.silu(group_norm(h, block.norm2)), block.conv2.weight, block.conv2.bias, padding=1
    )
    skip = F.conv2d(x, block.skip.weight, block.skip.bias)  # 16 -> 8 channels: a 1 x 1 conv
    torch.testing.assert_close(block(x, time), skip + h, rtol=1e-10, atol=1e-10)


def test_the_unet_predicts_no_noise_at_first_and_its_checkpoint_round_trips(tmp_path):
    """Called as the DiT is; the zero output conv predicts 0 noise until it trains; the
    prompt's padding changes nothing where it is masked; save and load give the same outputs."""
    torch.manual_seed(0)
    model = DiffusionUNet(_config()).eval()
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([0, 49])
    ids, keep = torch.tensor([[5, 6, 7], [5, 8, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.equal(model(x, t, ids, keep), torch.zeros(2, 1, 8, 8))
    _redrawn(model, seed=3)
    with torch.no_grad():
        out = model(x, t, ids, keep)
        other_padding = model(x, t, torch.tensor([[5, 6, 7], [5, 8, 9]]), keep)
    assert out.shape == (2, 1, 8, 8) and out.abs().min() > 0
    torch.testing.assert_close(other_padding, out)  # a masked token is never read
    save(model, tmp_path / "unet")
    loaded = load(tmp_path / "unet")
    assert isinstance(loaded, DiffusionUNet)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t, ids, keep), out, rtol=0, atol=0)


def test_the_diffusion_task_trains_a_unet_and_refuses_what_it_cannot_take():
    from qkv.training.tasks.diffusion import DiffusionOptions, DiffusionTask

    options = DiffusionOptions(denoiser="unet", conditioning="add", embed_dim=16, num_heads=2,
                               ffn_dim=32, num_timesteps=50)  # fmt: skip
    task = DiffusionTask(options)
    model = task.build_model()
    assert isinstance(model, DiffusionUNet)
    batch = task.collate(list(range(8)))
    noisy = q_sample(model.schedule, batch["images"], batch["timesteps"], batch["noise"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        predicted = model(noisy, batch["timesteps"], batch["prompt_ids"], batch["prompt_mask"])
        loss = F.mse_loss(predicted, batch["noise"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # it learns the noise of a fixed batch
    with pytest.raises(ValueError, match="conditioning: 'adaln_zero' with denoiser 'unet'"):
        DiffusionTask(DiffusionOptions(denoiser="unet"))
    with pytest.raises(ValueError, match="denoiser"):
        DiffusionTask(DiffusionOptions(denoiser="resnet"))
    with pytest.raises(ValueError, match="conditioning: 'in_context'; the U-Net adds"):
        DiffusionUNet(_config(conditioning="in_context"))
    with pytest.raises(ValueError, match="embed_dim: 12 is not a multiple of 8"):
        DiffusionUNet(_config(embed_dim=12))
    with pytest.raises(ValueError, match=r"noisy_images: expected \(B, C, H, W\)"):
        model(torch.zeros(1, 1, 4, 4), torch.tensor([0]), torch.tensor([[5]]))
