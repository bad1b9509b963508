"""`qkv.inspect` against transformers on the same weights, and against plain torch formulas.

Each transformers model (GPT-2; Llama with 4 query heads and 2 key/value heads) is built from a
small config with re-drawn weights (tests.generation.reference_models), saved and loaded by
`GPT.from_pretrained`. transformers' `output_hidden_states` gives the input of every block and,
last, the final norm's output; what it does not return (a block's output, the MLP's input, the
o_proj input) is read by a plain forward hook on transformers' own module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from qkv import inspect
from qkv.layers.attention import MultiHeadAttention
from qkv.models import GPT
from tests.generation.reference_models import VOCAB, hf_model

# fp32 on activations of magnitude ~1-30 (weights drawn with std 0.3): both libraries sum the
# same products, possibly in another order, as the greedy-decoding parity tests allow
TOLERANCE = 5e-5
H, H_KV, D, E, N = 4, 2, 8, 32, 2  # the llama-gqa model's sizes (GPT-2: H_kv = H)


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def pair(request, tmp_path_factory):
    """(name, transformers model, the same weights loaded into qkv)."""
    reference = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    return request.param, reference, GPT.from_pretrained(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    reference = hf_model("llama-gqa")
    path = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(path)
    return reference, GPT.from_pretrained(path)


def _ids(seed: int = 1, length: int = 7) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _parts(name: str, reference) -> dict:
    """transformers' modules by role, for the Llama and GPT-2 layouts."""
    if name == "gpt2":
        blocks, body = reference.transformer.h, reference.transformer
        return {"blocks": blocks, "norm": body.ln_f, "ln1": "ln_1", "ln2": "ln_2", "gpt2": True}
    blocks, body = reference.model.layers, reference.model
    return {
        "blocks": blocks, "norm": body.norm, "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm", "gpt2": False,
    }  # fmt: skip


def _o_proj(name: str, block):
    return block.attn.c_proj if name == "gpt2" else block.self_attn.o_proj


def _down_proj(name: str, block):
    return block.mlp.c_proj if name == "gpt2" else block.mlp.down_proj


def _first(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _capture(reference, ids, modules: dict, *, inputs: bool = False):
    """Run transformers once; {key: first input or output} of each module, and its output."""
    seen, handles = {}, []
    for key, module in modules.items():

        def hook(module, args, kwargs, output=None, key=key):
            value = _first(args, kwargs) if inputs else output
            seen[key] = value[0] if isinstance(value, tuple) else value

        if inputs:
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            output = reference(ids, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return seen, output


def test_residual_points_equal_transformers_hidden_states(pair):
    """resid_pre = hidden_states[i]; resid_mid = the input of the MLP's norm; resid_post = the
    block's output (= hidden_states[i + 1] but for the last); final_norm = hidden_states[-1]."""
    name, reference, model = pair
    parts, ids = _parts(name, reference), _ids()
    mids, _ = _capture(
        reference, ids, {i: getattr(b, parts["ln2"]) for i, b in enumerate(parts["blocks"])},
        inputs=True,
    )  # fmt: skip
    posts, theirs = _capture(reference, ids, dict(enumerate(parts["blocks"])))
    output, cache = inspect.run_with_cache(model, ids)
    close = {"rtol": TOLERANCE, "atol": TOLERANCE}
    for i in range(N):
        torch.testing.assert_close(cache[f"blocks.{i}.resid_pre"], theirs.hidden_states[i], **close)
        torch.testing.assert_close(cache[f"blocks.{i}.resid_mid"], mids[i], **close)
        torch.testing.assert_close(cache[f"blocks.{i}.resid_post"], posts[i], **close)
    torch.testing.assert_close(cache["blocks.0.resid_post"], theirs.hidden_states[1], **close)
    torch.testing.assert_close(cache["final_norm"], theirs.hidden_states[-1], **close)
    torch.testing.assert_close(output.logits, theirs.logits, **close)
    assert cache["blocks.1.resid_post"].shape == (2, 7, E)
    assert not [name for name in cache if name.endswith("pattern")]  # dense maps only when named


def _their_qkv(name: str, reference, block, x: torch.Tensor):
    """q (B, H, L, D), k and v (B, H_kv, L, D) recomputed from transformers' projections of
    the block input x, with transformers' own rotary embedding for Llama."""
    B, L, _ = x.shape
    if name == "gpt2":
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(E, dim=-1)  # each (B, L, E)
        return [t.view(B, L, H, D).transpose(1, 2) for t in (q, k, v)]  # (B, H, L, D)
    attn, h = block.self_attn, block.input_layernorm(x)
    q = attn.q_proj(h).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    k = attn.k_proj(h).view(B, L, H_KV, D).transpose(1, 2)  # (B, H_kv, L, D)
    v = attn.v_proj(h).view(B, L, H_KV, D).transpose(1, 2)  # (B, H_kv, L, D)
    cos, sin = reference.model.rotary_emb(h, torch.arange(L)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def test_q_k_v_equal_a_recomputation_from_transformers_projections(pair):
    """q and k after RoPE (Llama: transformers' rotary embedding), with H_kv key heads."""
    name, reference, model = pair
    ids = _ids()
    _, cache = inspect.run_with_cache(model, ids, "blocks.*.attn.[qkv]")
    assert len(cache) == 3 * N
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states
        for i, block in enumerate(_parts(name, reference)["blocks"]):
            expected = _their_qkv(name, reference, block, hidden[i])
            for part, tensor in zip("qkv", expected, strict=True):
                got = cache[f"blocks.{i}.attn.{part}"]
                torch.testing.assert_close(got, tensor, rtol=TOLERANCE, atol=TOLERANCE)
    heads = H if name == "gpt2" else H_KV
    assert cache["blocks.0.attn.k"].shape == cache["blocks.0.attn.v"].shape == (2, heads, 7, D)


def test_pattern_equals_transformers_eager_attentions(pair, monkeypatch):
    name, reference, model = pair
    ids = _ids()
    monkeypatch.setattr(reference.config, "_attn_implementation", "eager")
    with torch.no_grad():
        theirs = reference(ids, output_attentions=True).attentions  # N x (B, H, L, L)
    _, cache = inspect.run_with_cache(model, ids, names=["blocks.*.attn.pattern"])
    assert list(cache) == [f"blocks.{i}.attn.pattern" for i in range(N)]
    for i in range(N):
        torch.testing.assert_close(cache[f"blocks.{i}.attn.pattern"], theirs[i], rtol=0, atol=1e-5)


def test_head_out_is_the_o_proj_input_and_its_head_terms_sum_to_the_attention_output(pair):
    """Elhage et al. 2021: the attention output is sum_h head_out_h W_o[:, h] (+ bias)."""
    name, reference, model = pair
    ids, blocks = _ids(), _parts(name, reference)["blocks"]
    projections = {i: _o_proj(name, b) for i, b in enumerate(blocks)}
    inputs, _ = _capture(reference, ids, projections, inputs=True)
    outputs, _ = _capture(reference, ids, projections)
    _, cache = inspect.run_with_cache(model, ids, ["*.attn.head_out", "*.attn.out"])
    for i, projection in projections.items():
        head_out = cache[f"blocks.{i}.attn.head_out"]  # (B, L, H, D)
        close = {"rtol": TOLERANCE, "atol": TOLERANCE}
        torch.testing.assert_close(head_out.flatten(-2), inputs[i], **close)
        weight = projection.weight if name == "gpt2" else projection.weight.T  # (H * D, E)
        terms = [head_out[:, :, h] @ weight[h * D : (h + 1) * D] for h in range(H)]  # (B, L, E)
        bias = 0 if projection.bias is None else projection.bias
        torch.testing.assert_close(sum(terms) + bias, outputs[i], **close)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.out"], outputs[i], **close)


def test_mlp_points_equal_a_computation_from_transformers_weights(pair):
    """SwiGLU: silu(x W_gate^T) * (x W_up^T); GPT-2: gelu_tanh(x W_fc + b): then down_proj."""
    name, reference, model = pair
    ids, parts = _ids(), _parts(name, reference)
    mids, _ = _capture(
        reference, ids, {i: getattr(b, parts["ln2"]) for i, b in enumerate(parts["blocks"])},
        inputs=True,
    )  # fmt: skip
    _, cache = inspect.run_with_cache(model, ids, "blocks.*.mlp.*")
    for i, block in enumerate(parts["blocks"]):
        with torch.no_grad():
            x = getattr(block, parts["ln2"])(mids[i])  # (B, L, E)
            if name == "gpt2":
                fc, out = block.mlp.c_fc, block.mlp.c_proj  # Conv1D: weight (in, out)
                hidden = F.gelu(x @ fc.weight + fc.bias, approximate="tanh")
                expected = hidden @ out.weight + out.bias
            else:
                mlp = block.mlp
                hidden = F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
                expected = hidden @ mlp.down_proj.weight.T
        close = {"rtol": TOLERANCE, "atol": TOLERANCE}
        torch.testing.assert_close(cache[f"blocks.{i}.mlp.hidden"], hidden, **close)
        torch.testing.assert_close(cache[f"blocks.{i}.mlp.out"], expected, **close)


def _zero_head(tensor: torch.Tensor, name: str) -> torch.Tensor:
    edited = tensor.clone()  # (B, L, H, D)
    edited[:, :, 2] = 0
    return edited


def _edits(name: str, reference):
    """(qkv point, its edit, transformers module, the same edit as a plain torch hook on it)."""
    blocks = _parts(name, reference)["blocks"]

    def zero_input_slice(module, args):  # head 2 of the o_proj input, by hand
        x = args[0].clone()
        x[..., 2 * D : 3 * D] = 0
        return (x,)

    return [
        ("blocks.1.attn.head_out", _zero_head, _o_proj(name, blocks[1]), zero_input_slice, True),
        ("blocks.0.mlp.hidden", lambda t, n: t * 0.5, _down_proj(name, blocks[0]),
         lambda m, args: (args[0] * 0.5,), True),
        ("blocks.1.mlp.out", lambda t, n: torch.zeros_like(t), blocks[1].mlp,
         lambda m, args, out: torch.zeros_like(out), False),
        ("blocks.1.resid_pre", lambda t, n: t.flip(1), blocks[1], None, True),
    ]  # fmt: skip


def test_an_edit_by_hooks_equals_the_same_edit_done_by_hand_in_transformers(pair):
    """Ablating a head by zeroing its head_out equals zeroing its slice of the o_proj input;
    scaling mlp.hidden or zeroing mlp.out or reversing resid_pre along L likewise."""
    name, reference, model = pair
    ids = _ids()
    with torch.no_grad():
        plain = model(ids).logits
    for point, edit, module, by_hand, pre in _edits(name, reference):
        if by_hand is None:  # a block's input: transformers passes it by keyword

            def by_hand(module, args, kwargs):  # positional in GPT-2, by keyword in Llama
                if args:
                    return (args[0].flip(1), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": kwargs["hidden_states"].flip(1)}

            handle = module.register_forward_pre_hook(by_hand, with_kwargs=True)
        elif pre:
            handle = module.register_forward_pre_hook(by_hand)
        else:
            handle = module.register_forward_hook(by_hand)
        try:
            with torch.no_grad():
                expected = reference(ids).logits
        finally:
            handle.remove()
        with inspect.hooks(model, {point: edit}), torch.no_grad():
            got = model(ids).logits
        assert (got - plain).abs().max() > 0.1, point  # the edit matters
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=point)


def _replace_with(source: torch.Tensor, positions=slice(None)):
    def patch(tensor: torch.Tensor, name: str) -> torch.Tensor:
        patched = tensor.clone()
        patched[:, positions] = source[:, positions]
        return patched

    return patch


def test_patching_the_residual_stream_gives_the_other_inputs_logits(llama):
    """Activation patching (Meng et al. 2022): a stream replaced at every position by another
    input's carries that input's logits, exactly; replaced at the last position only, it
    leaves the earlier positions' logits (which never see it: causal) exactly as they were."""
    _, model = llama
    clean, corrupt = _ids(seed=1), _ids(seed=2)
    clean_out, clean_cache = inspect.run_with_cache(model, clean)
    corrupt_logits = inspect.run_with_cache(model, corrupt, names=[])[0].logits
    for point in ("blocks.0.resid_post", "blocks.1.resid_post", "blocks.1.resid_pre"):
        with inspect.hooks(model, {point: _replace_with(clean_cache[point])}), torch.no_grad():
            assert torch.equal(model(corrupt).logits, clean_out.logits), point
    last = _replace_with(clean_cache["blocks.0.resid_post"], positions=[-1])
    with inspect.hooks(model, {"blocks.0.resid_post": last}), torch.no_grad():
        got = model(corrupt).logits
    assert torch.equal(got[:, :-1], corrupt_logits[:, :-1])
    assert (got[:, -1] - corrupt_logits[:, -1]).abs().max() > 0.1
    mid = _replace_with(clean_cache["blocks.1.resid_mid"])  # resid_pre + (r - resid_pre)
    with inspect.hooks(model, {"blocks.1.resid_mid": mid}), torch.no_grad():
        got = model(corrupt).logits
    torch.testing.assert_close(got, clean_out.logits, rtol=TOLERANCE, atol=TOLERANCE)


def test_logit_lens_reads_each_layer_through_transformers_final_norm_and_head(pair):
    """nostalgebraist 2020: lm_head(final_norm(resid_post_i)); the last layer's is the model's
    own logits."""
    name, reference, model = pair
    ids, parts = _ids(), _parts(name, reference)
    posts, theirs = _capture(reference, ids, dict(enumerate(parts["blocks"])))
    lens = inspect.logit_lens(model, ids)
    assert lens.shape == (N, 2, 7, VOCAB)
    with torch.no_grad():
        expected = torch.stack([reference.lm_head(parts["norm"](posts[i])) for i in range(N)])
        torch.testing.assert_close(lens, expected, rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(lens[-1], model(ids).logits, rtol=1e-6, atol=1e-5)
    top = inspect.logit_lens(model, ids, top_k=3)
    assert torch.equal(top, lens.topk(3, dim=-1).indices)


def _hooks_left(model) -> list[str]:
    return [
        path
        for path, module in model.named_modules()
        if module._forward_hooks
        or module._forward_pre_hooks
        or (isinstance(module, MultiHeadAttention) and module._attention_hooks)
    ]


def _run_edited(model, ids, edits):
    with inspect.hooks(model, edits), torch.no_grad():
        return model(ids).logits


def test_no_hook_is_left_after_a_call_a_block_or_an_error(llama):
    _, model = llama
    ids = _ids()
    inspect.run_with_cache(model, ids)
    with inspect.hooks(model, dict.fromkeys(inspect.activation_names(model), lambda t, n: None)):
        assert _hooks_left(model)
        model(ids)
    assert _hooks_left(model) == []

    def fail(tensor, name):
        raise RuntimeError("inside a hook")

    edits = {"blocks.0.attn.pattern": fail, "blocks.1.mlp.out": fail}
    with pytest.raises(RuntimeError, match="inside a hook"), inspect.hooks(model, edits):
        inspect.run_with_cache(model, ids)  # its own hooks go too
    assert _hooks_left(model) == []
    with pytest.raises(RuntimeError, match="inside a hook"):
        _run_edited(model, ids, {"blocks.1.resid_mid": fail})
    assert _hooks_left(model) == []
    with pytest.raises(ValueError, match="input_ids"):  # the model itself refuses
        inspect.run_with_cache(model, ids + VOCAB)
    assert _hooks_left(model) == []


def test_bad_names_and_bad_edits_are_refused_by_name(llama):
    _, model = llama
    ids = _ids()
    for bad in ("blocks.2.resid_post", "blocks.0.attn.z", "embed"):
        with pytest.raises(ValueError, match=rf"'{bad}'.*blocks\.\{{i\}}\.resid_pre"):
            inspect.run_with_cache(model, ids, names=[bad])
        with pytest.raises(ValueError, match=rf"hook_fns: '{bad}'"):
            _run_edited(model, ids, {bad: lambda t, n: None})
    assert _hooks_left(model) == []
    with pytest.raises(ValueError, match="'blocks.0.attn.q' is read-only"):
        _run_edited(model, ids, {"blocks.0.attn.q": lambda t, n: t * 2})
    with pytest.raises(ValueError, match=r"expected None or a tensor of shape \(2, 7, 4, 8\)"):
        _run_edited(model, ids, {"blocks.0.attn.head_out": lambda t, n: t[:, :, 0]})
    with pytest.raises(TypeError, match="model: expected a qkv.models.GPT"):
        inspect.run_with_cache(torch.nn.Linear(2, 2), ids)
    assert _hooks_left(model) == []
    training = copy.deepcopy(model)
    training.blocks[0].dropout = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match="resid_mid .* expected model.eval"):
        inspect.run_with_cache(training.train(), ids, "blocks.0.resid_mid")


def test_smollm2_resid_post_of_every_layer_equals_transformers(smollm2, smollm2_hf, smollm2_file):
    """The real model (30 layers, E = 576): each block's output equals transformers' on the
    same GGUF file. From layer 11 on, a few entries of its residual stream reach about 2e4
    (massive activations, Sun et al. 2024) while most stay below 100, so the tolerance scales
    with each layer's largest entry: 2e-6 of it, some 30 fp32 rounding steps of that entry
    (what summing in another order can move a sum holding it), far below the O(1) change a
    wrong weight, norm or rotation makes."""
    from qkv.data import tokenizer_from_metadata

    tokenizer = tokenizer_from_metadata(smollm2_file.metadata)
    text = "The capital of France is Paris, and the capital of Italy is"
    ids = torch.tensor([tokenizer.encode(text).ids])
    assert 10 <= ids.shape[1] <= 16
    layers = smollm2_hf.model.layers
    posts, theirs = _capture(smollm2_hf, ids, dict(enumerate(layers)))
    _, cache = inspect.run_with_cache(smollm2, ids, "blocks.*.resid_post")
    assert len(cache) == len(layers) == 30
    for i in range(len(layers)):
        if i + 1 < len(layers):
            assert torch.equal(posts[i], theirs.hidden_states[i + 1])
        atol = 2e-6 * posts[i].abs().max().item()
        torch.testing.assert_close(cache[f"blocks.{i}.resid_post"], posts[i], rtol=0, atol=atol)
