"""MultiHeadAttention's attention hooks: each call shows the hook what attention receives, the
same q, k and masks that `qkv.attention` is called with (checked by recomputing the output
from them with PyTorch's SDPA), and a removed hook is called no more."""

import torch
import torch.nn.functional as F

from qkv.layers import MultiHeadAttention
from qkv.positional import RotaryEmbedding


def test_a_hook_sees_what_attention_receives_and_goes_away_when_removed():
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, 2, rope=RotaryEmbedding(8)).eval()
    x = torch.randn(2, 5, 32)
    seen = []

    def hook(module, q, k, *, mask, causal, window, bias, cross, pattern):
        assert pattern is None
        seen.append((module, q, k, mask, causal, window, bias, cross))

    handle = layer.register_attention_hook(hook)
    out = layer(x, causal=True)
    ((module, q, k, mask, causal, window, bias, cross),) = seen
    assert module is layer and causal and mask is None and window is None and not cross
    assert q.shape == (2, 4, 5, 8) and k.shape == (2, 2, 5, 8)
    # the output recomputed from what the hook saw, with PyTorch's own attention
    v = layer.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = layer.out_proj(expected.transpose(1, 2).reshape(2, 5, 32))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    handle.remove()
    layer(x, causal=True)
    assert len(seen) == 1 and not layer._attention_hooks
