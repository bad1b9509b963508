"""Greedy search, sampling and beam search are strategies of one decoding loop, which decoder-only
and encoder-decoder models both go through.

Outside references: transformers' `generate(num_beams=...)` on the same GPT-2 / Llama / Mistral
weights (sequences and `sequences_scores`); for the encoder-decoder, teacher-forced argmax logits
of the full target and its existing exhaustive beam-search checks (test_beam.py).
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation import DecodeOptions, beam_search, decode_steps, generate, greedy_decode, stream
from qkv.models import GPT, Transformer, TransformerConfig
from tests.generation.reference_models import hf_model, left_padded_prompts, qkv_model

NEW_TOKENS = 8
PROMPT_LENGTH = 9
MODELS = ["gpt2", "llama-gqa", "mistral-window-4"]


@pytest.fixture(scope="module", params=MODELS)
def pair(request, tmp_path_factory):
    """(transformers model, the same weights loaded into qkv)."""
    reference = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    return reference, GPT.from_pretrained(path)


def _transformers_beams(reference, ids, mask, eos, **kwargs):
    with torch.no_grad():
        output = reference.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
            eos_token_id=eos, pad_token_id=0 if eos is None else eos,
            return_dict_in_generate=True, output_scores=True, **kwargs,
        )  # fmt: skip
    return output.sequences, output.sequences_scores


def _first_token_of_the_best(model, ids, mask) -> tuple[int, torch.Tensor]:
    """The first new token of the first prompt's best hypothesis, and that hypothesis: as the
    end token, it ends at once the hypothesis that would otherwise win."""
    free, _ = beam_search(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, num_beams=4)
    return int(free[0, PROMPT_LENGTH]), free[0]


@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "eos"])
@pytest.mark.parametrize(
    "search",
    [
        {"num_beams": 4, "length_penalty": 1.0, "early_stopping": True},
        {"num_beams": 4, "length_penalty": 0.6, "early_stopping": False},
        {"num_beams": 3, "length_penalty": -1.0, "early_stopping": False},
    ],
    ids=["lp1-early", "lp0.6-search-on", "lp-1"],
)
def test_decoder_only_beam_search_equals_transformers(pair, with_eos, search):
    reference, model = pair
    ids, mask = left_padded_prompts(PROMPT_LENGTH, seed=7)
    eos, best_without_eos = _first_token_of_the_best(model, ids, mask) if with_eos else (None, None)
    count = search["num_beams"] - 1
    expected, expected_scores = _transformers_beams(
        reference, ids, mask, eos, num_return_sequences=count, **search
    )
    got, scores = beam_search(
        model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
        num_return_sequences=count, **search,
    )  # fmt: skip
    assert torch.equal(got, expected)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)
    if with_eos:  # the end token changed the search: the winner without it is gone
        assert not torch.equal(got[0, : best_without_eos.shape[0]], best_without_eos)
    best = generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                    eos_token_id=eos, **search)  # fmt: skip
    assert torch.equal(best, expected[::count][:, : best.shape[1]])


def test_beam_steps_name_their_parents_and_sinks_reorder_like_the_static_cache():
    model = qkv_model("tiny-llama")
    ids, mask = left_padded_prompts(PROMPT_LENGTH, seed=7)
    steps = list(decode_steps(model, ids, attention_mask=mask, max_new_tokens=4, num_beams=3))
    assert steps[0].logits.shape == (3, model.config.vocab_size)  # one row per prompt
    assert steps[0].parents.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # B prompts -> B * K rows
    for step in steps[1:]:  # beams move only within their prompt
        assert step.logits.shape[0] == 9 and bool((step.parents // 3 == torch.arange(9) // 3).all())
    assert all(step.parents is None for step in decode_steps(model, ids, max_new_tokens=2))
    # a StreamingLLM cache that evicts nothing reorders its rows as the static cache does
    prompt = ids[:1]
    static = generate(model, prompt, max_new_tokens=6, num_beams=3)
    assert torch.equal(
        generate(model, prompt, max_new_tokens=6, num_beams=3, sinks=(2, 20)), static
    )


def _translation_model(seed: int = 3) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig.from_name(
        "transformer-tiny", src_vocab_size=12, tgt_vocab_size=12, dropout=0.0
    )
    model = Transformer(config).eval()
    with torch.no_grad():  # larger weights: no near-ties between the best two tokens
        for parameter in model.parameters():
            parameter.mul_(4.0)
    return model


def test_encoder_decoder_decodes_through_generate():
    model = _translation_model()
    sources = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 3, 0, 0]])
    source_mask = sources != 0
    target = generate(model, sources, attention_mask=source_mask, max_new_tokens=6)
    assert target.shape[0] == 2 and bool((target[:, 0] == model.config.bos_token_id).all())
    with torch.no_grad():  # every token is the argmax of the teacher-forced logits before it
        logits = model(sources, source_mask, decoder_input_ids=target[:, :-1]).logits
    for row in range(2):
        tokens = target[row, 1:].tolist()
        end = tokens.index(2) + 1 if 2 in tokens else len(tokens)
        assert tokens[:end] == logits[row, :end].argmax(-1).tolist()
        assert all(token == 2 for token in tokens[end:])  # padded with the end token
    # greedy_decode scores the same tokens (padded with pad_token_id instead)
    scored, _ = greedy_decode(model, sources, attention_mask=source_mask, max_new_tokens=6)
    ended = torch.cumsum((target == 2).long(), dim=1) - (target == 2).long() > 0
    assert torch.equal(scored, target.masked_fill(ended, model.config.pad_token_id))
    # sampling with top_k=1 is greedy; beam search's best is beam_search's first hypothesis
    sampled = generate(model, sources, attention_mask=source_mask, max_new_tokens=6,
                       temperature=0.7, top_k=1, seed=0)  # fmt: skip
    assert torch.equal(sampled, target)
    beams = generate(model, sources, attention_mask=source_mask, max_new_tokens=6, num_beams=3)
    best, _ = beam_search(model, sources, attention_mask=source_mask, max_new_tokens=6,
                          num_beams=3)  # fmt: skip
    assert torch.equal(beams.masked_fill(beams == 2, 0), best.masked_fill(best == 2, 0))


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"num_beams": 0}, ValueError, r"num_beams: expected an int >= 1, got 0"),
        ({"num_beams": 2, "temperature": 0.5}, ValueError, r"num_beams: beam search is determ"),
        ({"length_penalty": float("inf")}, ValueError, r"length_penalty: expected a finite"),
        ({"early_stopping": "never"}, TypeError, r"early_stopping: expected a bool, got str"),
    ],
)  # fmt: skip
def test_bad_beam_options_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        DecodeOptions(max_new_tokens=2, **fields)


def test_beam_search_refuses_what_it_cannot_do():
    model = qkv_model("tiny-llama")
    ids, _ = left_padded_prompts()
    with pytest.raises(ValueError, match=r"num_beams: beam search knows its tokens only at"):
        stream(model, ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match=r"on_token: beam search knows its tokens only at"):
        generate(model, ids, max_new_tokens=2, num_beams=2, on_token=print)
    translation = _translation_model()
    with pytest.raises(ValueError, match=r"sinks: StreamingLLM caches are for decoder-only"):
        generate(translation, ids % 12, max_new_tokens=2, sinks=(1, 4))
    with pytest.raises(ValueError, match=r"max_new_tokens: the start token \+ 200 new tokens"):
        generate(translation, ids % 12, max_new_tokens=200)
    with pytest.raises(TypeError, match=r"model: expected a qkv.models.Transformer .* or a qkv"):
        beam_search(torch.nn.Linear(2, 2), ids, max_new_tokens=2)
