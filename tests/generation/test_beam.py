"""Incremental decoding, beam search and greedy decoding of the encoder-decoder `Transformer`.

What each test compares against, never the cached path itself:
- cached step logits: the teacher-forced `decode` of the whole prefix (at inference the decoder
  is auto-regressive, Vaswani et al. 2017, s3: it sees the prefix, one token more each step), and
  forward-hook call counts;
- beam search: EXHAUSTIVE search over every target up to the length cap on a 5-token vocabulary,
  each scored by teacher-forced full forward passes with the length penalty written out here;
- greedy decoding: the argmax of teacher-forced logits at every position;
- batches: the same sentences decoded one by one, and teacher-forced rescoring of the outputs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qkv.generation import beam_search, greedy_decode
from qkv.layers import CrossAttentionCache, StaticKVCache
from qkv.models import Transformer, TransformerConfig
from qkv.models.encoder_decoder import DecoderCache

PAD, BOS, EOS = 0, 1, 2
VOCAB = 5  # pad, bos, eos and two words: small enough to enumerate every target
MAX_NEW = 4
# two sources of different lengths, right-padded, and each alone
SOURCES = torch.tensor([[3, 4, 4, 3, 4], [4, 3, PAD, PAD, PAD]])
SOURCE_MASK = SOURCES != PAD
SEED_BATCH, SEED_EARLY_STOP = 1, 1  # fixtures where the tested behaviour changes the result


def _model(seed: int = 0, *, norm_first: bool = False, vocab: int = VOCAB) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig.from_name(
        "transformer-tiny",
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        dropout=0.0,
        norm_first=norm_first,
    )
    return Transformer(config).eval()


class _PositionBiasedTransformer(Transformer):
    """A Transformer whose logits get a fixed random (position, token) table added.

    A randomly initialised tiny model prefers one token everywhere, so its best target is a
    repetition or a lone EOS; the table makes the best target vary with the length penalty (an
    EOS in the middle, the length cap, ...). It is added after the real decoder, in cached and
    teacher-forced decoding alike (position = cache.length onwards, or 0 onwards)."""

    def decode(self, decoder_input_ids, memory, *, cache=None, **kwargs):
        start = 0 if cache is None else cache.length
        logits = super().decode(decoder_input_ids, memory, cache=cache, **kwargs)
        return logits + self.position_bias[start : start + decoder_input_ids.shape[1]]


def _biased_model(
    seed: int = 3, *, positions: int = MAX_NEW + 1, scale: float = 1.5, eos_boost: float = 0.0
) -> _PositionBiasedTransformer:
    torch.manual_seed(seed)
    config = TransformerConfig.from_name(
        "transformer-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.0
    )
    model = _PositionBiasedTransformer(config).eval()
    model.position_bias = torch.randn(positions, VOCAB) * scale
    model.position_bias[:, EOS] += eos_boost
    return model


def _count_calls(modules) -> list[int]:
    counts = [0] * len(modules)

    def hook_for(index):
        def hook(module, inputs, output):
            counts[index] += 1

        return hook

    for index, module in enumerate(modules):
        module.register_forward_hook(hook_for(index))
    return counts


# ---------------------------------------------------------------- incremental decoding


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_steps_equal_teacher_forced_logits_and_project_memory_once(norm_first):
    model = _model(1, norm_first=norm_first, vocab=11)
    targets = torch.randint(3, 11, (2, 7))
    blocks = model.decoder.blocks
    cross_k = _count_calls([block.cross_attn.k_proj for block in blocks])
    cross_v = _count_calls([block.cross_attn.v_proj for block in blocks])
    self_k = _count_calls([block.self_attn.k_proj for block in blocks])
    with torch.no_grad():
        memory = model.encode(SOURCES, SOURCE_MASK)
        full = model.decode(targets, memory, memory_mask=SOURCE_MASK)  # (2, 7, V)
        cache = model.new_decoder_cache(2, 7)
        steps = [model.decode(targets[:, :3], memory, memory_mask=SOURCE_MASK, cache=cache)]
        for t in range(3, 7):  # then one token per step
            step = model.decode(targets[:, t : t + 1], memory, memory_mask=SOURCE_MASK, cache=cache)
            steps.append(step)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert cache.length == 7
    assert cross_k == [2, 2] and cross_v == [2, 2]  # the full decode once, the cached one once
    assert self_k == [6, 6]  # the full decode, then 5 cached calls


def test_cached_steps_take_a_target_mask_over_every_cached_key():
    model = _model(3, vocab=11)
    targets = torch.randint(3, 11, (2, 5))
    target_mask = torch.ones(2, 5, dtype=torch.bool)
    target_mask[0, 1] = target_mask[1, 3] = False  # keys nobody may attend to
    with torch.no_grad():
        memory = model.encode(SOURCES, SOURCE_MASK)
        full = model.decode(
            targets, memory, memory_mask=SOURCE_MASK, decoder_attention_mask=target_mask
        )
        cache = model.new_decoder_cache(2, 5)
        steps = [
            model.decode(
                targets[:, t : t + 1], memory, memory_mask=SOURCE_MASK,
                decoder_attention_mask=target_mask[:, : t + 1], cache=cache,
            )
            for t in range(5)
        ]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_reordered_cache_continues_the_rows_it_keeps():
    model = _model(2, vocab=11)
    targets = torch.randint(3, 11, (2, 5))
    index = torch.tensor([1, 0, 1])  # swap, and duplicate a row (what beam search does)
    with torch.no_grad():
        memory = model.encode(SOURCES, SOURCE_MASK)
        cache = model.new_decoder_cache(2, 5)
        model.decode(targets[:, :4], memory, memory_mask=SOURCE_MASK, cache=cache)
        cache.reorder(index)
        step = model.decode(
            targets[index, 4:], memory[index], memory_mask=SOURCE_MASK[index], cache=cache
        )
        full = model.decode(targets[index], memory[index], memory_mask=SOURCE_MASK[index])
    torch.testing.assert_close(step[:, 0], full[:, -1], rtol=0, atol=1e-5)


def test_cache_misuse_raises_clear_errors():
    model = _model()
    memory = model.encode(SOURCES, SOURCE_MASK)
    ids = torch.full((2, 1), BOS)
    with pytest.raises(ValueError, match=r"cache: holds 0 of at most 3 tokens for 1 rows"):
        model.decode(ids, memory, cache=model.new_decoder_cache(1, 3))
    with pytest.raises(ValueError, match=r"expected room for 4 more tokens in 2 rows"):
        model.decode(ids.repeat(1, 4), memory, cache=model.new_decoder_cache(2, 3))
    with pytest.raises(TypeError, match=r"cache: expected a DecoderCache or None, got dict"):
        model.decode(ids, memory, cache={})
    with pytest.raises(ValueError, match=r"max_length: expected an int >= 1, got 0"):
        model.new_decoder_cache(2, 0)
    block = model.decoder.blocks[0]
    x = torch.zeros(2, 1, model.config.embed_dim)
    self_cache = StaticKVCache(
        num_layers=1, batch=2, num_kv_heads=4, head_dim=8, max_length=2
    ).layer(0)
    with pytest.raises(TypeError, match=r"self_cache: expected a qkv.layers.LayerCache"):
        block(x, memory, self_cache=CrossAttentionCache())
    with pytest.raises(TypeError, match=r"cross_cache: expected a qkv.layers.CrossAttentionCache"):
        block(x, memory, cross_cache=self_cache)
    with pytest.raises(ValueError, match=r"cross_attention: expected 2 CrossAttentionCache"):
        DecoderCache(model.new_decoder_cache(2, 2).self_attention, [CrossAttentionCache()])


# ---------------------------------------------------------------- exhaustive reference


def _all_targets() -> list[tuple[int, ...]]:
    """Every target the search can return: words then EOS (1 .. MAX_NEW tokens in all), or
    MAX_NEW words cut by the length cap. A word is any token but EOS."""
    words = [token for token in range(VOCAB) if token != EOS]
    ending = [p + (EOS,) for n in range(MAX_NEW) for p in itertools.product(words, repeat=n)]
    return ending + list(itertools.product(words, repeat=MAX_NEW))


def _teacher_forced_logprobs(model, source, mask, targets: list[tuple[int, ...]]) -> list[float]:
    """Sum of log p(y_t | y_<t, source) for each target, one full forward pass per length."""
    sums = {}
    for length in sorted({len(target) for target in targets}):
        group = [target for target in targets if len(target) == length]
        labels = torch.tensor(group)  # (N, length)
        decoder_input = torch.cat([torch.full((len(group), 1), BOS), labels[:, :-1]], dim=1)
        with torch.no_grad():
            logits = model(
                source.expand(len(group), -1),
                mask.expand(len(group), -1),
                decoder_input_ids=decoder_input,
            ).logits
        logprobs = logits.double().log_softmax(-1).gather(2, labels[..., None])[..., 0]
        sums.update(zip(group, logprobs.sum(dim=1).tolist(), strict=True))
    return [sums[target] for target in targets]


def test_beam_search_finds_the_exhaustive_optimum():
    model = _biased_model()
    targets = _all_targets()
    assert len(targets) == 1 + 4 + 16 + 64 + 256
    sums = [_teacher_forced_logprobs(model, SOURCES[i : i + 1], SOURCE_MASK[i : i + 1], targets)
            for i in range(2)]  # fmt: skip
    # Beam exact: every (beam, token) pair ranks within num_beams (4^3 prefixes x 5 tokens).
    num_beams, top = 4 ** (MAX_NEW - 1) * VOCAB, 8
    winners = set()
    for length_penalty in (0.0, 0.5, 1.0, 2.0):
        sequences, scores = beam_search(
            model, SOURCES, attention_mask=SOURCE_MASK, max_new_tokens=MAX_NEW,
            num_beams=num_beams, length_penalty=length_penalty, num_return_sequences=top,
        )  # fmt: skip
        for row in range(2):
            ranked = sorted(
                (
                    (s / len(t) ** length_penalty, t)
                    for s, t in zip(sums[row], targets, strict=True)
                ),
                reverse=True,
            )[: top + 1]
            gaps = [a[0] - b[0] for a, b in itertools.pairwise(ranked)]
            assert min(gaps) > 1e-4  # no ties among the best: the order is decidable
            for rank, (score, target) in enumerate(ranked[:top]):
                got = sequences[row * top + rank].tolist()
                assert got == [BOS, *target] + [PAD] * (len(got) - 1 - len(target))
                assert scores[row * top + rank].item() == pytest.approx(score, abs=1e-5)
            winners.add((EOS in ranked[0][1], len(ranked[0][1])))
    # the cases cover a hypothesis finished by EOS before the cap, and one cut by the cap
    assert {(True, 2), (False, MAX_NEW)} <= winners


# ---------------------------------------------------------------- beams, greedy, batches


def _rescore(model, sequences, length_penalty: float, max_new: int) -> torch.Tensor:
    """Teacher-forced score of returned sequences [BOS, y..., (EOS), PAD...], the same number
    for each of SOURCES in turn."""
    scores = []
    per_source = sequences.shape[0] // SOURCES.shape[0]
    for row in range(sequences.shape[0]):
        tokens = sequences[row, 1:].tolist()
        length = tokens.index(EOS) + 1 if EOS in tokens else max_new
        source = slice(row // per_source, row // per_source + 1)
        (total,) = _teacher_forced_logprobs(
            model, SOURCES[source], SOURCE_MASK[source], [tuple(tokens[:length])]
        )
        scores.append(total / length**length_penalty)
    return torch.tensor(scores, dtype=torch.float32)


def test_beam_search_projects_each_sentence_memory_once():
    model = _biased_model()
    blocks = model.decoder.blocks
    cross_k = _count_calls([block.cross_attn.k_proj for block in blocks])
    cross_v = _count_calls([block.cross_attn.v_proj for block in blocks])
    rows_seen = []
    blocks[0].cross_attn.k_proj.register_forward_hook(lambda m, i, o: rows_seen.append(len(i[0])))
    lm_head = _count_calls([model.lm_head])
    beam_search(model, SOURCES, attention_mask=SOURCE_MASK, max_new_tokens=MAX_NEW, num_beams=3)
    assert cross_k == [1, 1] and cross_v == [1, 1]
    assert rows_seen == [2]  # once per source sentence, not per beam
    assert 1 <= lm_head[0] <= MAX_NEW


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_one_beam_is_greedy_and_greedy_follows_teacher_forced_argmax(seed):
    model = _biased_model(seed)
    greedy, greedy_scores = greedy_decode(
        model, SOURCES, attention_mask=SOURCE_MASK, max_new_tokens=MAX_NEW, length_penalty=0.7
    )
    beam, beam_scores = beam_search(
        model, SOURCES, attention_mask=SOURCE_MASK, max_new_tokens=MAX_NEW, num_beams=1,
        length_penalty=0.7,
    )  # fmt: skip
    assert beam.tolist() == greedy.tolist()
    torch.testing.assert_close(beam_scores, greedy_scores, rtol=0, atol=1e-5)
    with torch.no_grad():  # each chosen token is the argmax given the returned prefix
        logits = model(SOURCES, SOURCE_MASK, decoder_input_ids=greedy[:, :-1]).logits
    for row in range(2):
        tokens = greedy[row, 1:].tolist()
        length = tokens.index(EOS) + 1 if EOS in tokens else MAX_NEW
        assert tokens[:length] == logits[row, :length].argmax(-1).tolist()
    torch.testing.assert_close(
        greedy_scores, _rescore(model, greedy, 0.7, MAX_NEW), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("num_beams", [1, 2, 3])
def test_a_padded_batch_decodes_like_each_sentence_alone(num_beams):
    # seed: the sentences finish at different steps, and the first one to finish would have
    # found better hypotheses later: the batch must not let it (a sentence done stays done)
    model = _biased_model(SEED_BATCH, positions=8, scale=1.0)
    kwargs = {"max_new_tokens": 8, "num_beams": num_beams, "num_return_sequences": num_beams}
    batch, batch_scores = beam_search(model, SOURCES, attention_mask=SOURCE_MASK, **kwargs)
    for sentence, length in enumerate(SOURCE_MASK.sum(dim=1).tolist()):
        alone, alone_scores = beam_search(
            model, SOURCES[sentence : sentence + 1, :length], **kwargs
        )
        rows = slice(sentence * num_beams, (sentence + 1) * num_beams)
        padding = [PAD] * (batch.shape[1] - alone.shape[1])
        assert batch[rows].tolist() == [hypothesis + padding for hypothesis in alone.tolist()]
        torch.testing.assert_close(batch_scores[rows], alone_scores, rtol=0, atol=1e-5)
    # every returned hypothesis, not only the best, is scored as teacher forcing scores it
    torch.testing.assert_close(batch_scores, _rescore(model, batch, 1.0, 8), rtol=0, atol=1e-5)


def test_early_stopping_stops_at_num_beams_finished_and_never_beats_searching_on():
    model = _biased_model(SEED_EARLY_STOP, positions=8, eos_boost=1.0)  # EOS likely: ends early
    kwargs = {"attention_mask": SOURCE_MASK, "max_new_tokens": 8, "num_beams": 2}
    steps = _count_calls([model.lm_head])
    _, stopped = beam_search(model, SOURCES, early_stopping=True, **kwargs)
    steps_stopped = steps[0]
    _, searched = beam_search(model, SOURCES, early_stopping=False, **kwargs)
    assert steps_stopped < steps[0] - steps_stopped  # stopped as soon as 2 had finished
    # searching on can only add finished hypotheses: never worse, here better for a sentence
    assert bool((searched >= stopped - 1e-6).all()) and bool((searched > stopped + 1e-3).any())


def test_zero_new_tokens_gives_the_start_token():
    model = _model()
    for decode in (beam_search, greedy_decode):
        sequences, scores = decode(model, SOURCES, attention_mask=SOURCE_MASK, max_new_tokens=0)
        assert sequences.tolist() == [[BOS], [BOS]] and scores.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"num_beams": 0}, ValueError, r"num_beams: expected an int >= 1, got 0"),
        ({"num_beams": 2.0}, TypeError, r"num_beams: expected an int >= 1, got float"),
        ({"max_new_tokens": -1}, ValueError, r"max_new_tokens: expected an int >= 0, got -1"),
        ({"max_new_tokens": True}, TypeError, r"max_new_tokens: expected an int >= 0, got bool"),
        ({"length_penalty": math.nan}, ValueError, r"length_penalty: expected a finite float"),
        ({"length_penalty": "1"}, TypeError, r"length_penalty: expected a float, got str"),
        ({"early_stopping": 1}, TypeError, r"early_stopping: expected a bool, got int"),
        (
            {"num_beams": 2, "num_return_sequences": 3},
            ValueError,
            r"num_return_sequences: expected 1 \.\. num_beams=2, got 3",
        ),
        ({"attention_mask": SOURCE_MASK[:, :3]}, ValueError, r"attention_mask: expected shape"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, pattern):
    model = _model()
    with pytest.raises(error, match=pattern):
        beam_search(model, SOURCES, **{"max_new_tokens": 2, **kwargs})


def test_bad_model_and_ids_raise_clear_errors():
    with pytest.raises(TypeError, match=r"model: expected a qkv.models.Transformer"):
        beam_search(torch.nn.Linear(2, 2), SOURCES, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 5\)"):
        greedy_decode(_model(), SOURCES + VOCAB, max_new_tokens=2)
