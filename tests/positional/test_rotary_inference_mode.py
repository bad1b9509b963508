"""RotaryEmbedding after a call in inference mode: tables built under
torch.inference_mode() are inference tensors, which autograd refuses to save for backward.
A call with gradients after one in inference mode must work and give the same rotation."""

from __future__ import annotations

import torch

from qkv.positional import RotaryEmbedding


def _inputs(length: int = 5):
    torch.manual_seed(0)
    return torch.randn(2, 4, length, 8), torch.randn(2, 2, length, 8)


def test_a_call_with_gradients_after_one_in_inference_mode_without_positions():
    rope = RotaryEmbedding(8)
    q, k = _inputs()
    with torch.inference_mode():
        expected_q, expected_k = rope(q, k)
    q.requires_grad_(True)
    rotated_q, rotated_k = rope(q, k)  # the same length as the call in inference mode
    (rotated_q.square().sum() + rotated_k.sum()).backward()
    torch.testing.assert_close(rotated_q.detach(), expected_q, rtol=0, atol=0)
    torch.testing.assert_close(rotated_k, expected_k, rtol=0, atol=0)
    # rotation preserves the norm of each pair, so d/dq sum(rope(q)^2) = 2 q
    torch.testing.assert_close(q.grad, 2 * q.detach())


def test_positions_made_in_inference_mode_are_used_and_never_reused_stale():
    """Positions changed in place inside inference mode (where tensors carry no version
    counter) are seen at the next call."""
    rope = RotaryEmbedding(8)
    q, k = _inputs()
    with torch.inference_mode():
        positions = torch.arange(5)
        first, _ = rope(q, k, positions)
        positions += 3
        shifted, _ = rope(q, k, positions)
    torch.testing.assert_close(first, rope(q, k, torch.arange(5))[0], rtol=0, atol=0)
    torch.testing.assert_close(shifted, rope(q, k, torch.arange(3, 8))[0], rtol=0, atol=0)
    assert not torch.equal(first, shifted)
