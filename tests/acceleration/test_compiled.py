"""`compile=True`: decoding steps through the model's forward compiled by torch.compile give
the tokens and logits of eager decoding (itself checked against recomputing the whole prefix
and against transformers elsewhere), with oneDNN-packed linears too, and one graph serves
every step and every later call."""

import pytest
import torch
from torch._dynamo.utils import counters

from qkv.acceleration import packed_linears
from qkv.acceleration.compiled import CompiledSteps
from qkv.generation import decode_steps, generate
from tests.generation.reference_models import left_padded_prompts, qkv_model, redraw

NEW_TOKENS = 10


def _steps(model, ids, mask, new_tokens=NEW_TOKENS, **options):
    """(tokens (B, new), logits (B, new, V)) of greedy decoding."""
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=new_tokens,
                              **options))  # fmt: skip
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-mistral"])
def test_compiled_steps_equal_eager_ones_on_a_left_padded_batch(preset):
    """GPT-2 (learned positions, LayerNorm, biases) and Mistral (RoPE, GQA, a window of 4
    that the 21 decoded tokens outgrow): padding masks, positions and cache writes compiled."""
    model = qkv_model(preset)
    ids, mask = left_padded_prompts()
    eager_tokens, eager_logits = _steps(model, ids, mask)
    tokens, logits = _steps(model, ids, mask, compile=True)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)


def test_a_relative_position_bias_compiles_at_batch_2():
    """T5's bias (1, H, L_q, L_k) against a symbolic batch size: it broadcasts (a tuple test
    of its sizes once failed under torch.compile)."""
    model = qkv_model("tiny-gpt2", position="t5")
    prompts = torch.arange(2, 12).view(2, 5)
    # 3 tokens: a T5-bias model's graph still fails its guards at every new length (one graph
    # per step: slow to compile, not wrong), so a longer call only costs test time
    eager_tokens, eager_logits = _steps(model, prompts, None, new_tokens=3)
    tokens, logits = _steps(model, prompts, None, new_tokens=3, compile=True)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)


@pytest.mark.parametrize("prompt_length", [1, 2])
def test_compiled_steps_stay_right_as_the_cache_grows_past_the_window(prompt_length):
    """From the third step on the compiled steps trust their guards (compiled.py,
    `CompiledSteps`): a one-token prompt (a cache length of 1 at the first step, which
    torch.compile specialises) and Mistral's window of 4, first outgrown at a later step."""
    model = qkv_model("tiny-mistral")
    prompt = torch.arange(1, prompt_length + 1).unsqueeze(0)  # (1, prompt_length)
    eager_tokens, eager_logits = _steps(model, prompt, None)
    tokens, logits = _steps(model, prompt, None, compile=True)
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
        output = generate(model, prompt, max_new_tokens=NEW_TOKENS, compile=True)
        assert torch.equal(output, expected)
        graphs = counters["stats"]["unique_graphs"]
        longer = torch.cat([prompt, prompt], dim=1)  # 14 tokens
        output = generate(model, longer, max_new_tokens=2 * NEW_TOKENS, compile=True)
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert torch.equal(output, generate(model, longer, max_new_tokens=2 * NEW_TOKENS))
    # out of the block: the plain modules again, a graph of their own, then packed once more
    assert torch.equal(generate(model, prompt, max_new_tokens=NEW_TOKENS, compile=True), expected)
    with packed_linears(model):
        assert torch.equal(
            generate(model, prompt, max_new_tokens=NEW_TOKENS, compile=True), expected
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
        generate(model, prompt, max_new_tokens=D - 2, compile=True)  # a cache of D slots
        graphs = counters["stats"]["unique_graphs"]
        output = generate(model, prompt, max_new_tokens=D + 5, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert torch.equal(output, generate(model, prompt, max_new_tokens=D + 5))


def test_compile_refuses_what_it_does_not_serve(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path))  # no graph stored by another test
    model = qkv_model("tiny-llama")
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match='compile: expected "auto", a bool, "guarded" or "aot"'):
        generate(model, prompt, max_new_tokens=2, compile="yes")
    with pytest.raises(ValueError, match="compile: not supported with sinks"):
        generate(model, prompt, max_new_tokens=2, sinks=(1, 4), compile=True)
    no_caches = torch._inductor.config.patch(force_disable_caches=True)
    with no_caches, pytest.raises(RuntimeError, match="force_disable_caches is set"):
        generate(model, prompt, max_new_tokens=2, compile=True)  # nothing compiled yet


class _StandInGraph:
    """What CompiledSteps uses of a compiled forward: `guard_check` and `fn`."""

    def __init__(self, name, calls, passes=lambda step: True, fails=lambda step: False):
        self.name, self.calls, self.passes, self.fails = name, calls, passes, fails

    def guard_check(self, model, step):
        self.calls.append(("check", self.name, step))
        return self.passes(step)

    def fn(self, model, step):
        self.calls.append(("run", self.name, step))
        if self.fails(step):
            raise RuntimeError("a graph that no longer fits")
        return step * 10


def test_steps_check_guards_until_two_steps_passed_the_same_graph_then_run_it_directly():
    """Step 1 finds no graph and compiles one for a cache length of 1 (specialised: its guard
    fails at any other length); step 2 fails that guard and compiles another, which step 3
    passes too: from step 4 on it runs without guards. Stand-in graphs record the calls."""
    calls = []
    compiled = iter([
        _StandInGraph("length 1", calls, passes=lambda step: step == 1),
        _StandInGraph("any length", calls),
    ])  # fmt: skip
    graphs = []
    steps = CompiledSteps("model", graphs, compile=lambda model, args, kwargs: next(compiled))
    assert [steps(step) for step in range(1, 6)] == [10, 20, 30, 40, 50]
    assert [g.name for g in graphs] == ["length 1", "any length"]
    assert calls == [
        ("run", "length 1", 1),
        ("check", "length 1", 2), ("run", "any length", 2),
        ("check", "length 1", 3), ("check", "any length", 3), ("run", "any length", 3),
        ("run", "any length", 4),
        ("run", "any length", 5),
    ]  # fmt: skip

    calls.clear()  # a later call of the same model: its graphs are checked, none compiled
    later = CompiledSteps("model", graphs, compile=None)
    assert [later(step) for step in (7, 8, 9)] == [70, 80, 90]
    assert [c for c in calls if c[0] == "run"] == [("run", "any length", s) for s in (7, 8, 9)]


def test_a_step_that_raises_without_guards_runs_again_with_them_and_so_does_the_next():
    """A graph run without guards raising (a shape it no longer fits, say): the step runs
    again with every guard checked, the next one too; a genuine error raises from the rerun."""
    calls = []
    first_run_of_4 = lambda step: step == 4 and calls.count(("run", "graph", 4)) == 1  # noqa: E731
    graph = _StandInGraph("graph", calls, fails=first_run_of_4)
    steps = CompiledSteps("model", [graph], compile=None)
    assert [steps(step) for step in range(1, 7)] == [10, 20, 30, 40, 50, 60]
    assert calls == [
        ("check", "graph", 1), ("run", "graph", 1),
        ("check", "graph", 2), ("run", "graph", 2),
        ("run", "graph", 3),
        ("run", "graph", 4), ("check", "graph", 4), ("run", "graph", 4),
        ("check", "graph", 5), ("run", "graph", 5),
        ("run", "graph", 6),
    ]  # fmt: skip

    calls.clear()
    broken = _StandInGraph("broken", calls, fails=lambda step: step == 3)
    other = CompiledSteps("model", [broken], compile=None)
    other(1), other(2)
    with pytest.raises(RuntimeError, match="no longer fits"):  # raised by the checked rerun
        other(3)
    assert calls[-3:] == [("run", "broken", 3), ("check", "broken", 3), ("run", "broken", 3)]


def test_two_decodings_interleaved_step_by_step_each_get_their_own_graph():
    """Guards are trusted from the third step of each call: two calls advanced in turns, one
    model packed (PackedLinear products) and one plain, of the same config and different
    weights, each still gets its own graph and weights at every step."""
    plain, packed = qkv_model("tiny-llama"), redraw(qkv_model("tiny-llama"), seed=1)
    prompt = torch.arange(1, 6).unsqueeze(0)  # (1, 5)
    expected = {name: _steps(m, prompt, None) for name, m in (("plain", plain), ("packed", packed))}
    with packed_linears(packed):
        iterators = {
            name: decode_steps(m, prompt, max_new_tokens=NEW_TOKENS, compile=True)
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
        generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, compile=True)
        with packed_linears(model):  # nested: nothing left to pack, nothing forgotten
            pass
    graphs = counters["stats"]["unique_graphs"]
    redraw(model, seed=5)  # in place: the same modules, new values
    expected = _steps(model, ids, mask)
    with packed_linears(model):
        got = _steps(model, ids, mask, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_without_a_cpp_compiler_compile_true_decodes_eagerly_and_says_why(monkeypatch, caplog):
    """A machine without a C++ compiler (torch.compile's CPU kernels need one) gets the eager
    tokens and a logged reason, not a compiler error in the middle of decoding."""
    from qkv import capabilities
    from qkv.acceleration import compiled

    missing = capabilities.Support(False, "no C++ compiler was found (install g++)")
    monkeypatch.setattr(capabilities, "compiler", lambda: missing)
    monkeypatch.setattr(compiled, "_WARNED", [])
    model = qkv_model("tiny-gpt2")
    prompt = torch.arange(1, 4).unsqueeze(0)  # (1, 3)
    counters.clear()
    with caplog.at_level("WARNING", logger="qkv.acceleration.compiled"):
        tokens = generate(model, prompt, max_new_tokens=NEW_TOKENS, compile=True)
    assert torch.equal(tokens, generate(model, prompt, max_new_tokens=NEW_TOKENS))
    assert "decoding eagerly instead: no C++ compiler" in caplog.text
    assert not counters["stats"]["unique_graphs"]  # nothing was compiled


def test_guarded_compile_keeps_to_the_public_api_and_gives_the_eager_steps():
    """compile="guarded": torch.compile alone, every guard checked at every step."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    expected = _steps(model, ids, mask)
    got = _steps(model, ids, mask, compile="guarded")
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_without_the_ahead_of_time_api_compile_true_falls_back_to_guarded_steps(
    monkeypatch, caplog, tmp_path
):
    """The guard-free path calls what torch.compile's public API does not promise
    (aot_compile, the graph's fn and guard_check): taken away, as a torch release may do,
    compile=True decodes through GuardedSteps with the same tokens, and says so once."""
    from qkv.acceleration import compiled

    real_compile = torch.compile

    def compile_without_aot(*args, **kwargs):
        function = real_compile(*args, **kwargs)
        if hasattr(function, "aot_compile"):
            del function.aot_compile  # an attribute of the function torch.compile returns
        return function

    monkeypatch.setattr(torch, "compile", compile_without_aot)
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path))  # no graph stored by another test
    monkeypatch.setattr(compiled, "_WARNED", [])
    model = qkv_model("tiny-gpt2")
    ids, mask = left_padded_prompts()
    expected = _steps(model, ids, mask)
    with caplog.at_level("WARNING", logger="qkv.acceleration.compiled"):
        got = _steps(model, ids, mask, compile=True)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    assert "every step checks its guards" in caplog.text and "aot_compile" in caplog.text
    assert model in compiled._GUARDED and not any(compiled._GRAPHS.get(model, {}).values())
