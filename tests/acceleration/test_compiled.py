"""`decoding_steps(model, "compiled")`: decoding steps through the model's forward compiled by
torch.compile give the tokens and logits of eager decoding (itself checked against recomputing
the whole prefix and against transformers elsewhere), with oneDNN-packed linears too, and one
graph serves every step and every later call."""

import pytest
import torch
from torch._dynamo.utils import counters

from qkv.acceleration import (
    decoding_steps,
    packed_linears,
    quantize_blocks,
    quantized,
    quantized_kernels,
)
from qkv.acceleration.quantized import QuantizedLinear
from qkv.acceleration.quantized_embedding import QuantizedEmbedding
from qkv.generation import decode_steps, generate
from tests.acceleration.error_bounds import dense_error_bound
from tests.generation.reference_models import left_padded_prompts, qkv_model, redraw

NEW_TOKENS = 10


def _steps(model, ids, mask, new_tokens=NEW_TOKENS, mode=None):
    """(tokens (B, new), logits (B, new, V)) of greedy decoding, `decoding_steps(model, mode)`
    (None: the model itself, the plain reference)."""
    steps = None if mode is None else decoding_steps(model, mode)
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=new_tokens,
                              steps=steps))  # fmt: skip
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-mistral"])
def test_compiled_steps_equal_eager_ones_on_a_left_padded_batch(preset):
    """GPT-2 (learned positions, LayerNorm, biases) and Mistral (RoPE, GQA, a window of 4
    that the 21 decoded tokens outgrow): padding masks, positions and cache writes compiled."""
    model = qkv_model(preset)
    ids, mask = left_padded_prompts()
    eager_tokens, eager_logits = _steps(model, ids, mask)
    tokens, logits = _steps(model, ids, mask, mode="compiled")
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)


def test_a_relative_position_bias_compiles_at_batch_2():
    """T5's bias (1, H, L_q, L_k) against a symbolic batch size: it broadcasts (a tuple test
    of its sizes once failed under torch.compile)."""
    model = qkv_model("tiny-gpt2", position="t5")
    prompts = torch.arange(2, 12).view(2, 5)
    # 2 tokens: the prefill, then one compiled step. A T5-bias model's graph still fails its
    # guards at every new length (one graph per step: slow to compile, not wrong), so each
    # further token would only compile again
    eager_tokens, eager_logits = _steps(model, prompts, None, new_tokens=2)
    graphs = counters["stats"]["unique_graphs"]
    tokens, logits = _steps(model, prompts, None, new_tokens=2, mode="compiled")
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the step was compiled
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)


@pytest.mark.parametrize("prompt_length", [1, 2])
def test_compiled_steps_stay_right_as_the_cache_grows_past_the_window(prompt_length):
    """A one-token prompt (a cache length of 1 at the first step, which torch.compile would
    specialise on: that step is eager) and Mistral's window of 4, outgrown at a later step."""
    model = qkv_model("tiny-mistral")
    prompt = torch.arange(1, prompt_length + 1).unsqueeze(0)  # (1, prompt_length)
    eager_tokens, eager_logits = _steps(model, prompt, None)
    tokens, logits = _steps(model, prompt, None, mode="compiled")
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)


def test_packed_and_compiled_equals_eager_and_one_graph_serves_every_later_call():
    """Llama (GQA) inside packed_linears: the packed products are opaque operators in the
    graph. A second call with another prompt length and more new tokens compiles nothing."""
    model = qkv_model("tiny-llama")
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 7), generator=generator)
    expected = generate(model, prompt, max_new_tokens=NEW_TOKENS)
    with packed_linears(model):
        output = generate(
            model, prompt, max_new_tokens=NEW_TOKENS, steps=decoding_steps(model, "compiled")
        )
        assert torch.equal(output, expected)
        graphs = counters["stats"]["unique_graphs"]
        longer = torch.cat([prompt, prompt], dim=1)  # 14 tokens
        output = generate(
            model, longer, max_new_tokens=2 * NEW_TOKENS, steps=decoding_steps(model, "compiled")
        )
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert torch.equal(output, generate(model, longer, max_new_tokens=2 * NEW_TOKENS))
    # out of the block: the plain modules again, a graph of their own, then packed once more
    assert torch.equal(
        generate(model, prompt, max_new_tokens=NEW_TOKENS, steps=decoding_steps(model, "compiled")),
        expected,
    )
    with packed_linears(model):
        assert torch.equal(
            generate(
                model, prompt, max_new_tokens=NEW_TOKENS, steps=decoding_steps(model, "compiled")
            ),
            expected,
        )


def test_a_cache_as_long_as_the_head_size_is_not_compiled_as_a_constant():
    """A first call whose cache holds head_dim slots (32 + 32 = 64 in benchmarks/decode.py)
    once made torch.compile take the cache length for the head size, a constant, and compile
    again for the next call. From a fresh state, without the profile torch.compile keeps on
    disk (what earlier compilations learnt about sizes would hide it)."""
    torch._dynamo.reset()
    model = qkv_model("tiny-llama")
    D = model.config.head_dim
    prompt = torch.arange(1, 3).unsqueeze(0)  # (1, 2)
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        generate(
            model, prompt, max_new_tokens=D - 2, steps=decoding_steps(model, "compiled")
        )  # a cache of D slots
        graphs = counters["stats"]["unique_graphs"]
        output = generate(
            model, prompt, max_new_tokens=D + 5, steps=decoding_steps(model, "compiled")
        )
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert torch.equal(output, generate(model, prompt, max_new_tokens=D + 5))


def test_two_decodings_interleaved_step_by_step_each_get_their_own_graph():
    """Two calls advanced in turns, one model packed (PackedLinear products) and one plain, of
    the same config and different weights, each still gets its own graph and weights at every
    step."""
    plain, packed = qkv_model("tiny-llama"), redraw(qkv_model("tiny-llama"), seed=1)
    prompt = torch.arange(1, 6).unsqueeze(0)  # (1, 5)
    expected = {name: _steps(m, prompt, None) for name, m in (("plain", plain), ("packed", packed))}
    with packed_linears(packed):
        iterators = {
            name: decode_steps(
                m, prompt, max_new_tokens=NEW_TOKENS, steps=decoding_steps(m, "compiled")
            )
            for name, m in (("plain", plain), ("packed", packed))
        }
        got = {name: [] for name in iterators}
        for _ in range(NEW_TOKENS):
            for name, steps in iterators.items():  # one step of each, in turns
                got[name].append(next(steps))
    for name, (tokens, logits) in expected.items():
        assert torch.equal(torch.stack([s.tokens for s in got[name]], 1), tokens)
        torch.testing.assert_close(
            torch.stack([s.logits for s in got[name]], 1), logits, rtol=1e-5, atol=1e-5
        )


def test_a_later_packed_block_compiles_nothing_and_sees_weights_changed_in_between():
    """packed_linears reuses a model's PackedLinear modules from block to block (their packed
    copies are dropped on exit), so the graph compiled in the first block serves the second.
    At batch 2 the products are opaque operators that name their module's handle: new modules
    in each block compiled again (a guard on the handle). No new graph, and the weights redrawn
    between the blocks are the ones used, by the compiled steps and the eager prefill alike."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    assert ids.shape[0] > 1
    with packed_linears(model):
        generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            steps=decoding_steps(model, "compiled"),
        )
        with packed_linears(model):  # nested: nothing left to pack, nothing forgotten
            pass
    graphs = counters["stats"]["unique_graphs"]
    redraw(model, seed=5)  # in place: the same modules, new values
    expected = _steps(model, ids, mask)
    with packed_linears(model):
        got = _steps(model, ids, mask, mode="compiled")
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_without_a_cpp_compiler_the_steps_are_eager_and_say_why(monkeypatch, caplog):
    """A machine without a C++ compiler (torch.compile's CPU kernels need one) gets eager
    steps and a logged reason, not a compiler error in the middle of decoding."""
    from qkv import capabilities
    from qkv.acceleration import decoding

    missing = capabilities.Support(False, "no C++ compiler was found (install g++)")
    monkeypatch.setattr(capabilities, "compiler", lambda: missing)
    monkeypatch.setattr(decoding, "_LOGGED", set())
    model = qkv_model("tiny-gpt2")
    with caplog.at_level("WARNING", logger="qkv.acceleration.decoding"):
        for steps in (decoding_steps(model, "compiled"), decoding_steps(model)):
            assert isinstance(steps, decoding.EagerSteps) and steps.model is model
    assert "eager steps: no C++ compiler" in caplog.text


def test_eager_steps_are_the_models_bit_for_bit_with_ropes_tables_once_a_step(monkeypatch):
    """`decoding_steps(model, "eager")`: the model with fast_rope swapped in around each step.
    A left-padded batch of a Llama (rotary, GQA) gives the plain model's tokens and logits bit
    for bit; each step makes RoPE's cos/sin tables once for all layers, where the plain model
    makes them once a layer; between the steps the model is the caller's, unswapped."""
    from qkv.acceleration.fast_rotary import FastRotaryEmbedding
    from qkv.positional import RotaryEmbedding, rotary

    model = redraw(qkv_model("tiny-llama"), seed=2)
    assert model.config.num_layers == 2
    ids, mask = left_padded_prompts()
    made = []
    counted = rotary.rope_cos_sin

    def counting(*args, **kwargs):
        made.append(1)
        return counted(*args, **kwargs)

    monkeypatch.setattr(rotary, "rope_cos_sin", counting)
    plain = _steps(model, ids, mask, new_tokens=4)
    plain_tables = len(made)
    made.clear()
    eager = _steps(model, ids, mask, new_tokens=4, mode="eager")
    assert torch.equal(eager[0], plain[0]) and torch.equal(eager[1], plain[1])
    assert plain_tables == 2 * 4 and len(made) == 2 + 3  # prefill: the model's; 3 steps: once
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and not any(isinstance(m, FastRotaryEmbedding) for m in ropes)


def test_a_streaming_cache_decodes_through_the_model_and_nothing_is_compiled():
    """A StreamingLLM cache re-rotates a window that moves every step: its steps go to the
    model itself, with the eager tokens."""
    model = qkv_model("tiny-llama")
    prompt = torch.arange(1, 6).unsqueeze(0)  # (1, 5)
    expected = generate(model, prompt, max_new_tokens=NEW_TOKENS, sinks=(1, 4))
    counters.clear()
    steps = decoding_steps(model, "compiled")
    got = generate(model, prompt, max_new_tokens=NEW_TOKENS, sinks=(1, 4), steps=steps)
    assert torch.equal(got, expected)
    assert not counters["stats"]["unique_graphs"]


def test_a_bad_mode_and_bad_steps_are_refused():
    model = qkv_model("tiny-gpt2")
    with pytest.raises(ValueError, match="mode: expected one of"):
        decoding_steps(model, "yes")
    with pytest.raises(TypeError, match="steps: expected None or a callable"):
        generate(model, torch.ones(1, 2, dtype=torch.long), max_new_tokens=2, steps="aot")


def test_a_q8_0_output_layer_is_one_reduction_in_a_graph_with_its_fp32_products(monkeypatch):
    """A Q8_0 output layer (fp32 outputs: eager chunks) computes a step's rows inside a compiled
    graph as one reduction over its int8 codes (never an eager kernel: the chunks are made to
    raise here), within fp32's error bound of the exact product; a prompt's rows, eager, keep
    their kernel. (Where PyTorch's kernels are AVX2, it reduces over words: a test below.)"""
    monkeypatch.setattr(quantized, "graph_int8_reductions", lambda: True)
    linear, generator = _linear(out_features=40, seed=3)
    head = QuantizedLinear.from_linear(linear, "Q8_0", fp32_output=True)
    weight = head.dequantized_weight()
    x = torch.randn(3, 96, generator=generator)
    eager = head(x)  # the chunks
    monkeypatch.setattr(quantized, "int8_blockwise_product", _refused)
    compiled = torch.compile(head, fullgraph=True)(x)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    bound = dense_error_bound(x, weight, torch.float32)
    for y in (eager, compiled):
        assert y.dtype == torch.float32 and (y.double() - exact).abs().max().item() <= bound
    with pytest.raises(AssertionError, match="an eager kernel"):
        head(torch.randn(quantized.PAIR_ROWS, 96))  # eager: the chunks, here refused


def test_a_q8_0_pair_layer_takes_the_pair_in_a_graph_and_its_codes_chunks_for_more_rows(
    monkeypatch,
):
    """A Q8_0 layer of the int4pack pair (where it runs) computes a step's rows inside a graph
    by the pair, as eager does (the same outputs); PAIR_ROWS rows or more in fp32 chunks of
    the codes taken back out of the pair (never the eager scratch, never the blocks), within
    fp32's error bound of the exact product. (Held to AVX2, the pair for any rows: below.)"""
    monkeypatch.setattr(quantized, "graph_int8_reductions", lambda: True)
    linear, generator = _linear(out_features=40, seed=3)
    layer = QuantizedLinear.from_linear(linear, "Q8_0")
    if layer.kernel != "int4pack-pair":  # no int4pack here: the output layer's kernel, above
        assert layer.kernel == "int8-blockwise" and not quantized.int4pack_products()
        return
    weight = layer.dequantized_weight()
    x = torch.randn(3, 96, generator=generator)
    assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x), layer(x))
    many = torch.randn(quantized.PAIR_ROWS + 1, 96, generator=generator)
    monkeypatch.setattr(quantized, "int4pack_product", _refused)
    monkeypatch.setattr(quantized, "int4pack_pair_blockwise_product", _refused)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)(many)
    exact = torch.nn.functional.linear(many.double(), weight.double())
    bound = dense_error_bound(many, weight, torch.float32)
    assert compiled.shape == (len(many), 40)
    assert (compiled.double() - exact).abs().max().item() <= bound


def test_where_int8_loads_are_slow_in_graphs_q8_0_layers_take_the_pair_or_the_words(monkeypatch):
    """Where inductor's int8 loads are slow (PyTorch's kernels AVX2: `graph_int8_reductions`),
    a Q8_0 layer with the int4pack pair computes a step's rows in a graph by the pair, as eager
    does (for any number of rows, within bf16's bound); one with fp32 outputs (no pair) holds
    its codes as int32 words instead (no view of the blocks), reduced over in a graph, its
    chunks from their words for more rows (the bound lowered here): each path the only one
    allowed, within fp32's error bound of the exact product, eager too."""
    monkeypatch.setattr(quantized, "graph_int8_reductions", lambda: False)
    linear, generator = _linear(out_features=64, seed=5)
    layer = QuantizedLinear.from_linear(linear, "Q8_0")
    head = QuantizedLinear.from_linear(linear, "Q8_0", fp32_output=True)
    assert "words" in head._buffers and "codes" not in head._buffers
    weight = head.dequantized_weight()
    for name in ("int8_reduction_product", "int8_chunked_product"):
        monkeypatch.setattr(quantized, name, _refused)
    x = torch.randn(5, 96, generator=generator)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    bound = dense_error_bound(x, weight, torch.float32)
    if layer.kernel == "int4pack-pair":  # where int4pack runs: the pair for any rows
        eager = layer(x[:3])
        assert torch.equal(torch.compile(layer, fullgraph=True)(x[:3]), eager)
        many = torch.randn(quantized.PAIR_ROWS, 96, generator=generator)
        pair_bound = dense_error_bound(many, weight, torch.bfloat16)
        exact_many = torch.nn.functional.linear(many.double(), weight.double())
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(many)
        assert (compiled.double() - exact_many).abs().max().item() <= pair_bound
    assert (head(x).double() - exact).abs().max().item() <= bound  # eager: chunks of the words
    monkeypatch.setattr(quantized, "int8_blockwise_product", _refused)
    monkeypatch.setattr(quantized, "int8_words_chunked_product", _refused)
    one_row = torch.compile(head, fullgraph=True, dynamic=False)(x[:1])
    assert (one_row.double() - exact[:1]).abs().max().item() <= bound
    monkeypatch.setattr(quantized, "int8_words_chunked_product", chunked)
    monkeypatch.setattr(quantized, "int8_words_reduction_product", _refused)
    monkeypatch.setattr(quantized, "CACHED_CODES", 0)
    monkeypatch.setattr(quantized_kernels, "SCRATCH_VALUES", 16 * 96)
    rows = torch.compile(head, fullgraph=True, dynamic=False)(x)
    assert (rows.double() - exact).abs().max().item() <= bound


chunked = quantized_kernels.int8_words_chunked_product


def _linear(out_features: int, seed: int) -> tuple[torch.nn.Linear, torch.Generator]:
    """A (96 -> out_features) linear of small seeded weights, and its generator for inputs.
    Dynamo's state is reset first: each test compiles QuantizedLinear.forward for its own
    layers, and across the tests that would pass dynamo's recompile limit for that code."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(96, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, 96, generator=generator) * 0.1)
    return linear, generator


def _refused(*args):
    raise AssertionError("an eager kernel (the chunks, or int4pack) was called")


@pytest.mark.parametrize("rows", [3, 5])
def test_a_q8_0_layer_beyond_the_cache_is_chunked_in_a_graph_from_a_few_rows(monkeypatch, rows):
    """Codes of more than CACHED_CODES (here any: the bound is lowered), inside a graph: under
    GRAPH_CHUNK_ROWS rows one reduction (as for one row), from there its chunks dequantized
    once for all rows (`int8_chunked_product`; 7 chunks of 16 output rows here), each path the
    only one allowed to run, within fp32's error bound of the exact product. (The codes as they
    are: held to AVX2 they are read as words, tested above.)"""
    monkeypatch.setattr(quantized, "graph_int8_reductions", lambda: True)
    linear, generator = _linear(out_features=100, seed=4)
    head = QuantizedLinear.from_linear(linear, "Q8_0", fp32_output=True)
    monkeypatch.setattr(quantized, "CACHED_CODES", 0)
    monkeypatch.setattr(quantized_kernels, "SCRATCH_VALUES", 16 * 96)
    chunked = rows >= quantized.GRAPH_CHUNK_ROWS
    other = "int8_reduction_product" if chunked else "int8_chunked_product"
    monkeypatch.setattr(quantized, other, _refused)
    monkeypatch.setattr(quantized, "int8_blockwise_product", _refused)
    x = torch.randn(rows, 96, generator=generator)
    compiled = torch.compile(head, fullgraph=True, dynamic=False)(x)
    weight = head.dequantized_weight()
    exact = torch.nn.functional.linear(x.double(), weight.double())
    bound = dense_error_bound(x, weight, torch.float32)
    assert (compiled.double() - exact).abs().max().item() <= bound


def test_a_quantized_model_decodes_a_left_padded_batch_through_compiled_steps():
    """A Q8_0 embedding table (each lookup decodes its rows) and Q4_1 FFN linears: the
    compiled steps (what a step the exported library cannot serve takes) give eager's tokens
    and logits. The lookup's size checks once stopped the trace (a data-dependent guard)."""
    model = redraw(qkv_model("tiny-llama"), seed=6)
    table = quantize_blocks(model.token_embedding.weight.detach(), "Q8_0")
    model.token_embedding = QuantizedEmbedding(table, "Q8_0")
    for block in model.blocks:
        for name in ("gate_proj", "up_proj"):
            linear = getattr(block.ffn, name)
            setattr(block.ffn, name, QuantizedLinear.from_linear(linear, "Q4_1"))
    ids, mask = left_padded_prompts()
    eager_tokens, eager_logits = _steps(model, ids, mask, new_tokens=5)
    tokens, logits = _steps(model, ids, mask, new_tokens=5, mode="compiled")
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)
