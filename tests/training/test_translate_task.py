"""The translate task: disjoint splits of real number words, teacher forcing with a look-ahead
mask, and a model that learns to translate."""

import dataclasses

import pytest
import torch
from num2words import num2words

from qkv.analysis.plots.translation import cross_attention
from qkv.data.translate import BOS_ID, EOS_ID, PAD_ID, number_pairs, read_pairs
from qkv.models import shift_right
from qkv.training import TrainingConfig, train
from qkv.training.tasks import TranslateTask
from qkv.training.tasks.translate import load_translator, translate

from .tiny import TINY


@pytest.fixture(scope="module")
def task():
    torch.set_num_threads(1)
    return TranslateTask(TINY)


def test_splits_are_disjoint_real_number_words_over_every_magnitude():
    pairs = number_pairs(max_number=99_999, num_train=2000, num_valid=200, num_test=200, seed=3)
    sources = [
        set(source for source, _ in split) for split in (pairs.train, pairs.valid, pairs.test)
    ]
    assert sum(map(len, sources)) == 2400 == len(set.union(*sources))
    assert ("einundzwanzig", "twenty-one") in pairs.train + pairs.valid + pairs.test
    small = {num2words(n, lang="de"): n for n in range(1000)}
    for source, target in pairs.test + pairs.train[:200]:
        if source in small:
            assert target == num2words(small[source])  # English words of the same number
    digits = {len(str(small[source])) for source in sources[0] if source in small}
    assert digits == {1, 2, 3}  # small numbers are drawn, not drowned out by large ones


def test_user_pairs_from_a_tab_separated_file(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"src {i}\ttgt {i}\n" for i in range(40)))
    pairs = read_pairs(path)
    assert (len(pairs.train), len(pairs.valid), len(pairs.test)) == (36, 2, 2)
    path.write_text("no tab here\n")
    with pytest.raises(ValueError, match="line 1"):
        read_pairs(path)


def test_tokenizer_round_trips_the_exact_text(task):
    for source, target in task.pairs.test:
        assert task.tokenizer.decode(task.tokenizer.encode(target).ids) == target
        assert task.tokenizer.decode(task.tokenizer.encode(source).ids) == source


def test_teacher_forcing_feeds_the_targets_shifted_right_behind_bos(task):
    batch = task.collate([0, 1, 2, 3])
    labels = batch["labels"]
    decoder_input = shift_right(labels, bos_token_id=BOS_ID, pad_token_id=PAD_ID)
    for row in range(4):
        target = task.train_set.targets[row]  # ... + [EOS]
        assert target[-1] == EOS_ID
        assert decoder_input[row, : len(target)].tolist() == [BOS_ID, *target[:-1]]
        assert labels[row, : len(target)].tolist() == target
        assert (labels[row, len(target) :] == -100).all()


def test_the_look_ahead_mask_hides_later_target_tokens(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    batch = task.collate([5])
    labels = batch["labels"]
    length = int((labels != -100).sum())
    for changed in range(1, length - 1):
        other = labels.clone()
        other[0, changed] = (other[0, changed] + 7) % model.config.tgt_vocab_size
        a = model(batch["input_ids"], labels=labels).logits
        b = model(batch["input_ids"], labels=other).logits
        # label `changed` is the decoder's input at position changed + 1 and later
        torch.testing.assert_close(a[:, : changed + 1], b[:, : changed + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(a[:, changed + 1 :], b[:, changed + 1 :])


def test_the_translate_preset_learns(tmp_path):
    options = dataclasses.replace(
        TINY, num_train=700, num_valid=100, embed_dim=64, ffn_dim=128, num_heads=4, dropout=0.0
    )
    task = TranslateTask(options)
    config = TrainingConfig(steps=300, batch_size=32, learning_rate=3e-3, warmup_steps=30,
                            eval_every=300, checkpoint_every=0)  # fmt: skip
    result = train(task, config, out_dir=tmp_path)
    assert result.metrics["valid_exact_match"] >= 0.8, result.metrics  # 0.91 when written
    task.save(result.model, tmp_path / "model")
    model, tokenizer = load_translator(tmp_path / "model")
    sources = [source for source, _ in task.pairs.valid]
    assert translate(model, tokenizer, sources) == translate(result.model, task.tokenizer, sources)
    weights, source_tokens, written = cross_attention(model, tokenizer, sources[0])
    assert weights.shape == (options.num_heads, len(written), len(source_tokens))
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]))
    assert (
        tokenizer.decode([tokenizer.token_to_id(t) for t in written])
        == translate(model, tokenizer, sources[:1])[0]
    )
