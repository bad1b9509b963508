"""RotaryEmbedding computes its angles from each call's positions: a positions tensor changed in
place between two calls, or a new one, gives the rotation at the new positions."""

import torch

from qkv.positional import RotaryEmbedding, apply_rope, rope_cos_sin


def _expected(q, positions):
    cos, sin = rope_cos_sin(positions, q.shape[-1])
    return apply_rope(q, cos, sin)


def test_angles_follow_in_place_changes_and_new_tensors():
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 2, 4, 8)
    positions = torch.tensor([0, 1, 2, 3])
    first, _ = rope(q, q, positions)
    positions += 10  # same tensor object, changed in place
    second, _ = rope(q, q, positions)
    torch.testing.assert_close(first, _expected(q, torch.tensor([0, 1, 2, 3])))
    torch.testing.assert_close(second, _expected(q, torch.tensor([10, 11, 12, 13])))
    third, _ = rope(q, q, torch.tensor([5, 6, 7, 8]))
    torch.testing.assert_close(third, _expected(q, torch.tensor([5, 6, 7, 8])))
