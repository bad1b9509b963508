"""Bad arguments fail before any decoding, naming the argument, what was seen and what was
expected; rows that reach EOS are padded with it and decoding stops once
every row has."""

from __future__ import annotations

import pytest
import torch

from qkv.generation import decode_steps, generate, stream
from tests.generation.reference_models import left_padded_prompts, qkv_model

BAD_ARGUMENTS = [
    ({"max_new_tokens": -1}, ValueError, r"max_new_tokens: expected an int >= 0, got -1"),
    ({"max_new_tokens": 2.0}, TypeError, r"max_new_tokens: expected an int"),
    ({"top_p": 0.0}, ValueError, r"top_p: expected a probability in \(0, 1\] .*got 0\.0"),
    ({"top_p": 1.5}, ValueError, r"top_p: expected a probability in \(0, 1\] .*got 1\.5"),
    ({"top_k": 0}, ValueError, r"top_k: expected an int >= 1 .*got 0"),
    ({"top_k": 101}, ValueError, r"top_k: 101 exceeds the vocabulary size 100"),
    ({"temperature": -0.5}, ValueError, r"temperature: expected a finite number >= 0"),
    ({"temperature": float("nan")}, ValueError, r"temperature: expected a finite number >= 0"),
    ({"eos_token_id": 100}, ValueError, r"eos_token_id: 100 is outside the vocabulary \[0, 100\)"),
    ({"eos_token_id": -1}, ValueError, r"eos_token_id: -1 is outside the vocabulary"),
    ({"eos_token_id": 2.0}, TypeError, r"eos_token_id: expected an int or None, got 2\.0"),
    (
        {"max_new_tokens": 60},
        ValueError,
        r"input_ids: 9 prompt tokens \+ max_new_tokens=60 "
        r"exceed the model's context of 64",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_ARGUMENTS)
@pytest.mark.parametrize("entry", [generate, stream, decode_steps], ids=lambda f: f.__name__)
def test_bad_arguments_fail_when_called_naming_the_argument(entry, overrides, error, message):
    """stream and decode_steps raise at the call, not at the first next(): nothing decodes."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    arguments = {"max_new_tokens": 4, "temperature": 1.0, **overrides}
    with pytest.raises(error, match=message):
        entry(model, ids, attention_mask=mask, **arguments)


def test_a_prompt_longer_than_the_context_needs_sinks():
    model = qkv_model("tiny-llama")  # context 64
    prompt = torch.ones(1, 70, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids: 70 prompt tokens .* context of 64.*sinks="):
        generate(model, prompt, max_new_tokens=1)
    assert generate(model, prompt, max_new_tokens=1, sinks=(4, 28)).shape == (1, 71)


def test_attention_mask_of_the_wrong_shape():
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(3, 9\)"):
        generate(model, ids, attention_mask=mask[:, 1:], max_new_tokens=2)


def test_max_new_tokens_zero_returns_the_prompt():
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    assert torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=0), ids)


def test_eos_pads_finished_rows_and_stops_when_all_are_done():
    """The EOS id is a token every row emits in a free greedy run (the one all rows reach
    soonest). Expected, built by hand from that run: each row's tokens up to its first EOS,
    then EOS until the last row's first EOS, where decoding stops."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    free = generate(model, ids, attention_mask=mask, max_new_tokens=30)[:, ids.shape[1] :]
    candidates = [t for t in range(100) if bool((free == t).any(dim=1).all())]
    assert candidates, "pick another prompt: no token is emitted by every row"
    first_hits = {t: (free == t).int().argmax(dim=1).tolist() for t in candidates}
    eos = min(candidates, key=lambda t: max(first_hits[t]))
    first = first_hits[eos]
    assert len(set(first)) > 1  # rows finish at different steps
    got = generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos)
    new = got[:, ids.shape[1] :]
    assert new.shape[1] == max(first) + 1 < 30
    for row, step in enumerate(first):
        assert torch.equal(new[row, : step + 1], free[row, : step + 1])
        assert bool((new[row, step:] == eos).all())


def test_one_row_finishing_does_not_stop_the_others():
    """Row 0 emits EOS at once (its first greedy token); the others keep decoding."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    free = generate(model, ids, attention_mask=mask, max_new_tokens=10)[:, ids.shape[1] :]
    eos = int(free[0, 0])
    if bool((free[1:] == eos).any()):
        pytest.fail("pick another prompt: the EOS candidate appears in other rows")
    got = generate(model, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos)
    assert got.shape[1] == ids.shape[1] + 10
    assert bool((got[0, ids.shape[1] :] == eos).all())
    assert torch.equal(got[1:, ids.shape[1] :], free[1:])
