"""VideoClassifier against references written with PyTorch's own pieces: the patch embedding
as `F.conv2d`, joint blocks as `nn.TransformerEncoderLayer` over all T * N tokens, factorised
blocks as SDPA over all T * N tokens under the "same frame" and "same patch position" masks;
save/load round trip; errors that name the argument."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers import EncoderBlock
from qkv.layers.factorized_attention import same_frame_mask, same_position_mask
from qkv.models import load, save
from qkv.models.video import VideoClassifier, VideoClassifierConfig
from tests.layers.helpers import randomize_

CONFIG = VideoClassifierConfig.from_name("video-tiny", num_layers=2)  # T = 3, N = 4, E = 16
B, T, N, E = 2, CONFIG.frames, CONFIG.num_patches, CONFIG.embed_dim


def _videos(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, 1, CONFIG.image_size, CONFIG.image_size, generator=generator)


def _embedded(model: VideoClassifier, videos: torch.Tensor) -> torch.Tensor:
    """Patches by convolution, then positions: (B, T N, E), tokens frame by frame."""
    conv = model.patch_embedding.to_conv()
    frames = conv(videos.flatten(0, 1)).flatten(2).transpose(1, 2)  # (B T, N, E)
    positions = model.space_position.weight[None] + model.time_position.weight[:, None]
    return (frames.view(B, T, N, E) + positions).reshape(B, T * N, E)


def _head(model: VideoClassifier, tokens: torch.Tensor) -> torch.Tensor:
    features = F.layer_norm(tokens, (E,), model.norm.weight, model.norm.bias, eps=1e-6)
    return F.linear(features.mean(dim=1), model.head.weight, model.head.bias)


def test_joint_model_equals_transformer_encoder_layers_over_all_tokens():
    torch.manual_seed(0)
    model = VideoClassifier(dataclasses.replace(CONFIG, attention="full")).eval()
    references = []
    for i, block in enumerate(model.blocks):
        layer = nn.TransformerEncoderLayer(
            E, CONFIG.num_heads, CONFIG.ffn_dim, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True, layer_norm_eps=1e-6,
        )  # fmt: skip
        references.append(randomize_(layer, seed=i).eval())
        block.block.load_state_dict(EncoderBlock.from_torch(references[-1]).state_dict())
    videos = _videos()
    tokens = _embedded(model, videos)
    for layer in references:
        tokens = layer(tokens)
    torch.testing.assert_close(model(videos).logits, _head(model, tokens), rtol=1e-5, atol=1e-5)


def _masked_attention(attention, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    D = attention.head_dim

    def heads(projection) -> torch.Tensor:
        out = F.linear(tokens, projection.weight, projection.bias)  # (B, L, H D)
        return out.view(B, T * N, -1, D).transpose(1, 2)  # (B, H, L, D)

    out = F.scaled_dot_product_attention(
        heads(attention.q_proj), heads(attention.k_proj), heads(attention.v_proj), attn_mask=mask
    )  # (B, H, L, D)
    out = out.transpose(1, 2).reshape(B, T * N, E)
    return F.linear(out, attention.out_proj.weight, attention.out_proj.bias)


def test_factorized_model_equals_masked_joint_attention_with_sdpa():
    torch.manual_seed(1)
    model = randomize_(VideoClassifier(CONFIG), seed=1).double().eval()
    videos = _videos(1).double()
    tokens = _embedded(model, videos)

    def norm(module, x):
        return F.layer_norm(x, (E,), module.weight, module.bias, eps=1e-6)

    for block in model.blocks:
        tokens = tokens + _masked_attention(block.spatial_attn, norm(block.norm1, tokens),
                                            same_frame_mask(T, N))  # fmt: skip
        tokens = tokens + _masked_attention(block.temporal_attn, norm(block.norm2, tokens),
                                            same_position_mask(T, N))  # fmt: skip
        up, down = block.ffn.up_proj, block.ffn.down_proj
        hidden = F.gelu(F.linear(norm(block.norm3, tokens), up.weight, up.bias))
        tokens = tokens + F.linear(hidden, down.weight, down.bias)
    torch.testing.assert_close(model(videos).logits, _head(model, tokens), rtol=1e-10, atol=1e-10)


def test_loss_is_the_cross_entropy_and_gradients_reach_every_parameter():
    model = VideoClassifier(CONFIG)
    labels = torch.tensor([1, 3])
    output = model(_videos(2), labels)
    torch.testing.assert_close(output.loss, F.cross_entropy(output.logits, labels))
    output.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_save_and_load_give_the_same_logits(tmp_path):
    model = VideoClassifier(CONFIG).eval()
    save(model, tmp_path)
    loaded = load(tmp_path).eval()
    assert isinstance(loaded, VideoClassifier) and loaded.config == CONFIG
    torch.testing.assert_close(loaded(_videos(3)).logits, model(_videos(3)).logits)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: VideoClassifierConfig.from_name("video-tiny", patch_size=3), "patch_size"),
        (lambda: VideoClassifierConfig.from_name("video-tiny", attention="sparse"), "attention"),
        (lambda: VideoClassifierConfig.from_name("video-tiny", frames=0), "frames"),
        (lambda: VideoClassifierConfig.from_name("nope"), "name"),
        (lambda: VideoClassifier(CONFIG)(torch.rand(B, T + 1, 1, 8, 8)), "videos"),
        (lambda: VideoClassifier(CONFIG)(_videos(), torch.tensor([0, 4])), "labels"),
    ],
)
def test_bad_input_names_the_argument(call, named):
    with pytest.raises(ValueError, match=f"^{named}: "):
        call()
