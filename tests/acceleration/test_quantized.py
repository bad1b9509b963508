"""Quantized linears (qkv.acceleration.quantized) against the outside references: the gguf
package's quantizers (bytes), F.linear on the bit-exact dequantized weight (outputs, within
twice the error PyTorch's own dense product makes in the kernel's dtype), and the fp32 model
read from the same GGUF file (SmolLM2-135M-Instruct's greedy tokens)."""

from __future__ import annotations

import logging
import warnings

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qkv.acceleration import (
    QuantizedLinear,
    explain_quantized,
    quantize,
    quantize_blocks,
    quantized_from_gguf,
)
from qkv.acceleration import quantized as quantized_module
from qkv.acceleration.quantized_embedding import QuantizedEmbedding
from qkv.capabilities import Support
from qkv.data import chat_format_from_metadata, tokenizer_from_metadata
from qkv.generation import generate
from qkv.models import GPT, GPTConfig
from tests.acceleration.error_bounds import dense_error_bound

KINDS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread: on two shared cores, a second one waits a time slice at every small op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_blocks(weight: torch.Tensor, kind: str) -> np.ndarray:
    with warnings.catch_warnings():  # float16 overflow of a huge scale, as in ggml
        warnings.simplefilter("ignore")
        return gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[kind])


def edge_rows(generator: torch.Generator) -> torch.Tensor:
    """(8, 96): random rows, and rows of zeros, a constant, one huge value (beyond float16's
    range), one large value, all negative, +-1 ties, tiny values."""
    weight = torch.randn(8, 96, generator=generator)
    weight[0] = 0.0
    weight[1] = 0.75
    weight[2, 5] = 1e6
    weight[3, 40] = -3e3
    weight[4] = -weight[4].abs()
    weight[5, :32] = torch.tensor([1.0, -1.0] * 16)
    weight[6] *= 1e-3
    return weight


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_are_ggufs_byte_for_byte_on_edge_rows(kind):
    weight = edge_rows(torch.Generator().manual_seed(0))
    ours = quantize_blocks(weight, kind)
    assert ours.dtype == torch.uint8
    np.testing.assert_array_equal(ours.numpy(), reference_blocks(weight, kind))


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    rows=st.integers(1, 5),
    groups=st.integers(1, 4),
    scale=st.sampled_from([1e-2, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_blocks_are_ggufs_byte_for_byte(kind, rows, groups, scale, seed):
    weight = torch.randn(rows, 32 * groups, generator=torch.Generator().manual_seed(seed)) * scale
    np.testing.assert_array_equal(
        quantize_blocks(weight, kind).numpy(), reference_blocks(weight, kind)
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 96), (1, 96)])
def test_outputs_are_the_dequantized_product_in_the_kernels_dtype(kind, shape):
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(96, 40)  # 40 rows: int4pack pads them to 48
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator) * 0.1)
        linear.bias.copy_(torch.randn(40, generator=generator))
    layer = QuantizedLinear.from_linear(linear, kind)
    weight = layer.dequantized_weight()
    x = torch.randn(shape, generator=generator)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 40)
    exact = F.linear(x.double(), weight.double(), linear.bias.double())
    bound = dense_error_bound(x.reshape(-1, 96), weight, layer.compute_dtype)
    assert (y.double() - exact).abs().max().item() <= bound
    if quantized_module.int4pack_products():
        assert layer.kernel == ("int4pack-pair" if kind == "Q8_0" else "int4pack")
    else:  # e.g. ATEN_CPU_CAPABILITY=default
        assert layer.kernel == ("int8-blockwise" if kind == "Q8_0" else "dequantized")


def test_q8_0_rows_of_a_prompt_are_computed_in_fp32_and_a_steps_in_the_pair_product():
    """A Q8_0 layer of the pair kernel: fewer than PAIR_ROWS rows (decoding steps) through the
    bf16 pair product, within the bf16 bound; PAIR_ROWS rows or more (a prompt) through the
    int8 blocks in fp32, within fp32's. An fp32_output layer takes fp32 for every row."""
    generator = torch.Generator().manual_seed(2)
    linear = nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator) * 0.1)
    layer = QuantizedLinear.from_linear(linear, "Q8_0")
    head = QuantizedLinear.from_linear(linear, "Q8_0", fp32_output=True)
    assert head.kernel == "int8-blockwise" and "fp32 outputs" in head.kernel_reason.reason
    weight = layer.dequantized_weight()
    for rows in (1, quantized_module.PAIR_ROWS - 1, quantized_module.PAIR_ROWS, 40):
        x = torch.randn(rows, 96, generator=generator)
        exact = F.linear(x.double(), weight.double())
        fp32_bound = dense_error_bound(x, weight, torch.float32)
        assert (head(x).double() - exact).abs().max().item() <= fp32_bound
        pair = layer.kernel == "int4pack-pair" and rows < quantized_module.PAIR_ROWS
        bound = dense_error_bound(x, weight, torch.bfloat16) if pair else fp32_bound
        assert (layer(x).double() - exact).abs().max().item() <= bound


@settings(max_examples=10, deadline=None)
@given(out_features=st.integers(1, 140), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_pair_gives_back_the_blocks_codes_and_is_the_layers_only_copy(
    out_features, groups, seed
):
    """int4pack's CPU layout (blocks of 64 output rows where PyTorch's kernels are AVX-512, 32
    AVX2) read back: the codes taken out of a Q8_0 pair layout are the blocks' own, bit for
    bit. A pair layer keeps no view of its blocks: with the blocks zeroed after it was laid
    out, a step's rows and a prompt's (fp32 chunks of the codes out of the pair) come out as
    before, within their dtype's bound of the exact product."""
    from qkv.acceleration import quantized_kernels as kernels

    generator = torch.Generator().manual_seed(seed)
    in_features = 32 * groups
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
    layer = QuantizedLinear.from_linear(linear, "Q8_0")
    if not quantized_module.int4pack_products():
        assert layer.kernel == "int8-blockwise"
        return
    expected_block = {"AVX512": 64, "AVX2": 32}[torch.backends.cpu.get_cpu_capability()]
    assert kernels.int4pack_row_block() == expected_block and layer.kernel == "int4pack-pair"
    codes, _ = kernels.int8_layout(layer.blocks, out_features, in_features)
    taken_out = kernels.int4pack_pair_codes(layer.packed, expected_block)
    assert torch.equal(taken_out[:out_features], codes)
    weight = layer.dequantized_weight()
    layer.blocks.zero_()  # a product that read them now would be 0
    for rows in (1, quantized_module.PAIR_ROWS + 3):
        x = torch.randn(rows, in_features, generator=generator)
        dtype = torch.bfloat16 if rows < quantized_module.PAIR_ROWS else torch.float32
        exact = F.linear(x.double(), weight.double())
        error = (layer(x).double() - exact).abs().max().item()
        assert error <= dense_error_bound(x, weight, dtype)


def test_an_int4pack_layout_qkv_cannot_read_back_leaves_q8_0_on_its_codes(monkeypatch):
    """Where PyTorch's int4pack packing is not one of the two layouts qkv reads codes back from
    (or is missing), `int4pack_row_block` says None, and a Q8_0 layer takes int8-blockwise on
    its codes, saying why: never a pair whose prompt rows would read wrong codes."""
    from qkv.acceleration import quantized_kernels as kernels

    def transposed(values, inner_k_tiles):  # bytes in an order neither layout has
        return (values[:, ::2] | values[:, 1::2] << 4).t().contiguous().to(torch.uint8)

    def missing(values, inner_k_tiles):
        raise AttributeError("no such op")

    for op in (transposed, missing):
        monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", op)
        assert kernels.int4pack_row_block.__wrapped__() is None
    monkeypatch.undo()
    monkeypatch.setattr(quantized_module, "int4pack_row_block", lambda: None)
    kernel, why = quantized_module.quantized_kernel("Q8_0")
    assert kernel == "int8-blockwise"
    if quantized_module.int4pack_products():
        assert why.reason.startswith("int4pack's layout here is not one qkv can read")


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_in_llama_cpps_rope_order_are_the_layer_on_the_reordered_rows(kind):
    """A q/k projection's blocks as a GGUF file holds them (llama.cpp's interleaved RoPE rows)
    with `rope_heads`: the same layer as one on the rows reordered to qkv's half-split order,
    in its products, its dequantized weight and its state dict, whose blocks (the layer's
    order) load into either; a head count that does not split the rows is refused by name."""
    from qkv.positional.rope_layout import interleaved_to_half_split

    generator = torch.Generator().manual_seed(7)
    file_order = quantize_blocks(torch.randn(128, 64, generator=generator), kind)  # 2 heads
    reordered = QuantizedLinear(interleaved_to_half_split(file_order, 2), kind)
    layer = QuantizedLinear(file_order, kind, rope_heads=2)
    assert layer.blocks.data_ptr() == file_order.data_ptr()  # kept, not copied
    x = torch.randn(3, 64, generator=generator)
    assert torch.equal(layer(x), reordered(x))
    assert torch.equal(layer.dequantized_weight(), reordered.dequantized_weight())
    assert torch.equal(layer.state_dict()["blocks"], reordered.blocks)
    reordered.load_state_dict(layer.state_dict())
    layer.load_state_dict(reordered.state_dict())  # now its own rows, in its order
    assert layer.rope_heads is None and file_order.data_ptr() != layer.blocks.data_ptr()
    assert torch.equal(layer(x), reordered(x))
    with pytest.raises(ValueError, match="rope_heads: expected heads of an even size"):
        QuantizedLinear(file_order, kind, rope_heads=3)


def test_a_width_that_is_not_whole_blocks_is_refused_by_name():
    with pytest.raises(ValueError, match="in_features=50 is not a multiple"):
        QuantizedLinear.from_linear(nn.Linear(50, 16), "Q4_1")
    with pytest.raises(ValueError, match="blocks: rows of 19 bytes"):
        QuantizedLinear(torch.zeros(4, 19, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="kind: expected one of"):
        QuantizedLinear.from_linear(nn.Linear(64, 16), "Q5_0")
    with pytest.raises(ValueError, match=r"x: expected a CPU tensor \(\.\.\., 64\)"):
        QuantizedLinear.from_linear(nn.Linear(64, 16), "Q8_0")(torch.zeros(2, 63))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_flow_to_the_input_and_the_bias(kind):
    generator = torch.Generator().manual_seed(2)
    layer = QuantizedLinear.from_linear(nn.Linear(64, 32), kind)
    x = torch.randn(3, 64, generator=generator, requires_grad=True)
    upstream = torch.randn(3, 32, generator=generator)
    (layer(x) * upstream).sum().backward()
    torch.testing.assert_close(x.grad, upstream @ layer.dequantized_weight())
    torch.testing.assert_close(layer.bias.grad, upstream.sum(0))
    x64 = torch.randn(2, 64, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x64,))


def test_the_quantized_weight_cannot_be_trained():
    layer = QuantizedLinear.from_linear(nn.Linear(64, 32), "Q4_1")
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    with pytest.raises(ValueError, match="requires_grad: the Q4_1 weight .* is frozen"):
        layer.requires_grad_(True)
    with pytest.raises(AttributeError, match="weight: .* as Q4_1 blocks"):
        layer.weight  # noqa: B018
    with pytest.raises(RuntimeError):  # integer blocks cannot hold a gradient
        layer.blocks.requires_grad_(True)
    layer.requires_grad_(False)
    assert not layer.bias.requires_grad


def test_the_fallback_gives_the_same_outputs(monkeypatch):
    """With the int4pack kernel reported missing (qkv's check, not torch), Q4_0 layers dequantize
    once and compute in fp32: the exact product up to fp32 rounding, and the int4pack outputs
    within their bf16 bound."""
    generator = torch.Generator().manual_seed(3)
    linear = nn.Linear(128, 48)
    x = torch.randn(4, 128, generator=generator)
    served = QuantizedLinear.from_linear(linear, "Q4_0")
    monkeypatch.setattr(quantized_module, "int4pack_products", lambda: Support(False, "masked"))
    fallback = QuantizedLinear.from_linear(linear, "Q4_0")
    assert fallback.kernel == "dequantized" and "masked" in fallback.kernel_reason.reason
    weight = fallback.dequantized_weight()
    exact = F.linear(x.double(), weight.double(), linear.bias.double())
    ours = fallback(x).double()
    assert (ours - exact).abs().max().item() <= dense_error_bound(x, weight, torch.float32)
    bound = dense_error_bound(x, weight, served.compute_dtype)
    assert (served(x).double() - ours).abs().max().item() <= 2 * bound
    assert "dequantized" in explain_quantized(nn.Sequential(fallback))


def test_a_state_dict_round_trip_repacks():
    source = QuantizedLinear.from_linear(nn.Linear(64, 32), "Q4_1")
    target = QuantizedLinear.from_linear(nn.Linear(64, 32), "Q4_1")
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 64)
    assert torch.equal(target(x), source(x))


def test_quantize_swaps_the_linears_of_a_gpt_and_leaves_odd_widths(caplog):
    config = GPTConfig(
        vocab_size=96, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=80,
        max_positions=32, tie_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        expected = model(ids).logits
    with caplog.at_level(logging.INFO, logger="qkv.acceleration.quantized_models"):
        assert quantize(model, "Q4_0") is model
    assert "blocks.0.ffn.down_proj (in_features=80 is not a multiple" in caplog.text
    kinds = {n: m.kind for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert kinds["lm_head"] == "Q8_0" and kinds["blocks.1.self_attn.q_proj"] == "Q4_0"
    assert type(model.blocks[0].ffn.down_proj) is nn.Linear and len(kinds) == 2 * 6 + 1
    with torch.no_grad():
        logits = model(ids).logits
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()  # 4-bit weights
    text = explain_quantized(model)
    assert "13 quantized linears" in text and "blocks.0.ffn.down_proj" in text


def test_smollm2_quantized_loads_the_files_blocks_and_decodes_its_greedy_tokens(
    smollm2, smollm2_file
):
    """The linears are the file's Q4_1 blocks (q/k rows in qkv's layout) and the tied head the
    embedding's Q8_0 blocks; 32 greedy tokens of a chat are the fp32 model's argmax at every
    step (so its greedy decoding makes the same tokens), or the first step where they are not
    is a near-tie of the fp32 model: a top-2 margin under twice what the same model with dense
    bf16 products (autocast) moves that step's logits by, as the int4pack kernel takes bf16
    activations (on AVX-512 one such step came at a margin of 0.10 on logits near 25)."""
    model = quantized_from_gguf(smollm2_file)
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert model.lm_head.kind == "Q8_0" and model.blocks[0].ffn.up_proj.kind == "Q4_1"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "ffn.down_proj"):
        ours = model.blocks[3].get_submodule(name).dequantized_weight()
        assert torch.equal(ours, smollm2.blocks[3].get_submodule(name).weight)
    assert torch.equal(model.lm_head.dequantized_weight(), smollm2.lm_head.weight)
    # the tied table once: the embedding's lookup and the output layer read the same blocks
    assert isinstance(model.token_embedding, QuantizedEmbedding)
    assert model.token_embedding.blocks.data_ptr() == model.lm_head.blocks.data_ptr()
    some = torch.tensor([[0, 1, 49151], [17, 17, 3]])
    assert torch.equal(model.token_embedding(some), smollm2.token_embedding(some))
    assert "embeddings kept as blocks" in explain_quantized(model)
    with pytest.raises(IndexError, match="input_ids: expected ids in \\[0, 49152\\)"):
        model.token_embedding(torch.tensor([49152]))
    text = chat_format_from_metadata(smollm2_file.metadata).render(
        [{"role": "user", "content": "Write a haiku about the sea."}]
    )
    ids = torch.tensor([tokenizer_from_metadata(smollm2_file.metadata).encode(text).ids])
    tokens = generate(model, ids, max_new_tokens=32)  # (1, L + 32)
    ours = tokens[0, ids.shape[1] :]
    with torch.no_grad():
        logits = smollm2(tokens[:, :-1]).logits[0, ids.shape[1] - 1 :]  # (32, V)
    different = (logits.argmax(-1) != ours).nonzero()
    if len(different):
        first = different[0].item()
        top2 = logits[first].topk(2).values
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            dense_bf16 = smollm2(tokens[:, : ids.shape[1] + first]).logits[0, -1].float()  # (V,)
        bound = 2 * (dense_bf16 - logits[first]).abs().max()
        assert top2[0] - top2[1] < bound, f"token {first}: margin {top2} against {bound}"


def test_quantized_pays_where_int4pack_runs_and_not_where_it_is_missing(
    smollm2_file, tmp_path, monkeypatch
):
    """`quantized_pays` (what `qkv chat` decides by default) from the file and the kernels:
    SmolLM2's Q4_1 linears and a Q8_0 file (qkv's writer) where int4pack serves them (Q8_0 in
    its pair form); neither where int4pack is reported missing."""
    from qkv.acceleration.quantized_models import quantized_pays
    from qkv.models.gguf.writer import save_gguf

    pays = quantized_pays(smollm2_file)
    assert bool(pays) == bool(quantized_module.int4pack_products())
    if pays:
        assert pays.reason.startswith("210 Q4_1 linear weights (")
    config = GPTConfig(vocab_size=64, embed_dim=64, num_layers=1, num_heads=2, ffn_dim=128,
                       position="rope", norm="rmsnorm", ffn="swiglu", bias=False)  # fmt: skip
    path = save_gguf(GPT(config), tmp_path / "tiny.gguf", weight_type="Q8_0")
    q8_0 = quantized_pays(path)
    assert bool(q8_0) == bool(quantized_module.int4pack_products())
    if q8_0:
        assert q8_0.reason.startswith("8 Q8_0 linear weights (")  # with the untied output
    monkeypatch.setattr(quantized_module, "int4pack_products", lambda: Support(False, "masked"))
    masked = quantized_pays(smollm2_file)
    assert not masked and "masked" in masked.reason and "Q4_1" in masked.reason
    refused = quantized_pays(path)
    assert not refused and refused.reason.startswith("Q8_0 linear weights: 0% of the file")
    assert "masked" in refused.reason
