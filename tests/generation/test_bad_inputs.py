"""Nothing quietly accepted by decoding: an attention_mask that is not a left-padded 0/1 mask
with a real token in every row fails at the call, naming attention_mask; logits that stop being
finite fail at the step where they did, naming the model, instead of decoding token 0 forever.
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation import decode_steps, generate, stream
from qkv.generation.loop import Logits
from qkv.generation.sampling import LogitsCheck
from tests.generation.reference_models import left_padded_prompts, qkv_model

NAN, INF = float("nan"), float("inf")


def _mask_with(row: int, values: list[float]) -> torch.Tensor:
    _, mask = left_padded_prompts()  # (3, 9), long
    mask = mask.clone()
    mask[row] = torch.tensor(values)
    return mask


# (description, attention_mask, expected error, message)
BAD_MASKS = [
    ("one row all zeros", _mask_with(1, [0] * 9), ValueError,
     r"attention_mask: rows \[1\] are all 0 .*expected at least one 1 in every row"),
    ("every row all zeros", torch.zeros(3, 9, dtype=torch.long), ValueError,
     r"attention_mask: rows \[0, 1, 2\] are all 0"),
    ("right padding", _mask_with(2, [1] * 7 + [0] * 2), ValueError,
     r"attention_mask: rows \[2\] have a 0 after a 1 \(right padding.*expected left padding"),
    ("a gap inside a row", _mask_with(0, [0, 1, 1, 0, 1, 1, 1, 1, 1]), ValueError,
     r"attention_mask: rows \[0\] have a 0 after a 1"),
    ("values other than 0 and 1", _mask_with(0, [2] * 9), ValueError,
     r"attention_mask: expected 0/1 \(or bool\) values.*got the values \[0, 1, 2\]"),
    ("NaN in a float mask", _mask_with(0, [NAN] + [1.0] * 8).float(), ValueError,
     r"attention_mask: expected 0/1"),
    ("a mask on another device", torch.ones(3, 9, device="meta"), ValueError,
     r"attention_mask: on device meta, expected input_ids' device cpu"),
]  # fmt: skip


@pytest.mark.parametrize("entry", [generate, stream, decode_steps], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("description", "mask", "error", "message"), BAD_MASKS, ids=[c[0] for c in BAD_MASKS]
)
def test_a_bad_attention_mask_fails_at_the_call(entry, description, mask, error, message):
    model = qkv_model("tiny-llama")
    ids, _ = left_padded_prompts()
    with pytest.raises(error, match=message):
        entry(model, ids, attention_mask=mask, max_new_tokens=2)


def test_a_bool_mask_and_its_0_1_twin_decode_alike():
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    as_bool = generate(model, ids, attention_mask=mask.bool(), max_new_tokens=3)
    assert torch.equal(as_bool, generate(model, ids, attention_mask=mask, max_new_tokens=3))
    assert torch.equal(as_bool, generate(model, ids, attention_mask=mask.float(), max_new_tokens=3))


def _spoil_logits(model, from_call: int, value: float, rows=slice(None), tokens=slice(None)):
    """From the model's `from_call`-th forward on (0 = the prompt's), set the logits of `rows`
    and `tokens` to `value`."""
    calls = []

    def hook(module, args, output):
        if len(calls) >= from_call:
            output.logits[rows, :, tokens] = value
        calls.append(None)

    return model.register_forward_hook(hook)


# (description, spoiled from call, value, rows, tokens, sampling options, step, rows in message)
BAD_LOGITS = [
    ("NaN logits from the prompt on, greedy", 0, NAN, slice(None), slice(None), {}, 0,
     r"\[0, 1, 2\]"),
    ("NaN logits from step 2 on, greedy", 2, NAN, slice(None), slice(None), {}, 2, r"\[0, 1, 2\]"),
    ("NaN in one row's one logit, greedy", 1, NAN, 1, 5, {}, 1, r"\[1\]"),
    ("+inf in one logit", 1, INF, 2, 7, {}, 1, r"\[2\]"),
    ("-inf for every token of a row", 3, -INF, 0, slice(None), {}, 3, r"\[0\]"),
    ("NaN logits while sampling", 1, NAN, slice(None), slice(None),
     {"temperature": 1.0, "seed": 0}, 1, r"\[0, 1, 2\]"),
    ("NaN logits with an eos token", 2, NAN, slice(None), slice(None), {"eos_token_id": 99}, 2,
     r"\[0, 1, 2\]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("description", "call", "value", "rows", "tokens", "options", "step", "named_rows"),
    BAD_LOGITS,
    ids=[c[0] for c in BAD_LOGITS],
)
def test_non_finite_logits_fail_at_their_step(
    description, call, value, rows, tokens, options, step, named_rows
):
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    handle = _spoil_logits(model, call, value, rows, tokens)
    yielded = []
    message = rf"model: its next-token logits at decoding step {step} .*not finite in rows "
    with pytest.raises(ValueError, match=message + named_rows):
        for tokens_of_step in stream(model, ids, attention_mask=mask, max_new_tokens=6, **options):
            yielded.append(tokens_of_step)
    handle.remove()
    assert len(yielded) == step  # the steps before the bad one came out, and no later one


def test_minus_inf_for_some_tokens_is_a_models_way_to_rule_them_out():
    """The control: -inf on some logits (not all of a row) decodes, and never picks them."""
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    handle = _spoil_logits(model, 0, -INF, slice(None), slice(0, 50))
    output = generate(model, ids, attention_mask=mask, max_new_tokens=4)
    handle.remove()
    assert (output[:, ids.shape[1] :] >= 50).all()


def test_off_the_cpu_the_check_is_read_once_after_the_last_step():
    """Where a host sync per token would stall an accelerator's queue (`at_once=False`): a
    failing row is chosen from zeros until the check is read, which names the first bad step."""
    check = LogitsCheck(torch.device("cpu"), at_once=False)
    good = torch.randn(2, 5)
    bad = good.clone()
    bad[1, 3] = NAN
    assert torch.equal(check.choosable(Logits(good), 0).logits, good)
    chosen = check.choosable(Logits(bad), 1).logits
    assert torch.equal(chosen, torch.stack((good[0], torch.zeros(5))))
    check.choosable(Logits(bad), 2)
    with pytest.raises(ValueError, match=r"model: .*at decoding step 1 .*not finite \(NaN"):
        check.finish()
    with pytest.raises(ValueError, match=r"at decoding step 1 "):
        check.all_done(torch.tensor([True, True]))
    clean = LogitsCheck(torch.device("cpu"), at_once=False)
    clean.choosable(Logits(good), 0)
    clean.finish()
    assert clean.all_done(torch.tensor([True, True])) is True
