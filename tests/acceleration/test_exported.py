"""`decoding_steps(model)` (qkv.acceleration.exported): decoding steps through AOTInductor give the
tokens and logits of eager decoding (itself checked against transformers elsewhere), one
library serves every prompt and cache length, its constants are the model's own tensors, a
later process loads it from the compile store, and what it does not serve runs elsewhere."""

import logging
import os
import warnings

import pytest
import torch

from qkv.acceleration import (
    compiled,
    decoding_steps,
    exported,
    packed_linears,
    quantize_blocks,
    quantized_sharing,
)
from qkv.acceleration.decoding import compiled_ready
from qkv.acceleration.quantized import QuantizedLinear
from qkv.acceleration.quantized_embedding import QuantizedEmbedding
from qkv.acceleration.quantized_sharing import share_quantized_inputs
from qkv.generation import PromptCache, decode_steps, generate
from tests.acceleration.new_process import decodes_from_the_store
from tests.generation.reference_models import left_padded_prompts, qkv_model, redraw

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A compile store of this module's own, and the models whose step was compiled into it."""
    directory = tmp_path_factory.mktemp("store")
    previous = os.environ.get("QKV_COMPILE_CACHE")
    os.environ["QKV_COMPILE_CACHE"] = str(directory)
    compilations = []
    real = exported._compile

    def counted(*args):
        compilations.append(args[0])
        return real(*args)

    exported._compile = counted
    yield directory, compilations
    exported._compile = real
    if previous is None:
        os.environ.pop("QKV_COMPILE_CACHE")
    else:
        os.environ["QKV_COMPILE_CACHE"] = previous


# The warnings the `llama` fixture's compile raised, every one recorded.
COMPILE_WARNINGS: list[warnings.WarningMessage] = []


@pytest.fixture(scope="module")
def llama(store):
    """A tiny Llama (RoPE, GQA, SwiGLU) whose step has been compiled once."""
    model = qkv_model("tiny-llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(
            model, torch.arange(3, 9).unsqueeze(0), max_new_tokens=3, steps=decoding_steps(model)
        )
    COMPILE_WARNINGS[:] = caught
    return model


def _steps(model, ids, mask=None, mode=None):
    """(tokens (B, new), logits (B, new, V)) of greedy decoding, `decoding_steps(model, mode)`
    (None: the model itself, the plain reference)."""
    steps = None if mode is None else decoding_steps(model, mode)
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              steps=steps))  # fmt: skip
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


@pytest.mark.parametrize("prompt_length", [1, 2, 9])
def test_exported_steps_equal_eager_ones_for_every_prompt_length(llama, store, prompt_length):
    """Tokens and logits of eager decoding; one library serves every prompt and cache length
    (a one-token prompt's first step, over a cache of 1, runs eagerly)."""
    prompt = torch.arange(1, prompt_length + 1).unsqueeze(0)  # (1, prompt_length)
    eager_tokens, eager_logits = _steps(llama, prompt)
    tokens, logits = _steps(llama, prompt, mode="aot")
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)
    assert store[1].count(llama) == 1  # the fixture's compilation, and no other


def test_compiling_passes_on_no_future_warning_of_torchs_own(llama, store):
    """Torch 2.13's AOTInductor warns (FutureWarning, shown by default) of a deprecated pytree
    class it uses itself at every compile: a user can do nothing about it, so it is not
    passed on (`exported._package`)."""
    assert store[1].count(llama) == 1  # the fixture compiled, and recorded what it raised
    future = [str(w.message) for w in COMPILE_WARNINGS if issubclass(w.category, FutureWarning)]
    assert future == []


def test_a_prompt_cache_kept_across_calls_is_served_as_a_new_one(llama, store):
    """A chat's turns (`PromptCache`): each call's kept cache is a new one, of more slots once
    the conversation outgrows it; the library serves it, with eager decoding's tokens and
    logits, and nothing is compiled again."""
    prompt_cache = PromptCache()
    ids = torch.arange(1, 6).unsqueeze(0)
    for turn in range(3):
        steps = decoding_steps(llama, "aot")
        decoded = list(decode_steps(llama, ids, max_new_tokens=NEW_TOKENS, steps=steps,
                                    prompt_cache=prompt_cache))  # fmt: skip
        tokens = torch.stack([s.tokens for s in decoded], 1)
        logits = torch.stack([s.logits for s in decoded], 1)
        eager_tokens, eager_logits = _steps(llama, ids)
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, eager_tokens)
        assert prompt_cache.reused == (0 if turn == 0 else ids.shape[1] - 4)  # new: 1 + 3
        ids = torch.cat([ids, tokens, torch.arange(10, 13).unsqueeze(0) + turn], dim=1)
    assert store[1].count(llama) == 1  # the fixture's compilation, and no other


@pytest.fixture(scope="module")
def windowed():
    """A GPT-2 with a window of 4 and T5's relative bias (its library is built at batch 2)."""
    return qkv_model("tiny-gpt2", position="t5", sliding_window=4)


@pytest.mark.slow
def test_windows_and_relative_biases_are_exported_too(windowed, store, caplog):
    """A window of 4 (outgrown by the cache) and T5's bias table, built from symbolic lengths,
    at batch 2: the library serves them (no fallback warned of), with eager tokens."""
    prompts = torch.arange(2, 12).view(2, 5)
    with caplog.at_level(logging.WARNING, logger="qkv.acceleration.exported"):
        tokens, logits = _steps(windowed, prompts, mode="aot")
    eager_tokens, eager_logits = _steps(windowed, prompts)
    assert "instead" not in caplog.text
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)
    assert store[1].count(windowed) == 1  # one library for batch 2


def test_the_library_reads_the_models_own_weights(llama, store):
    """Weights written in place are read by the next call; weights replaced by new tensors are
    pointed at again. Nothing is compiled again."""
    prompt = torch.arange(2, 7).unsqueeze(0)
    with torch.no_grad():
        llama.blocks[0].ffn.down_proj.weight.mul_(-1.5)
        llama.blocks[1].self_attn.out_proj.weight = torch.nn.Parameter(
            torch.randn_like(llama.blocks[1].self_attn.out_proj.weight)
        )
    expected = generate(llama, prompt, max_new_tokens=NEW_TOKENS)
    assert torch.equal(
        generate(llama, prompt, max_new_tokens=NEW_TOKENS, steps=decoding_steps(llama)), expected
    )
    assert store[1].count(llama) == 1  # the fixture's compilation, and no other


def test_a_greedy_loop_takes_the_librarys_own_argmax_and_maxima(llama, monkeypatch):
    """Greedy decoding reads each step's choice and row maxima from the library (every step
    after the prefill): they equal torch.argmax and amax over the step's logits, and the
    tokens, with and without an end token, are eager decoding's."""
    served = []
    run = exported.ExportedStep.run

    def spied(self, *args):
        output = run(self, *args)
        served.append(output)
        return output

    monkeypatch.setattr(exported.ExportedStep, "run", spied)
    prompt = torch.arange(2, 8).unsqueeze(0)
    tokens, logits = _steps(llama, prompt, mode="aot")
    assert torch.equal(tokens, _steps(llama, prompt)[0])
    assert len(served) == NEW_TOKENS - 1 and None not in served
    for output in served:
        step_logits = output.logits[:, -1]
        assert torch.equal(output.top_token, step_logits.argmax(dim=-1))
        assert torch.equal(output.top_logit, step_logits.amax(dim=-1))
    eos = int(tokens[0, 3])
    expected = generate(llama, prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    got = generate(
        llama, prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos, steps=decoding_steps(llama)
    )
    assert torch.equal(got, expected)


def test_non_finite_logits_from_the_library_fail_at_their_step(llama):
    """The library's row maxima are checked as the loop's own are: a NaN embedding row for the
    token chosen after the prompt spoils the next step's logits, and decoding stops there."""
    prompt = torch.arange(2, 8).unsqueeze(0)
    first = int(generate(llama, prompt, max_new_tokens=1)[0, -1])
    embedding = llama.token_embedding.weight
    assert llama.lm_head.weight is not embedding  # untied: the prompt's logits stay finite
    saved = embedding[first].clone()
    with torch.no_grad():
        embedding[first] = float("nan")
    try:
        with pytest.raises(ValueError, match=r"decoding step 1 .*not finite in rows \[0\]"):
            generate(llama, prompt, max_new_tokens=NEW_TOKENS, steps=decoding_steps(llama))
    finally:
        with torch.no_grad():
            embedding[first] = saved


@pytest.mark.slow
def test_packed_and_quantized_products_are_served_with_the_constants_inductor_adds(
    store, monkeypatch
):
    """One library for both kinds of swapped products: the attention's linears packed
    (inside packed_linears the one-row products are streaming reductions in the library),
    the FFN's Q4_1 linears (int4pack where it runs) and a Q8_0 down_proj (its pair form eager,
    one reduction over its codes in the library), a Q8_0 head with fp32 outputs (one reduction
    too) and a Q8_0 embedding
    table. Inductor's lowering of the int4pack product adds a constant of its own (the group
    size), which the library records and supplies itself; the eager tokens, through the
    library. Gate and up read one input: the library computes them as one product, as eager
    steps do (`share_quantized_inputs`)."""
    model = redraw(qkv_model("tiny-llama"), seed=6)
    for block in model.blocks:
        for name, kind in (("gate_proj", "Q4_1"), ("up_proj", "Q4_1"), ("down_proj", "Q8_0")):
            linear = getattr(block.ffn, name)
            setattr(block.ffn, name, QuantizedLinear.from_linear(linear, kind))
    model.lm_head = QuantizedLinear.from_linear(model.lm_head, "Q8_0", fp32_output=True)
    share_quantized_inputs(model)
    traced = []  # the output widths of the shared products traced into the library
    product = quantized_sharing.int4pack_product

    def spied(*args):
        if torch.compiler.is_exporting():
            traced.append(args[-1])
        return product(*args)

    monkeypatch.setattr(quantized_sharing, "int4pack_product", spied)
    table = quantize_blocks(model.token_embedding.weight.detach(), "Q8_0")
    model.token_embedding = QuantizedEmbedding(table, "Q8_0")
    prompt = torch.arange(3, 9).unsqueeze(0)
    expected = generate(model, prompt, max_new_tokens=NEW_TOKENS)
    compiled_before = len(store[1])
    with packed_linears(model):
        assert type(model.blocks[0].self_attn.q_proj) is not torch.nn.Linear  # packed
        steps = decoding_steps(model)
        got = generate(model, prompt, max_new_tokens=NEW_TOKENS, steps=steps)
    assert torch.equal(got, expected)
    assert len(store[1]) == compiled_before + 1  # served by a library, not the eager fallback
    (runner,) = steps.exported.runners.values()
    assert runner is not None and set(runner.names) <= set(runner.constants)
    if model.blocks[0].ffn.gate_proj.kernel == "int4pack":  # where int4pack runs
        assert traced == [2 * model.config.ffn_dim] * model.config.num_layers  # gate + up


def test_a_new_process_loads_the_library_from_the_store(llama, store):
    """A new process, whose compiler raises, decodes another tiny Llama (other weights) with
    the library the fixture stored."""
    directory, _ = store
    assert len(list(directory.rglob("exported-b1-int64-int64.pt2"))) >= 1
    decodes_from_the_store(
        directory, refused="exported._compile", mode="aot", new_tokens=NEW_TOKENS
    )


def test_a_library_built_for_another_model_is_refused_before_it_runs(
    llama, store, monkeypatch, caplog
):
    """The fixture's library copied under another key (synced, copied, tampered): the model it
    was built for loads it; a model whose tensors have other shapes is refused by name (the
    library would read out of bounds) and compiles its own (here: cannot, so it says so)."""
    directory, _ = store
    unpadded = (1, torch.int64, torch.int64, False, None)  # batch, dtypes, masked, cache dtype
    stored = next(key for key in exported._RUNNERS[llama] if key[1:] == unpadded)
    library = directory / stored[0] / "exported-b1-int64-int64.pt2"  # the fixture's, not another's
    copied = directory / "copied" / library.name
    copied.parent.mkdir(mode=0o700)
    copied.write_bytes(library.read_bytes())
    key = ("copied", *unpadded)

    def no_compiler(*args):
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(exported, "_compile", no_compiler)
    assert isinstance(exported._load_or_compile(llama, key, {}, None, {}), exported._Runner)
    wider = qkv_model("tiny-llama", vocab_size=llama.config.vocab_size + 8)
    with caplog.at_level(logging.WARNING, logger="qkv.acceleration.exported"):
        refused = exported._load_or_compile(wider, key, {}, None, {})
    assert refused == "RuntimeError: no compiler in this test"
    assert f"{copied} not loaded (compiling again): its constant" in caplog.text
    assert "was built as [[" in caplog.text


@pytest.fixture
def elsewhere(monkeypatch):
    """torch.compile's steps, standing in for themselves: they count their calls and run the
    model eagerly (no compilation)."""
    calls = []

    def step(self, *args, **kwargs):
        calls.append(self.model)
        return self.model(*args, **kwargs)

    monkeypatch.setattr(compiled.CompiledForward, "__call__", step)
    return calls


def test_a_padded_batch_decodes_through_a_library_of_its_own(store, elsewhere):
    """A left-padded batch's steps (a padding mask over the cache and the new token) go through
    a library built for them, its mask of symbolic length: the eager tokens and logits, nothing
    through torch.compile, and the unpadded library of the same model is another (the
    padded one alone does not make the model's step ready for mode "auto")."""
    model = qkv_model("tiny-llama", ffn_dim=48)  # not the fixture's model: a store of its own
    ids, mask = left_padded_prompts()
    eager_tokens, eager_logits = _steps(model, ids, mask)
    tokens, logits = _steps(model, ids, mask, mode="aot")
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)
    assert elsewhere == [] and store[1].count(model) == 1
    (library,) = (store[0] / exported.model_key(model, exported.INDUCTOR_OPTIONS)).glob("*masked*")
    assert library.name == "exported-b3-int64-int64-masked.pt2"
    assert not compiled_ready(model)


def test_a_step_that_cannot_be_exported_decodes_through_the_compiled_steps(
    caplog, monkeypatch, elsewhere
):
    """A compiler failure (here: a stand-in that raises) warns with its reason, and the steps
    are torch.compile's, with the eager tokens."""
    model = qkv_model("tiny-mistral")

    def broken(*args):
        raise RuntimeError("no C++ kernel for this")

    monkeypatch.setattr(exported, "_compile", broken)
    prompt = torch.arange(3, 9).unsqueeze(0)
    with caplog.at_level(logging.WARNING, logger="qkv.acceleration.exported"):
        got = generate(model, prompt, max_new_tokens=4, steps=decoding_steps(model))
    assert torch.equal(got, generate(model, prompt, max_new_tokens=4))
    assert "no C++ kernel for this" in caplog.text
    assert elsewhere == [model] * 3


def test_beam_search_and_sinks_decode_through_the_steps_they_can_use(
    llama, windowed, store, elsewhere
):
    """Beam search reorders its rows (the cache with them, a window of 4 outgrown): the library
    of batch 2 serves its unpadded steps all the same, with the eager hypotheses. A StreamingLLM
    cache goes to the model."""
    prompt = torch.arange(3, 9).unsqueeze(0)
    expected = generate(windowed, prompt, max_new_tokens=6, num_beams=2)
    steps = decoding_steps(windowed)
    assert torch.equal(generate(windowed, prompt, max_new_tokens=6, num_beams=2, steps=steps),
                       expected)  # fmt: skip
    assert store[1].count(windowed) == 1  # the batch-2 library, built here or for the test above
    (runner,) = steps.exported.runners.values()
    assert runner is not None  # served by the library
    expected = generate(llama, prompt, max_new_tokens=4, sinks=(1, 4))
    got = generate(llama, prompt, max_new_tokens=4, sinks=(1, 4), steps=decoding_steps(llama))
    assert torch.equal(got, expected)
    assert elsewhere == []


def test_auto_uses_a_compiled_library_and_otherwise_stays_eager(llama, store, elsewhere):
    """mode="auto" decides from what is compiled, never from a timing: the fixture's model has
    its library (the steps are the library's); a batch size it has no library for, or a new
    model of other weights and widths, decode eagerly, with nothing compiled."""
    prompt = torch.arange(3, 9).unsqueeze(0)
    steps = decoding_steps(llama, "auto")
    assert torch.equal(
        generate(llama, prompt, max_new_tokens=4, steps=steps),
        generate(llama, prompt, max_new_tokens=4),
    )
    assert [runner is not None for runner in steps.exported.runners.values()] == [True]
    before = len(store[1])
    prompts = torch.arange(3, 15).view(2, 6)  # batch 2: no library of the fixture's
    steps = decoding_steps(llama, "auto")
    assert torch.equal(
        generate(llama, prompts, max_new_tokens=4, steps=steps),
        generate(llama, prompts, max_new_tokens=4),
    )
    assert list(steps.exported.runners.values()) == [None]
    other = qkv_model("tiny-mistral")
    steps = decoding_steps(other, "auto")
    generate(other, prompt, max_new_tokens=4, steps=steps)
    assert list(steps.exported.runners.values()) == [None]
    assert len(store[1]) == before and elsewhere == []


def test_a_half_precision_cache_has_a_library_of_its_own(llama, store):
    """`kv_dtype=torch.float16`: a library built for that cache (stored apart from the fp32
    cache's), with the eager steps' tokens and logits over the same cache. Last in the module:
    the tests above count the fixture's compilation alone."""
    prompt = torch.arange(1, 8).unsqueeze(0)
    half = {"max_new_tokens": NEW_TOKENS, "kv_dtype": torch.float16}
    compiled = list(decode_steps(llama, prompt, steps=decoding_steps(llama, "aot"), **half))
    eager = list(decode_steps(llama, prompt, **half))
    logits = [torch.stack([s.logits for s in run], 1) for run in (compiled, eager)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert [int(s.tokens[0]) for s in compiled] == [int(s.tokens[0]) for s in eager]
    assert compiled[-1].cache.keys[0].dtype == torch.float16
    assert store[1].count(llama) == 2  # the fixture's, and this cache's
    stored = sorted(path.name for path in store[0].rglob("exported-b1-*.pt2"))
    assert "exported-b1-int64-int64-kv-float16.pt2" in stored
