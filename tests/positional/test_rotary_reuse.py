"""RotaryEmbedding reuses the last call's angles only when the positions are truly the same."""

import torch

import qkv.models as models
from qkv.positional import RotaryEmbedding, apply_rope, rope_cos_sin
from qkv.positional import rotary as rotary_module


def _expected(q, positions):
    cos, sin = rope_cos_sin(positions, q.shape[-1])
    return apply_rope(q, cos, sin)


def test_reused_angles_follow_in_place_changes_and_new_tensors():
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 2, 4, 8)
    positions = torch.tensor([0, 1, 2, 3])
    first, _ = rope(q, q, positions)
    positions += 10  # same tensor object, changed in place: must not reuse stale angles
    second, _ = rope(q, q, positions)
    torch.testing.assert_close(first, _expected(q, torch.tensor([0, 1, 2, 3])))
    torch.testing.assert_close(second, _expected(q, torch.tensor([10, 11, 12, 13])))
    third, _ = rope(q, q, torch.tensor([5, 6, 7, 8]))
    torch.testing.assert_close(third, _expected(q, torch.tensor([5, 6, 7, 8])))


def test_a_gpt_forward_computes_the_angles_once_for_all_layers(monkeypatch):
    calls = []
    original = rotary_module.rope_cos_sin

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(rotary_module, "rope_cos_sin", counting)
    model = models.GPT(models.GPTConfig.from_name("tiny-llama")).eval()
    assert model.config.num_layers > 1
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, 7)))
    assert len(calls) == 1
