"""`qkv.inspect` against TransformerLens, the library of the field, on the same weights.

TransformerLens' `TransformerBridge` (4.x) wraps a transformers model and names its activations
as the field does (hook_resid_pre, hook_q, hook_pattern, hook_z, ...). Each transformers model
(GPT-2; Llama with 4 query heads over 2 key/value heads, RoPE and SwiGLU) is built with re-drawn
weights (tests.generation.reference_models), saved, booted into the bridge offline from that
folder (with a word-level tokenizer saved beside it: the bridge insists on one), and loaded into
qkv by `GPT.from_pretrained`. Every point of `qkv.inspect` then equals the bridge's, and so does
a head zeroed through each library's hooks.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformer_lens.model_bridge import TransformerBridge

from qkv import inspect
from qkv.models import GPT
from tests.generation.reference_models import VOCAB, hf_model

# fp32, activations of magnitude ~1-30: the same products summed in another order
TOLERANCE = 5e-5
LAYERS = 2

# qkv's point -> the bridge's hook, per block (q and k after RoPE where the model has it)
BLOCK_POINTS = {
    "resid_pre": "hook_resid_pre",
    "attn.v": "attn.hook_v",
    "attn.pattern": "attn.hook_pattern",
    "attn.head_out": "attn.hook_z",
    "attn.out": "hook_attn_out",
    "resid_mid": "hook_resid_mid",
    "mlp.hidden": "mlp.hook_post",
    "mlp.out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}
ROTATED = {
    "gpt2": ("attn.hook_q", "attn.hook_k"),
    "llama-gqa": ("attn.hook_rot_q", "attn.hook_rot_k"),
}


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def pair(request, tmp_path_factory):
    """(name, TransformerLens' bridge, the same weights loaded into qkv)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    reference = hf_model(request.param).eval()
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3"
    ).save_pretrained(path)
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the folder alone: nothing may come from a hub
    try:
        bridge = TransformerBridge.boot_transformers(str(path), hf_model=reference)
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = previous
    return request.param, bridge, GPT.from_pretrained(path).eval()


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def test_every_point_equals_transformer_lens_run_with_cache(pair):
    """resid_pre/mid/post, q and k (after RoPE), v, the pattern, each head's output (hook_z),
    the attention and MLP outputs, the MLP's hidden (hook_post), the final norm and the logits.
    TransformerLens holds q, k, v and z as (B, L, heads, D); qkv as (B, heads, L, D) for q, k
    and v (K/V heads unrepeated in both), and (B, L, H, D) for head_out."""
    name, bridge, model = pair
    ids = _ids()
    logits, theirs = bridge.run_with_cache(ids)
    output, ours = inspect.run_with_cache(model, ids, names=inspect.activation_names(model))
    torch.testing.assert_close(output.logits, logits, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(
        ours["final_norm"], theirs["ln_final.hook_out"], rtol=TOLERANCE, atol=TOLERANCE
    )
    q_hook, k_hook = ROTATED[name]
    for i in range(LAYERS):
        points = {**BLOCK_POINTS, "attn.q": q_hook, "attn.k": k_hook}
        for point, hook in points.items():
            expected = theirs[f"blocks.{i}.{hook}"]
            if point in ("attn.q", "attn.k", "attn.v"):
                expected = expected.transpose(1, 2)  # (B, L, heads, D) -> (B, heads, L, D)
            torch.testing.assert_close(
                ours[f"blocks.{i}.{point}"], expected, rtol=TOLERANCE, atol=TOLERANCE,
                msg=lambda text, i=i, point=point: f"blocks.{i}.{point}: {text}",
            )  # fmt: skip


def test_a_head_zeroed_through_qkv_hooks_equals_transformer_lens_ablation(pair):
    """Activation patching, the same edit in both libraries: head 1 of block 0 set to zero at
    its output (qkv's attn.head_out, TransformerLens' hook_z) before the output projection;
    the logits agree, and differ from the clean run's (the head mattered)."""
    _, bridge, model = pair
    ids = _ids()

    def zero_head(value, hook=None, name=None):
        value = value.clone()
        value[:, :, 1] = 0.0  # (B, L, H, D): head 1
        return value

    theirs = bridge.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    with inspect.hooks(model, {"blocks.0.attn.head_out": zero_head}), torch.no_grad():
        ours = model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE)
    with torch.no_grad():
        assert not torch.allclose(ours, model(ids).logits, atol=1e-3)
