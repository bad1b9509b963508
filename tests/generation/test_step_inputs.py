"""What `qkv.generate` feeds the model at each step, to spare work transformers spares too:
only the last position's logits (GPT's `logits_to_keep`, checked against transformers' argument
of that name), the range check of the prompt's ids only (`check_ids`), and no mask when the
prompt has no padding. The tokens must stay those of transformers' greedy `generate`."""

from __future__ import annotations

import pytest
import torch

from qkv.generation import generate
from qkv.models import GPT
from tests.generation.reference_models import VOCAB, hf_model, left_padded_prompts

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Llama with GQA, the same weights loaded into qkv)."""
    reference = hf_model("llama-gqa")
    path = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(path)
    return reference, GPT.from_pretrained(path)


def test_logits_to_keep_gives_the_last_logits_transformers_gives(pair):
    reference, model = pair
    input_ids, attention_mask = left_padded_prompts(length=9, seed=7)
    with torch.no_grad():
        expected = reference(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=2
        ).logits
        got = model(input_ids, attention_mask=attention_mask, logits_to_keep=2)
    assert got.logits.shape == expected.shape == (3, 2, VOCAB)
    assert got.last_hidden_state.shape[1] == 9  # the hidden states of every position stay
    torch.testing.assert_close(got.logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"logits_to_keep": 0}, ValueError, "logits_to_keep: expected an int >= 1 or None, got 0"),
        ({"logits_to_keep": True}, TypeError, "logits_to_keep: expected an int >= 1 or None"),
        ({"logits_to_keep": 1, "labels": "ids"}, ValueError, "the loss needs the logits of every"),
        ({"check_ids": True}, ValueError, r"input_ids: expected token ids in \[0, 100\)"),
    ],
)
def test_bad_decoding_options_are_refused(pair, options, error, match):
    _, model = pair
    input_ids = torch.tensor([[1, 2, VOCAB if "check_ids" in options else 3]])
    if options.get("labels") == "ids":
        options = {**options, "labels": input_ids}
    with pytest.raises(error, match=match):
        model(input_ids, **options)


def test_check_ids_false_skips_only_the_range_check(pair):
    """Without the check an id outside the vocabulary reaches the embedding, whose own error
    is less clear: the option is for ids a caller knows to be in range (generate's own)."""
    _, model = pair
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 2, VOCAB]]), check_ids=False)


@pytest.mark.parametrize("padded", [False, True])
def test_generate_checks_the_prompt_once_and_masks_only_padding(pair, padded):
    reference, model = pair
    input_ids, attention_mask = left_padded_prompts(length=9, seed=7)
    if not padded:
        input_ids, attention_mask = input_ids[:1], attention_mask[:1]  # row 0 has no padding
    calls = []

    def record(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        calls.append((kwargs["check_ids"], kwargs["logits_to_keep"], mask))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        got = generate(model, input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS)
    finally:
        hook.remove()
    with torch.no_grad():
        expected = reference.generate(
            input_ids, attention_mask=attention_mask, do_sample=False,
            max_new_tokens=NEW_TOKENS, pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(got, expected)
    assert [check for check, _, _ in calls] == [True] + [False] * (NEW_TOKENS - 1)
    assert all(keep == 1 for _, keep, _ in calls)
    masks = [mask for _, _, mask in calls]
    if padded:  # every step's mask covers the prompt and the tokens generated so far
        assert [mask.shape[1] for mask in masks] == list(range(9, 9 + NEW_TOKENS))
    else:
        assert masks == [None] * NEW_TOKENS
