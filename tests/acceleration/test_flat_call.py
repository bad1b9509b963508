"""`FlatCall`: once two recorded steps explain where every graph input comes from and what the
forward does with the outputs, and a third confirms it, the graph runs without the rewritten
forward, with the same results and side effects; what cannot be explained keeps the forward.
Checked on a hand-written "rewritten forward" (what torch.compile's does, in a few lines) and
on compiled decoding of real models against eager decoding."""

from dataclasses import dataclass

import pytest
import torch

from qkv.acceleration import flat_call as flat_module
from qkv.acceleration.flat_call import FlatCall, _Recording
from qkv.generation import decode_steps
from tests.generation.reference_models import left_padded_prompts, qkv_model


@dataclass(frozen=True)
class _Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class _Cache:
    def __init__(self) -> None:
        self.length = 3
        self.keys = (torch.zeros(2, 16), torch.zeros(2, 16))


class _Model:
    def __init__(self) -> None:
        self.weight = torch.arange(1.0, 5.0)  # a parameter: the same tensor at every step
        self.walks = 0  # how often the forward gathered its inputs from the model


def _graph(weight, tokens, length, keys0, keys1, size):
    """The compiled graph's stand-in: writes the cache, returns logits and the new length."""
    keys0[:, length] = tokens.float()
    keys1[:, length] = -tokens.float()
    logits = tokens.float().unsqueeze(-1) * weight + length * size
    return [logits, length + 1]


def _set_length(cache, outputs):
    cache.length = outputs[1]


def _rewritten_forward(graph, sets=_set_length, result=lambda outputs: _Output(outputs[0])):
    """What torch.compile's rewritten forward does: gather the inputs (the model's among
    them), call the graph, set the cache's length and build the result from the outputs."""

    def fn(model, tokens, *, cache, label=None):
        model.walks += 1
        inputs = (model.weight, tokens, cache.length, *cache.keys, cache.keys[0].shape[1])
        outputs = graph(*inputs)
        sets(cache, outputs)
        return result(outputs)

    return fn


def _flat(graph=_graph, **options):
    recording = _Recording(graph)
    return FlatCall(_rewritten_forward(graph, **options), _rewritten_forward(recording, **options),
                    recording)  # fmt: skip


def _decode(step, steps=6):
    """(model, cache, outputs) after `steps` steps of `step` on a fresh model and cache."""
    model, cache = _Model(), _Cache()
    outputs = []
    for i in range(steps):
        tokens = torch.tensor([i, 10 + i])
        outputs.append(step(model, (tokens,), {"cache": cache}))
    return model, cache, outputs


def test_after_two_recorded_steps_and_a_checked_one_the_graph_runs_without_the_forward():
    forward = _rewritten_forward(_graph)
    _, expected_cache, expected = _decode(lambda m, a, k: forward(m, *a, **k))
    flat = _flat()
    model, cache, outputs = _decode(flat)
    assert model.walks == 3  # steps 1-2 recorded, step 3 checked the plan: steps 4-6 direct
    assert flat.checked and flat.failed is None
    for got, want in zip(outputs, expected, strict=True):
        assert isinstance(got, _Output) and got.loss is None
        assert torch.equal(got.logits, want.logits)
    assert cache.length == expected_cache.length == 9
    for got, want in zip(cache.keys, expected_cache.keys, strict=True):
        assert torch.equal(got, want)


def test_a_call_of_another_form_runs_through_the_forward():
    flat = _flat()
    model, cache, _ = _decode(flat, steps=4)
    tokens = torch.tensor([1, 2])
    output = flat(model, (tokens,), {"cache": cache, "label": None})  # a keyword more
    assert model.walks == 4 and cache.length == 8
    assert torch.equal(output.logits, tokens.float().unsqueeze(-1) * model.weight + 7 * 16)


@pytest.mark.parametrize(
    "why, flat",
    [
        ("an attribute set to what no output holds",
         lambda: _flat(sets=lambda cache, outputs: setattr(cache, "length", outputs[1] + 1))),
        ("a result that is not an output",
         lambda: _flat(result=lambda outputs: _Output(outputs[0] + 0))),
    ],
)  # fmt: skip
def test_what_the_plan_cannot_explain_keeps_the_forward(why, flat):
    flat = flat()
    model, cache, outputs = _decode(flat)
    assert model.walks == 6, why
    assert flat.failed is not None and flat.plan is None


def test_an_input_that_changes_unseen_is_caught_by_the_checked_step():
    """A graph input the plan takes for a constant (the same at the two recorded steps), but
    that changes at the third: the check fails and the forward stays."""
    state = {"extra": 5}

    def fn(model, tokens, *, cache):
        model.walks += 1
        state["extra"] += 1 if model.walks == 3 else 0
        outputs = recording(model.weight, tokens, cache.length, state["extra"])
        return _Output(outputs[0])

    recording = _Recording(lambda weight, tokens, length, extra: [tokens * weight[0] + extra])
    flat = FlatCall(fn, fn, recording)
    model, _, _ = _decode(flat)
    assert model.walks == 6 and flat.failed is not None


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-mistral"])
def test_compiled_decoding_runs_its_later_steps_through_the_plan(preset, monkeypatch):
    """A left-padded batch (the key mask grows every step), learned positions or RoPE with a
    window: the steps the plan runs give eager decoding's tokens and logits."""
    planned = []
    call = flat_module._Plan.call
    monkeypatch.setattr(
        flat_module._Plan, "call", lambda plan, *a: (planned.append(1), call(plan, *a))[1]
    )
    model = qkv_model(preset)
    ids, mask = left_padded_prompts()
    new = 10

    def decode(**options):
        steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=new, **options))
        return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)

    eager_tokens, eager_logits = decode()
    tokens, logits = decode(compile=True)
    assert len(planned) == new - 1 - 5  # the prefill, then 2 checked, 2 recorded, 1 check
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
