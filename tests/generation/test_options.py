"""One options object for generate, stream and decode_steps: given whole, field by field, or
both, it decodes the same tokens, and a bad field is refused when the object is made."""

import pytest
import torch

from qkv.generation import DecodeOptions, decode_steps, generate, stream
from tests.generation.reference_models import left_padded_prompts, qkv_model


def test_the_object_and_its_fields_by_name_decode_the_same_tokens():
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts()
    fields = {"max_new_tokens": 6, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3}
    options = DecodeOptions(**fields)
    by_name = generate(model, ids, attention_mask=mask, **fields)
    assert torch.equal(generate(model, ids, options, attention_mask=mask), by_name)
    streamed = torch.stack(list(stream(model, ids, options, attention_mask=mask)), dim=1)
    assert torch.equal(streamed, by_name[:, ids.shape[1] :])
    steps = list(decode_steps(model, ids, options, attention_mask=mask))
    assert torch.equal(torch.stack([s.tokens for s in steps], 1), streamed)
    # fields given beside the object replace its own
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(generate(model, ids, options, attention_mask=mask, temperature=0.0), greedy)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: DecodeOptions(max_new_tokens=-1), ValueError, r"max_new_tokens: expected an int"),
        (lambda: DecodeOptions(max_new_tokens=2, top_p=1.5), ValueError, r"top_p: expected a prob"),
        (lambda: DecodeOptions(max_new_tokens=2, sinks=(1,)), ValueError, r"sinks: expected \("),
        (lambda: DecodeOptions(max_new_tokens=2, seed=1.5), TypeError, r"seed: expected an int"),
        (lambda: DecodeOptions(max_new_tokens=2, compile=True), TypeError, r"unexpected keyword"),
    ],
)  # fmt: skip
def test_a_bad_field_is_refused_when_the_object_is_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_unknown_or_missing_fields_are_named():
    model = qkv_model("tiny-llama")
    ids, _ = left_padded_prompts()
    with pytest.raises(TypeError, match=r"max_tokens: not a decoding option"):
        generate(model, ids, max_tokens=3)
    with pytest.raises(TypeError, match=r"max_new_tokens: missing"):
        generate(model, ids)
    with pytest.raises(TypeError, match=r"options: expected a DecodeOptions"):
        generate(model, ids, {"max_new_tokens": 3})
