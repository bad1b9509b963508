"""A `PromptCache` keeps the KV cache from one decoding call to the next: a later prompt that
starts with the tokens an earlier call fed the model gives the logits and tokens of the whole
prompt run afresh (the reference: a call without the cache, itself tested against recomputing
the prefix in test_cached_equals_uncached.py)."""

import pytest
import torch

from qkv.generation import PromptCache, decode_steps, stream
from qkv.models import Transformer, TransformerConfig
from tests.generation.reference_models import VOCAB, qkv_model

NEW_TOKENS = 6


def _ids(length: int, seed: int) -> torch.Tensor:
    """(1, length) token ids drawn with `seed`."""
    return torch.randint(VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, prompt_cache=None, **options):
    """(tokens (1, new), logits (1, new, V)) of greedy decoding."""
    options = {"max_new_tokens": NEW_TOKENS, **options}
    steps = list(decode_steps(model, ids, prompt_cache=prompt_cache, **options))
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


def _assert_as_afresh(model, ids, prompt_cache):
    """Decoding `ids` with the cache equals decoding them without it; the cache's tokens."""
    tokens, logits = _decode(model, ids, prompt_cache)
    expected_tokens, expected_logits = _decode(model, ids)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, expected_tokens)
    return tokens


@pytest.mark.parametrize(
    ("preset", "position"),
    [("tiny-gpt2", None), ("tiny-llama", None), ("tiny-llama-mqa", None),
     ("tiny-mistral", None), ("tiny-llama", "alibi"), ("tiny-llama", "t5")],
)  # fmt: skip
def test_a_turn_that_continues_the_cached_tokens_decodes_as_the_whole_prompt(preset, position):
    """The second prompt is the first, its answer and a new message: only the new part goes
    through the model. Learned positions (GPT-2), GQA, MQA, Mistral's window of 4 (which the
    new tokens' queries must apply over the kept keys), ALiBi's and T5's biases."""
    model = qkv_model(preset, **({} if position is None else {"position": position}))
    prompt_cache = PromptCache()
    first = _ids(9, seed=1)
    answer = _assert_as_afresh(model, first, prompt_cache)
    # the prompt, and every chosen token but the last, which was never fed
    assert prompt_cache.ids == first[0].tolist() + answer[0, :-1].tolist()
    second = torch.cat([first, answer, _ids(5, seed=2)], dim=1)
    _assert_as_afresh(model, second, prompt_cache)
    assert prompt_cache.reused == first.shape[1] + NEW_TOKENS - 1


def test_a_prompt_that_departs_from_the_cached_tokens_keeps_their_common_prefix():
    model = qkv_model("tiny-llama")
    prompt_cache = PromptCache()
    first = _ids(12, seed=1)
    _decode(model, first, prompt_cache)
    departing = torch.cat([first[:, :5], (first[:, 5:6] + 1) % VOCAB, _ids(4, seed=3)], dim=1)
    fed = []  # the tokens of each call of the model: with the cache, then afresh
    hook = model.register_forward_pre_hook(lambda _, args: fed.append(args[0].shape[1]))
    _assert_as_afresh(model, departing, prompt_cache)
    hook.remove()
    assert prompt_cache.reused == 5
    steps = [1] * (NEW_TOKENS - 1)
    assert fed == [departing.shape[1] - 5, *steps, departing.shape[1], *steps]
    # the same prompt again: all of it but its last token, whose logits the first choice needs
    _assert_as_afresh(model, departing, prompt_cache)
    assert prompt_cache.reused == departing.shape[1] - 1
    other = torch.cat([(departing[:, :1] + 1) % VOCAB, departing[:, 1:]], dim=1)
    _assert_as_afresh(model, other, prompt_cache)  # nothing shared: the cache's slots reused
    assert prompt_cache.reused == 0


def test_a_longer_conversation_grows_the_cache_and_keeps_its_tokens():
    model = qkv_model("tiny-llama")
    prompt_cache = PromptCache()
    ids = _ids(4, seed=1)
    for turn in range(4):  # 4 + 6 slots, then prompts of 13, 24 and 39 tokens
        answer = _assert_as_afresh(model, ids, prompt_cache)
        assert prompt_cache.cache.max_length >= ids.shape[1] + NEW_TOKENS
        ids = torch.cat([ids, answer, _ids(3 + 2 * turn, seed=10 + turn)], dim=1)
    assert prompt_cache.reused == 24 + NEW_TOKENS - 1


def test_an_abandoned_stream_keeps_the_tokens_that_went_through_the_model():
    """A chat stopped mid-answer (its stream no longer read): the cache holds the prompt and
    the tokens fed before it stopped; the next prompt continues from them."""
    model = qkv_model("tiny-llama")
    prompt_cache = PromptCache()
    prompt = _ids(7, seed=1)
    tokens = stream(model, prompt, max_new_tokens=NEW_TOKENS, prompt_cache=prompt_cache)
    said = [next(tokens) for _ in range(3)]  # the third chosen, not yet fed
    del tokens
    assert prompt_cache.ids == prompt[0].tolist() + [int(t) for t in said[:2]]
    following = torch.cat([prompt, torch.stack(said, dim=1), _ids(2, seed=2)], dim=1)
    _assert_as_afresh(model, following, prompt_cache)
    assert prompt_cache.reused == prompt.shape[1] + 2


def test_another_model_or_dtype_starts_the_cache_afresh():
    prompt_cache = PromptCache()
    prompt = _ids(8, seed=1)
    _decode(qkv_model("tiny-llama"), prompt, prompt_cache)
    other = qkv_model("tiny-llama", position="alibi")
    _assert_as_afresh(other, prompt, prompt_cache)
    assert prompt_cache.reused == 0
    other.double()
    _assert_as_afresh(other, prompt, prompt_cache)
    assert prompt_cache.reused == 0
    assert prompt_cache.cache.keys[0].dtype == torch.float64
    prompt_cache.clear()
    assert prompt_cache.ids == [] and prompt_cache.cache is None


@pytest.mark.parametrize(
    ("change", "named"),
    [({"ids": 2}, "a batch of 2 prompts"), ({"mask": True}, "a padded prompt"),
     ({"num_beams": 2}, "num_beams=2"), ({"sinks": (2, 8)}, "sinks")],
)  # fmt: skip
def test_what_a_prompt_cache_cannot_keep_is_refused_by_name(change, named):
    model = qkv_model("tiny-llama")
    ids = _ids(6, seed=1).repeat(change.get("ids", 1), 1)
    options = {key: value for key, value in change.items() if key in ("num_beams", "sinks")}
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]]) if change.get("mask") else None
    with pytest.raises(ValueError, match=f"prompt_cache: .*{named}"):
        decode_steps(model, ids, attention_mask=mask, max_new_tokens=4,
                     prompt_cache=PromptCache(), **options)  # fmt: skip


def test_a_prompt_cache_and_kv_dtype_are_for_decoder_only_models():
    config = TransformerConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, embed_dim=16,
                               num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                               ffn_dim=32)  # fmt: skip
    with pytest.raises(ValueError, match="kv_dtype: for decoder-only models"):
        decode_steps(Transformer(config).eval(), _ids(5, 1), max_new_tokens=4,
                     kv_dtype=torch.float16)  # fmt: skip
    with pytest.raises(ValueError, match="prompt_cache: for decoder-only models"):
        decode_steps(Transformer(config).eval(), _ids(5, 1), max_new_tokens=4,
                     prompt_cache=PromptCache())  # fmt: skip
    with pytest.raises(TypeError, match="prompt_cache: expected a qkv.generation.PromptCache"):
        decode_steps(qkv_model("tiny-llama"), _ids(5, 1), max_new_tokens=4, prompt_cache={})
