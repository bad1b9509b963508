"""The video attention cost against `torch.utils.flop_counter.FlopCounterMode` on the real
layers (on the eager `reference` backend, whose matrix products it sees), against the score
matrices the layers attend with (read by an attention hook), and against figures worked out by
hand for ViViT's 8 frames of 14 x 14 patches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.layout import FFNLayout
from qkv.analysis.cost.video import video_attention_cost
from qkv.attention import attention
from qkv.layers import MultiHeadAttention
from qkv.layers.factorized_attention import (
    FactorizedBlock,
    SpaceTimeBlock,
    same_frame_mask,
    same_position_mask,
    spatial_attention,
    temporal_attention,
)

B, T, N, E, H, FFN = 2, 3, 5, 16, 4, 32
D = E // H
COST = video_attention_cost(frames=T, patches=N, embed_dim=E, num_heads=H)


def _counted(run) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return counter.get_total_flops()


def _reference(module: torch.nn.Module) -> torch.nn.Module:
    for layer in module.modules():
        if isinstance(layer, MultiHeadAttention):
            layer.backend = "reference"
    return module.eval()


def test_vivit_sizes_worked_out_by_hand():
    """8 frames of 224 x 224 in 16 x 16 patches: N = 196, T N = 1,568 tokens; (T N)^2 =
    2,458,624 scores per head jointly, 8 x 196^2 + 196 x 8^2 = 319,872 factorised (7.7 x
    fewer); as masked joint attention 4,917,248, of which 4,597,376 are thrown away."""
    cost = video_attention_cost(frames=8, patches=196, embed_dim=768, num_heads=12)
    assert cost.full_scores == 2_458_624 and cost.factorized_scores == 319_872
    assert cost.masked_scores == 4_917_248 and cost.wasted_scores == 4_597_376
    assert round(cost.full_scores / cost.factorized_scores, 1) == 7.7
    assert cost.full_flops_per_head == 4 * 64 * 2_458_624
    L = 8 * 196  # joint attention: 8 L E^2 projections + 4 L^2 E scores and sums
    assert cost.full_flops == 8 * L * 768**2 + 4 * L**2 * 768


def test_attention_core_flops_per_head_equal_flop_counter_mode():
    """qkv.attention alone: (B T) sequences of N, (B N) of T, and B of T N under each mask."""
    q = torch.randn(B, H, T * N, D)
    frames = q.view(B, H, T, N, D).transpose(1, 2).reshape(B * T, H, N, D)
    tubes = q.view(B, H, T, N, D).permute(0, 3, 1, 2, 4).reshape(B * N, H, T, D)
    factorised = _counted(lambda: attention(frames, frames, frames, backend="reference"))
    factorised += _counted(lambda: attention(tubes, tubes, tubes, backend="reference"))
    assert factorised == B * H * COST.factorized_flops_per_head
    joint = _counted(lambda: attention(q, q, q, backend="reference"))
    assert joint == B * H * COST.full_flops_per_head
    masked = sum(
        _counted(lambda mask=mask: attention(q, q, q, mask=mask(T, N), backend="reference"))
        for mask in (same_frame_mask, same_position_mask)
    )
    assert masked == B * H * COST.masked_flops_per_head


def test_layer_flops_equal_flop_counter_mode_on_the_real_layers():
    torch.manual_seed(0)
    layer = _reference(MultiHeadAttention(E, H))
    x = torch.randn(B, T, N, E)
    tokens = x.reshape(B, T * N, E)
    factorised = _counted(lambda: temporal_attention(layer, spatial_attention(layer, x)))
    assert factorised == B * COST.factorized_flops
    assert _counted(lambda: layer(tokens)) == B * COST.full_flops
    masked = _counted(lambda: layer(layer(tokens, mask=same_frame_mask(T, N)),
                                    mask=same_position_mask(T, N)))  # fmt: skip
    assert masked == B * COST.masked_flops
    assert COST.wasted_flops == COST.masked_flops - COST.factorized_flops > 0


@pytest.mark.parametrize("block_class", [FactorizedBlock, SpaceTimeBlock])
def test_whole_blocks_are_their_attention_plus_the_ffn(block_class):
    torch.manual_seed(1)
    block = _reference(block_class(E, H, FFN))
    measured = _counted(lambda: block(torch.randn(B, T, N, E)))
    attention_flops = COST.factorized_flops if block_class is FactorizedBlock else COST.full_flops
    ffn = FFNLayout(embed_dim=E, hidden_dim=FFN, gated=False, bias=True).flops(T * N)
    assert measured == B * (attention_flops + ffn)


def test_score_elements_equal_the_score_matrices_the_layers_attend_with():
    """An attention hook sees q (B', H, L_q, D) and k (B', H, L_k, D) of every call: the score
    matrix has B' H L_q L_k elements."""
    layer = MultiHeadAttention(E, H).eval()
    scores: list[int] = []

    def hook(module, q, k, **_):
        scores.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])

    layer.register_attention_hook(hook)
    x = torch.randn(B, T, N, E)
    with torch.no_grad():
        spatial_attention(layer, x)
        temporal_attention(layer, x)
        layer(x.reshape(B, T * N, E))
    spatial, temporal, joint = scores
    assert spatial + temporal == B * H * COST.factorized_scores
    assert (spatial, temporal) == (B * H * T * N * N, B * H * N * T * T)
    assert joint == B * H * COST.full_scores == B * H * COST.masked_scores // 2


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"frames": 0}, "frames"), ({"patches": -1}, "patches"), ({"num_heads": 3}, "num_heads")],
)
def test_bad_input_names_the_argument(kwargs, named):
    arguments = {"frames": 4, "patches": 16, "embed_dim": 16, "num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=f"^{named}: "):
        video_attention_cost(**arguments)
