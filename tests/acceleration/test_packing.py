"""oneDNN-packed linears: the same outputs as F.linear (float64 reference), the same greedy
tokens and logits in a whole model, and the model given back untouched."""

import copy
import os
import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv import capabilities
from qkv.acceleration import (
    PackedLinear,
    SharedInputMember,
    explain_packing,
    onednn_probe,
    packed_linears,
)
from qkv.generation import beam_search, generate
from qkv.layers import MultiHeadAttention, SwiGLU
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig
from tests.layers.helpers import randomize_

STAND_INS = (PackedLinear, SharedInputMember)  # what a packed_linears block swaps a linear for


@pytest.fixture(autouse=True)
def onednn_fp32_products():
    """These tests check oneDNN's packed products: fp32 answers as on AMD's CPUs, where they
    are chosen (`packing.packs`); on Intel's, fp32 stays F.linear's (tested below)."""
    with capabilities.kernels_as({"onednn_fp32_linears": True}):
        yield


def test_where_mkl_is_the_faster_fp32_products_stay_f_linear_s():
    """On Intel's CPUs (`capabilities.onednn_fp32_products` False) a PackedLinear over fp32
    weights packs nothing and computes F.linear's very outputs, one row or several; the block
    still swaps and fuses, and says so."""
    torch.manual_seed(0)
    with capabilities.kernels_as({"onednn_fp32_linears": False}), torch.no_grad():
        linear, x = nn.Linear(64, 96), torch.randn(3, 64)
        packed = PackedLinear(linear)
        assert torch.equal(packed(x), linear(x)) and torch.equal(packed(x[:1]), linear(x[:1]))
        assert not packed._packed and "computed by F.linear" in repr(packed)
        text = str(explain_packing(nn.Sequential(linear)))
        assert "fp32 products are F.linear's, unpacked" in text
        # in a graph, one row is F.linear's (MKL's GEMV) too, not inductor's reduction
        packed._matvec = lambda x: pytest.fail("one row as a reduction")
        graph = torch.compile(packed, backend="eager", fullgraph=True)
        assert torch.equal(graph(x[:1]), linear(x[:1]))


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 7, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(dtype, atol, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(shape).to(dtype)
    exact = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    plain, packed = linear(x), PackedLinear(linear)(x)
    assert packed.shape == plain.shape == (*shape[:-1], 96) and packed.dtype == dtype
    # packed is as close to the float64 product as PyTorch's own kernel is
    plain_error = (plain.double() - exact).abs().max().item()
    torch.testing.assert_close(packed.double(), exact, atol=max(atol, 2 * plain_error), rtol=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_packed_model_gives_the_same_logits_and_tokens_and_is_given_back(name):
    torch.manual_seed(0)
    model = randomize_(GPT(GPTConfig.from_name(name)), std=0.1).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids).logits
    tokens = generate(model, ids, max_new_tokens=12)
    with packed_linears(model) as same:
        assert same is model and not torch.is_grad_enabled()
        stand_ins = {n for n, m in model.named_modules() if isinstance(m, STAND_INS)}
        members_own = {n for n in stand_ins if n.endswith(".own")}  # a member's own product
        assert stand_ins - members_own == set(linears)  # every linear, each by its own name
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=0)
        assert torch.equal(generate(model, ids, max_new_tokens=12), tokens)
        # the first call showed q, k and v reading one tensor: they share a product since
        assert model.blocks[0].self_attn.k_proj.group.shares_with(1) == ["q_proj", "v_proj"]
    assert torch.is_grad_enabled()
    assert {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)} == linears
    assert not any(isinstance(m, STAND_INS) for m in model.modules())
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    if model.config.tie_embeddings:
        assert model.lm_head.weight is model.token_embedding.weight


def test_an_error_inside_the_block_still_gives_the_model_back():
    model = GPT(GPTConfig.from_name("tiny-llama")).eval()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with pytest.raises(RuntimeError, match="boom"), packed_linears(model):
        raise RuntimeError("boom")
    assert [m for m in model.modules() if isinstance(m, nn.Linear)] == linears


def test_a_module_called_after_its_block_does_not_bring_old_weights_into_the_next_block():
    """A PackedLinear kept past its block and called there packs its weights (no block clears
    that copy); the next block reuses the module, and must pack the weights it has now."""
    torch.manual_seed(0)
    model = randomize_(GPT(GPTConfig.from_name("tiny-llama")), std=0.1).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1)
    )
    with packed_linears(model):
        kept = model.lm_head
    kept(torch.randn(1, model.config.embed_dim))  # outside any block: packs, and keeps it
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: the same module, new values
        expected = model(ids).logits
    with packed_linears(model):
        assert model.lm_head is kept  # reused
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=0)


def test_what_cannot_be_packed_is_left_alone_or_refused_clearly():
    model = GPT(GPTConfig.from_name("tiny-llama")).double()
    with packed_linears(model):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="linear: expected a CPU float32/bfloat16 nn.Linear"):
        PackedLinear(nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match="x: expected a last dimension of 4"):
        PackedLinear(nn.Linear(4, 4))(torch.randn(2, 5))
    with pytest.raises(ValueError, match="linears: expected at least one nn.Linear"):
        PackedLinear()
    with pytest.raises(ValueError, match="linears: expected the same in_features and dtype"):
        PackedLinear(nn.Linear(4, 4), nn.Linear(5, 4))
    with pytest.raises(ValueError, match="linear: expected an nn.Linear, got Conv1d"):
        PackedLinear(nn.Linear(4, 4), nn.Conv1d(4, 4, 1))


@pytest.mark.parametrize("bias", [(True, True, True), (False, False, False), (True, False, True)])
def test_stacked_linears_equal_their_outputs_concatenated(bias):
    torch.manual_seed(0)
    linears = [nn.Linear(32, n, bias=b) for n, b in zip((48, 16, 16), bias, strict=True)]
    x = torch.randn(2, 3, 32)
    expected = torch.cat([linear(x) for linear in linears], dim=-1)  # (2, 3, 80)
    stacked = PackedLinear(*linears)
    assert "packed at its first call" in repr(stacked) and stacked.packing_seconds == 0
    torch.testing.assert_close(stacked(x), expected, atol=1e-5, rtol=0)
    assert "3 linears stacked, oneDNN-packed" in repr(stacked)
    spent = stacked.packing_seconds
    stacked(x)
    assert spent > 0 and stacked.packing_seconds == spent  # packed once


def test_projections_that_read_one_input_share_one_product_from_the_second_call_on():
    """The layers declare nothing: the first call shows which linears read one tensor. In
    self-attention q, k and v are then one product; in cross-attention k and v (the memory)
    are, q (the queries' input) is not; out_proj and SwiGLU's down_proj read other tensors.
    Every output stays the product of the member's own input."""
    torch.manual_seed(0)
    self_attention = MultiHeadAttention(64, 8, 2, bias=True).eval()  # GQA: q 64, k, v 16 wide
    cross_attention = MultiHeadAttention(64, 8, 2, bias=True).eval()
    ffn = SwiGLU(64, 96).eval()
    x, context = torch.randn(2, 5, 64), torch.randn(2, 7, 64)
    calls = {
        "self": lambda: self_attention(x, causal=True),
        "cross": lambda: cross_attention(x, context),
        "ffn": lambda: ffn(x),
    }
    with torch.no_grad():
        expected = {name: call() for name, call in calls.items()}
    with packed_linears(self_attention), packed_linears(cross_attention), packed_linears(ffn):
        for _ in range(3):  # learn, then fused twice
            for name, call in calls.items():
                torch.testing.assert_close(call(), expected[name], atol=1e-5, rtol=0)
        group = self_attention.q_proj.group
        assert group.shares_with(0) == ["k_proj", "v_proj"] and group.shares_with(3) == []
        assert list(group.fused) == [(0, 1, 2)] and group.fused[(0, 1, 2)]._packed
        cross = cross_attention.q_proj.group
        assert cross.shares_with(0) == [] and cross.shares_with(1) == ["v_proj"]
        assert ffn.gate_proj.group.shares_with(0) == ["up_proj"]
        assert "fused with k_proj, v_proj" in repr(self_attention.q_proj)
        # a slice is kept for its own input only: another tensor gets its own product
        other = torch.randn(2, 5, 64)
        assert torch.equal(self_attention.k_proj(other), self_attention.k_proj.own(other))
    assert type(self_attention.q_proj) is nn.Linear and type(ffn.up_proj) is nn.Linear


def test_packed_encoder_decoder_gives_the_same_beams():
    """Self-attention's q, k, v fused, cross-attention's k, v: beam search finds the same
    targets."""
    torch.manual_seed(0)
    config = TransformerConfig(
        src_vocab_size=40, tgt_vocab_size=50, embed_dim=32, num_heads=4, num_encoder_layers=2,
        num_decoder_layers=2, ffn_dim=64, dropout=0.0, max_positions=16,
    )  # fmt: skip
    model = randomize_(Transformer(config), std=0.2).eval()
    source = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = beam_search(model, source, max_new_tokens=8, num_beams=3)
    with packed_linears(model):
        got = beam_search(model, source, max_new_tokens=8, num_beams=3)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)


def test_under_cpu_autocast_a_packed_linear_computes_what_autocast_f_linear_does():
    """fp32 weights under bf16 autocast: a bf16 copy is packed, the output is bf16 like
    autocast's F.linear (oneDNN's bf16 product on both sides here), and leaving autocast goes
    back to the fp32 weights."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    x = torch.randn(3, 7, 64)
    packed = PackedLinear(linear, batch_hint=21)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = linear(x), packed(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=0)
    assert packed(x).dtype == torch.float32


def test_explain_packing_lists_what_is_packed_grouped_and_left_with_the_reason():
    model = GPT(GPTConfig.from_name("tiny-llama")).eval()
    plan = explain_packing(model)
    layers = model.config.num_layers
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert sorted(map(id, plan.packed())) == sorted(map(id, linears)) and plan.left == []
    assert len(plan.groups) == 2 * layers  # q, k, v, out; gate, up (down reads ffn_dim wide)
    text = str(plan)
    assert f"{len(linears)} linears packed for oneDNN (torch.float32)" in text
    assert "group blocks.0.self_attn: q_proj + k_proj + v_proj + out_proj" in text
    assert "group blocks.0.ffn: gate_proj + up_proj" in text
    assert "under CPU autocast to bf16" in text
    assert explain_packing(model, fuse=False).groups == []
    # float64 is never packed: every linear is left, each with its reason
    plan = explain_packing(model.double())
    assert plan.swaps == [] and plan.groups == []
    assert len(plan.left) == len(linears)
    assert all("float64" in reason for _, reason in plan.left)
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        explain_packing("gpt2")


@pytest.fixture
def no_onednn_bf16(monkeypatch):
    """This process answers as a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT does."""
    real = capabilities.onednn_linear

    def answer(dtype: torch.dtype) -> capabilities.Support:
        if dtype == torch.bfloat16:
            return capabilities.Support(False, "oneDNN's bf16 kernels need AVX512-BW/VL/DQ")
        return real(dtype)

    monkeypatch.setattr(capabilities, "onednn_linear", answer)


def test_without_onednn_bf16_a_bf16_model_keeps_its_linears_and_its_outputs(
    no_onednn_bf16, fast_bf16_products
):
    torch.manual_seed(0)
    model = randomize_(GPT(GPTConfig.from_name("tiny-llama")), std=0.1).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator())
    with torch.no_grad():
        expected = model.eval()(ids).logits
    plan = explain_packing(model)
    assert plan.swaps == [] and all("AVX512" in reason for _, reason in plan.left)
    with packed_linears(model):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        assert torch.equal(model(ids).logits, expected)


@pytest.fixture
def fast_bf16_products(monkeypatch):
    """This process answers as a CPU whose bf16 matrix products are native (fast)."""
    answer = capabilities.Support(True, "bf16 matrix products take 0.5x the time of fp32 ones")
    monkeypatch.setattr(capabilities, "bf16_products", lambda: answer)


@pytest.fixture
def slow_bf16_products(monkeypatch):
    """This process answers as a CPU whose bf16 matrix products are emulated (slow)."""
    answer = capabilities.Support(False, "bf16 matrix products take 40x the time of fp32 ones")
    monkeypatch.setattr(capabilities, "bf16_products", lambda: answer)


def test_without_onednn_bf16_autocast_and_bf16_products_are_f_linears(
    no_onednn_bf16, fast_bf16_products
):
    """fp32 weights under bf16 autocast, and a PackedLinear built over bf16 weights, compute
    exactly what F.linear computes (it is what runs), where oneDNN cannot pack bf16."""
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 96), torch.randn(3, 64)
    packed = PackedLinear(linear)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(packed(x), linear(x))
    assert "computed by F.linear, as autocast does" in str(explain_packing(nn.Sequential(linear)))
    bf16 = nn.Linear(64, 96).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(PackedLinear(bf16)(x.bfloat16()), bf16(x.bfloat16()))
    assert "computed by F.linear" in repr(PackedLinear(bf16))


@pytest.mark.parametrize("onednn_bf16", [False, True], ids=["without oneDNN bf16", "with it"])
def test_where_bf16_products_are_emulated_several_rows_compute_in_fp32(
    onednn_bf16, slow_bf16_products, monkeypatch, request
):
    """bf16 storage, fp32 compute: a PackedLinear over bf16 weights, and over fp32 weights
    under bf16 autocast, gives several rows the bf16 product's values (within one bf16
    rounding of F.linear's bf16 result) without any bf16 F.linear call, nor a oneDNN bf16
    product where oneDNN could pack (its bf16 kernels are emulated as slowly on such a CPU:
    nothing is packed); one row (a decoding step, fast in bf16 on any CPU) stays F.linear's
    (without oneDNN bf16)."""
    if onednn_bf16:  # as a CPU with AVX-512 and no AVX512-BF16 answers (nothing is packed)
        answer = capabilities.Support(True, "oneDNN packs bf16 weights on this CPU")
        monkeypatch.setattr(onednn_probe, "packed_products", lambda dtype: answer)
    else:
        request.getfixturevalue("no_onednn_bf16")
    monkeypatch.setattr(PackedLinear, "_pack", lambda self, dtype: pytest.fail("packed"))
    torch.manual_seed(0)
    fp32, x = nn.Linear(64, 96), torch.randn(5, 64)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    with torch.no_grad():
        expected = F.linear(x.bfloat16(), bf16.weight, bf16.bias)  # (5, 96), bf16 kernels
        exact = F.linear(x.bfloat16().float(), bf16.weight.float(), bf16.bias.float())
        one_row = F.linear(x[:1].bfloat16(), bf16.weight, bf16.bias)
    real_linear, bf16_calls = F.linear, []

    def spy(input, weight, bias=None):
        bf16_calls.append(input.dtype == torch.bfloat16 or weight.dtype == torch.bfloat16)
        return real_linear(input, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    with torch.no_grad():
        got = PackedLinear(bf16)(x.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = PackedLinear(fp32)(x)
        assert not any(bf16_calls)
        if not onednn_bf16:
            assert torch.equal(PackedLinear(bf16)(x[:1].bfloat16()), one_row)
    assert got.dtype == under_autocast.dtype == torch.bfloat16
    assert torch.equal(got, exact.bfloat16()) and torch.equal(under_autocast, got)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 answers")
def test_bf16_products_are_slow_where_onednn_has_no_bf16_and_fast_where_the_cpu_has_it():
    """The answer (from the CPU's features, never a timing) agrees with what PyTorch knows on
    x86-64: oneDNN without bf16 (ONEDNN_MAX_CPU_ISA=AVX2, make test-masked) means slow
    products; AVX512-BF16 or AMX, unmasked, means fast ones."""
    answer = capabilities.bf16_products()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not answer, answer.reason
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if native and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert answer, answer.reason
    assert "fast bf16 products" in capabilities.describe()


def test_the_capability_answers_agree_with_what_the_cpu_does():
    """The probe's answer is what happens: where bf16 packing is said to work, a packed bf16
    product runs; where it is not, oneDNN refuses it (the crash the fallback avoids)."""
    weight, x = torch.randn(8, 16).bfloat16(), torch.randn(2, 16).bfloat16()
    answer = onednn_probe.packed_products(torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        ran = True
    except RuntimeError:
        ran = False
    assert bool(answer) == ran, answer.reason
    assert capabilities.onednn_linear(torch.float64).reason.endswith("not torch.float64")
    assert "torch" in capabilities.describe() and "compiled decoding" in capabilities.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_probe_inside_autocast_gives_the_answer_it_gives_outside(dtype):
    """A packed linear first called inside a CPU autocast region (a bf16 training step) probes
    oneDNN there: the probe's float32 reference must not come out in bf16."""
    outside = onednn_probe.packed_products(dtype)
    onednn_probe._packed_product_proved.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = onednn_probe.packed_products(dtype)
    finally:
        onednn_probe._packed_product_proved.cache_clear()
    assert (bool(inside), inside.reason) == (bool(outside), outside.reason)


def test_decoding_a_bf16_model_says_what_its_prompt_costs_where_bf16_is_emulated(
    slow_bf16_products, monkeypatch, caplog
):
    """Unpacked bf16 linears on such a CPU: a warning names the slowdown and the way out
    (packed_linears, whose products of several rows compute in fp32), once; packed, none."""
    monkeypatch.setattr(capabilities, "_WARNED", set())
    model = GPT(GPTConfig.from_name("tiny-llama")).to(torch.bfloat16).eval()
    prompt = torch.arange(1, 6).unsqueeze(0)  # (1, 5)
    with caplog.at_level("WARNING", logger="qkv"):
        with packed_linears(model):
            packed = generate(model, prompt, max_new_tokens=3)
        assert not caplog.records
        generate(model, prompt, max_new_tokens=3)
        generate(model, prompt, max_new_tokens=3)
    [warning] = caplog.records
    assert "decoding a bf16 model's prompt" in warning.message and "40x" in warning.message
    assert "packed_linears" in warning.message and packed.shape == (1, 8)
