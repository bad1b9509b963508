"""compile="auto" (qkv.acceleration.auto): eager steps until the compiled ones pay for
themselves by the rent-or-buy rule, at once when the model's graphs are in memory, and never
where compiled steps do not serve the call. The rule runs on a stand-in model and clock (each
eager step takes one second); the real path on a tiny model."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from qkv.acceleration import auto, exported
from qkv.acceleration.auto import PROBE_STEPS, SAVED_FRACTION, AutoSteps
from qkv.generation import generate
from tests.generation.reference_models import qkv_model


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _OneSecondSteps(nn.Module):
    """An eager step that takes one second of the stand-in clock."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def forward(self, step):
        self.clock.now += 1.0
        return ("eager", step)


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(auto.time, "perf_counter", clock)
    return clock


def _run(model, steps, cost):
    """The kinds of step ("eager" or "compiled") of one call of `steps` steps."""
    compiled = []

    def compile(m):
        compiled.append(m)
        return lambda step: ("compiled", step)

    runner = AutoSteps(model, steps, cost=lambda m: cost, compile=compile)
    return [runner(step)[0] for step in range(steps)], compiled


def test_graphs_in_memory_are_used_from_the_first_step(clock):
    kinds, compiled = _run(_OneSecondSteps(clock), steps=5, cost=0.0)
    assert kinds == ["compiled"] * 5 and len(compiled) == 1


def test_a_long_call_switches_after_the_probe_and_a_short_one_stays_eager(clock):
    steps = 100  # 100 one-second steps: 50 s saved by the rule's count
    kinds, _ = _run(_OneSecondSteps(clock), steps, cost=40.0)
    assert kinds == ["eager"] * PROBE_STEPS + ["compiled"] * (steps - PROBE_STEPS)
    kinds, compiled = _run(_OneSecondSteps(clock), steps, cost=60.0)  # a new model
    assert kinds == ["eager"] * steps and not compiled


def test_repeated_short_calls_switch_once_the_time_spent_covers_the_cost(clock):
    """Rent or buy: calls of 10 one-second steps against a cost of 30 s. The rule counts what
    the model already spent, so the call that starts past 2 x 30 s - its own steps switches."""
    model, cost, steps = _OneSecondSteps(clock), 30.0, 10
    history = []
    for _ in range(8):
        kinds, _ = _run(model, steps, cost)
        history.append(kinds.count("compiled"))
        if history[-1]:
            break
    spent_before_switch = steps * (len(history) - 1) + PROBE_STEPS
    assert history[:-1] == [0] * (len(history) - 1) and history[-1] == steps - PROBE_STEPS
    # switched at the first probe where spent + steps left reached cost / SAVED_FRACTION
    assert spent_before_switch + (steps - PROBE_STEPS) >= cost / SAVED_FRACTION
    assert spent_before_switch - steps + (steps - PROBE_STEPS) < cost / SAVED_FRACTION


def test_auto_on_a_real_model_compiles_nothing_for_a_short_call_then_uses_the_step_in_memory(
    monkeypatch,
):
    """The default decodes a short call eagerly (nothing compiled); once compile="aot"
    compiled the model's step, the default uses it from the first step, with the same tokens;
    compile=True's graphs are not what it switches to."""
    model = qkv_model("tiny-llama")
    prompt = torch.arange(1, 6).unsqueeze(0)  # (1, 5)
    counters.clear()
    libraries = []
    real = exported._compile
    monkeypatch.setattr(exported, "_compile", lambda *a: libraries.append(1) or real(*a))
    eager = generate(model, prompt, max_new_tokens=6, compile=False)
    assert torch.equal(generate(model, prompt, max_new_tokens=6), eager)
    assert not counters["stats"]["unique_graphs"] and not libraries
    generate(model, prompt, max_new_tokens=6, compile="aot")
    assert exported.compile_seconds(model) == 0.0 and len(libraries) == 1
    runner = auto.auto_steps(model, 5)
    assert isinstance(runner.compiled, exported.ExportedSteps)  # from the first step
    assert torch.equal(generate(model, prompt, max_new_tokens=6), eager)
    assert len(libraries) == 1


def test_auto_decodes_eagerly_where_compiled_steps_do_not_serve(monkeypatch):
    from qkv import capabilities

    model = qkv_model("tiny-llama")
    missing = capabilities.Support(False, "no C++ compiler was found (install g++)")
    monkeypatch.setattr(capabilities, "compiler", lambda: missing)
    compiled = []
    runner = AutoSteps(model, 5, cost=lambda m: 0.0, compile=compiled.append)  # would switch
    assert runner.compiled is None and not compiled  # asked only then: eager, nothing compiled
    prompt = torch.arange(1, 6).unsqueeze(0)
    beams = generate(model, prompt, max_new_tokens=4, num_beams=2)  # no refusal by default
    assert beams.shape == (1, 9)


def test_a_greedy_step_is_the_compiled_steps_once_switched_to_them(clock):
    """`greedy` (a step that chooses too): None while the steps are eager, nothing counted;
    the compiled steps' own once switched to them, counted as a step."""

    class Compiled:
        def greedy(self, *args):
            return ("chosen", args)

    def steps(cost):
        model = _OneSecondSteps(clock)
        return AutoSteps(model, 10, cost=lambda m: cost, compile=lambda m: Compiled())

    eager = steps(1e9)
    assert eager.greedy(1, 2, 3) is None and eager.left == 10
    switched = steps(0.0)
    assert switched.greedy(1, 2, 3) == ("chosen", (1, 2, 3)) and switched.left == 9
