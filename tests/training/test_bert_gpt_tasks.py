"""The bert and gpt tasks: their loss is the models' own, masking is BERT's and reproducible,
short runs learn, user text files work, and `qkv train gpt` gives a folder `qkv generate` reads."""

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch

from qkv.data import END_OF_TEXT, pad_examples, pydoc_texts, train_validation_split
from qkv.models import GPT, BertForPreTraining, load
from qkv.training import TrainingConfig, train
from qkv.training.tasks import TASKS, BertOptions, BertTask, GPTOptions, GPTTask
from qkv.training.tasks.gpt import summed_next_token_loss

TINY_BERT = BertOptions(
    vocab_size=1000, max_length=32, embed_dim=32, num_layers=1, num_heads=2, ffn_dim=64,
    dropout=0.0, dupe_factor=2,
)  # fmt: skip
TINY_GPT = GPTOptions(
    vocab_size=512, block_size=32, embed_dim=32, num_layers=1, num_heads=2, ffn_dim=64,
    dropout=0.0,
)  # fmt: skip
TINY_GPT_FLAGS = [
    "--vocab-size", "512", "--block-size", "32", "--embed-dim", "32", "--num-layers", "1",
    "--num-heads", "2", "--ffn-dim", "64", "--threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def bert_task():
    torch.set_num_threads(1)
    return BertTask(TINY_BERT)


@pytest.fixture(scope="module")
def gpt_task():
    torch.set_num_threads(1)
    return GPTTask(TINY_GPT)


def _entropy(counter: Counter) -> float:
    total = sum(counter.values())
    return -sum(n / total * math.log(n / total) for n in counter.values())


def test_bert_loss_sums_over_counts_are_the_models_own_loss(bert_task):
    torch.manual_seed(0)
    model = bert_task.build_model().eval()
    batch = bert_task.collate(list(range(12)), step=3)
    sums, counts = bert_task.loss_sums(model, batch), bert_task.counts(batch)
    assert counts == {"mlm": int((batch["labels"] != -100).sum()), "nsp": 12}
    # BertForPreTraining.loss: mean MLM cross-entropy + mean NSP cross-entropy (F.cross_entropy)
    assert isinstance(model, BertForPreTraining)
    expected = model(**batch).loss
    ours = sums["mlm"] / counts["mlm"] + sums["nsp"] / counts["nsp"]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    mlm_only = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                     labels=batch["labels"]).loss  # fmt: skip
    torch.testing.assert_close(sums["mlm"] / counts["mlm"], mlm_only, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpt_loss_sum_over_count_is_the_models_own_loss(family, gpt_task):
    task = gpt_task
    if family == "llama":  # RoPE, RMSNorm, SwiGLU; here with GQA (2 query heads, 1 K/V head)
        task = GPTTask(dataclasses.replace(TINY_GPT, family="llama", num_kv_heads=1))
    torch.manual_seed(0)
    model = task.build_model().eval()
    assert isinstance(model, GPT)
    assert model.config.position == {"gpt2": "learned", "llama": "rope"}[family]
    batch = task.collate([0, 5, 9], step=0)
    assert task.counts(batch) == {"tokens": 3 * (TINY_GPT.block_size - 1)}
    expected = model(batch["input_ids"], labels=batch["input_ids"]).loss  # shifts internally
    ours = task.loss_sums(model, batch)["tokens"] / task.counts(batch)["tokens"]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_bert_with_minilm_vocabulary_pairs_and_masks_with_its_ids():
    task = BertTask(dataclasses.replace(TINY_BERT, tokenizer="minilm", dupe_factor=1))
    # bert-base-uncased's vocab.txt: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
    assert (task.special.cls, task.special.sep, task.special.mask) == (101, 102, 103)
    assert task.build_model().config.vocab_size == 30522
    batch = task.collate(list(range(64)), step=0)
    assert (batch["input_ids"][:, 0] == 101).all()
    labels = batch["labels"][batch["labels"] != -100]
    assert len(labels) and not torch.isin(labels, torch.tensor([0, 101, 102, 103])).any()


def test_bert_collate_depends_only_on_step_and_example(bert_task):
    first = bert_task.collate([1, 4, 6, 9], step=7)
    again = bert_task.collate([1, 4, 6, 9], step=7)
    for name in first:
        assert torch.equal(first[name], again[name]), name
    later = bert_task.collate([1, 4, 6, 9], step=8)
    assert not torch.equal(first["labels"], later["labels"])
    # an example is masked the same way in any micro-batch (accumulation and DDP shards)
    part = bert_task.collate([4, 9], step=7)
    for row, whole_row in ((0, 1), (1, 3)):
        length = int(part["attention_mask"][row].sum())
        for name in ("input_ids", "labels"):
            assert torch.equal(part[name][row, :length], first[name][whole_row, :length])


def test_bert_masking_is_15_percent_then_80_10_10_and_never_a_special_token(bert_task):
    indices = list(range(min(len(bert_task), 600)))
    batch = bert_task.collate(indices, step=11)
    original = pad_examples([bert_task.train_pairs[i] for i in indices], pad_id=0)["input_ids"]
    special = torch.tensor(bert_task.special.never_selected)
    real = batch["attention_mask"].bool()
    eligible = real & ~torch.isin(original, special)
    selected = batch["labels"] != -100
    assert not (selected & ~eligible).any()  # never [CLS], [SEP], [PAD], [MASK]
    assert torch.equal(batch["labels"][selected], original[selected])
    assert torch.equal(batch["input_ids"][~selected], original[~selected])  # the rest untouched
    n = int(eligible.sum())
    _assert_fraction(int(selected.sum()), n, 0.15)  # Devlin et al. 2019, section 3.1
    chosen = batch["input_ids"][selected]
    is_mask = chosen == bert_task.special.mask
    unchanged = chosen == original[selected]
    m = int(selected.sum())
    _assert_fraction(int(is_mask.sum()), m, 0.8)
    _assert_fraction(int(unchanged.sum()), m, 0.1)
    replaced = chosen[~is_mask & ~unchanged]
    assert not torch.isin(replaced, special).any()


def _assert_fraction(hits: int, trials: int, p: float) -> None:
    """Within 5 binomial standard deviations of p (false alarm odds below 1 in a million)."""
    assert trials > 500
    assert abs(hits / trials - p) < 5 * math.sqrt(p * (1 - p) / trials), (hits, trials, p)


def test_gpt_blocks_are_the_bpe_stream_of_the_training_topics(gpt_task):
    train_texts, _ = train_validation_split(pydoc_texts(), validation_fraction=0.1, seed=0)
    stream = []
    for text in train_texts:  # tokenizers' own encoding, each document then <|endoftext|>
        stream += [
            *gpt_task.tokenizer.encode(text).ids,
            gpt_task.tokenizer.token_to_id(END_OF_TEXT),
        ]
    T = TINY_GPT.block_size
    batch = gpt_task.collate([0, 3], step=5)
    assert batch["input_ids"].tolist() == [stream[:T], stream[3 * T : 4 * T]]
    assert torch.equal(gpt_task.collate([0, 3], step=6)["input_ids"], batch["input_ids"])
    assert len(gpt_task) == len(stream) // T
    assert gpt_task.unigram_entropy == pytest.approx(_entropy(Counter(stream[: len(gpt_task) * T])))


def test_bert_unigram_entropy_counts_the_training_tokens_without_specials(bert_task):
    special = set(bert_task.special.never_selected)
    tokens = Counter(
        token for pair in bert_task.train_pairs for token in pair.input_ids if token not in special
    )
    assert bert_task.unigram_entropy == pytest.approx(_entropy(tokens))


def test_short_bert_run_lowers_the_validation_loss(bert_task, tmp_path):
    config = TrainingConfig(
        steps=40, batch_size=32, learning_rate=3e-3, warmup_steps=4, checkpoint_every=0,
        log_every=40,
    )  # fmt: skip
    torch.manual_seed(config.seed)  # the loop's initial weights
    start = bert_task.evaluate(bert_task.build_model().eval())
    result = train(bert_task, config, out_dir=tmp_path)
    end = result.metrics
    assert start["valid_mlm_loss"] > math.log(1000) - 0.5  # about uniform over the vocabulary
    assert end["valid_mlm_loss"] < start["valid_mlm_loss"] - 0.8
    assert end["valid_mlm_accuracy"] > start["valid_mlm_accuracy"] + 0.04
    assert end["valid_loss"] == pytest.approx(end["valid_mlm_loss"] + end["valid_nsp_loss"])
    assert end["valid_perplexity"] == pytest.approx(math.exp(end["valid_mlm_loss"]))


def test_short_gpt_run_gets_below_the_unigram_entropy(gpt_task, tmp_path):
    config = TrainingConfig(
        steps=300, batch_size=16, learning_rate=5e-3, warmup_steps=10, checkpoint_every=0,
        log_every=300,
    )  # fmt: skip
    torch.manual_seed(config.seed)
    start = gpt_task.evaluate(gpt_task.build_model().eval())
    end = train(gpt_task, config, out_dir=tmp_path).metrics
    assert start["valid_loss"] > math.log(512) - 0.5
    assert end["valid_loss"] < end["unigram_entropy"] - 0.5  # it uses the context
    assert end["valid_perplexity"] == pytest.approx(math.exp(end["valid_loss"]))


@pytest.fixture(scope="module")
def user_text(tmp_path_factory):
    """Ten documents of made-up sentences, blank lines between them."""
    colours = ["red", "green", "blue", "yellow", "purple"]
    documents = [
        "\n".join(
            f"The {colours[(d + s) % 5]} lamp number {d * 10 + s} shines over bridge {s}."
            for s in range(12)
        )
        for d in range(10)
    ]
    path = tmp_path_factory.mktemp("data") / "lamps.txt"
    path.write_text("\n\n".join(documents) + "\n")
    return path


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_a_user_text_file_replaces_the_embedded_corpus(name, user_text, tmp_path):
    task_class, options_class = TASKS[name]
    options = TINY_BERT if name == "bert" else dataclasses.replace(TINY_GPT, block_size=16)
    task = task_class(dataclasses.replace(options, data=str(user_text), vocab_size=300))
    assert isinstance(task.options, options_class)
    text = task.tokenizer.decode(task.collate([0], step=0)["input_ids"][0].tolist())
    assert "lamp" in text and "shines" in text
    config = TrainingConfig(steps=2, batch_size=4, warmup_steps=1, checkpoint_every=0)
    result = train(task, config, out_dir=tmp_path)
    assert all(math.isfinite(value) for value in result.metrics.values())
    json.dumps(task.describe())


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="tokenizer"):
        BertTask(BertOptions(tokenizer="bpe"))
    with pytest.raises(ValueError, match="family"):
        GPTTask(GPTOptions(family="mamba"))
    with pytest.raises(ValueError, match="validation_fraction"):
        GPTTask(GPTOptions(validation_fraction=0.0))


def test_qkv_train_gpt_then_qkv_generate(tmp_path, capsys):
    from qkv.cli import main

    out = tmp_path / "run"
    flags = ["--steps", "5", "--batch-size", "8", "--warmup-steps", "1", *TINY_GPT_FLAGS]
    assert main(["train", "gpt", *flags, "--out", str(out)]) == 0
    model_dir = out / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "task.json"):
        assert (model_dir / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["metrics"]) == {"valid_loss", "valid_perplexity", "unigram_entropy"}
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--prompt", "The", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()


def test_qkv_train_bert_writes_its_model_and_metrics(tmp_path, capsys):
    from qkv.cli import main

    out = tmp_path / "run"
    flags = [
        "--steps", "3", "--batch-size", "8", "--warmup-steps", "1", "--vocab-size", "1000",
        "--max-length", "32", "--embed-dim", "32", "--num-layers", "1", "--ffn-dim", "64",
        "--dupe-factor", "1", "--threads", "1",
    ]  # fmt: skip
    assert main(["train", "bert", *flags, "--out", str(out)]) == 0
    assert "valid_mlm_accuracy" in capsys.readouterr().out
    model = load(out / "model")
    assert isinstance(model, BertForPreTraining)
    assert (out / "model" / "tokenizer.json").is_file()


def test_bert_packed_batches_give_the_padded_loss_and_gradients(bert_task):
    """--pack: the same pairs and masks in one row without padding; loss terms, counts and
    every gradient equal the padded batch's (float64, so that only the algebra is compared)."""
    torch.manual_seed(0)
    model = bert_task.build_model().double().eval()
    packed_task = BertTask(dataclasses.replace(TINY_BERT, pack=True))  # the same pairs
    indices = list(range(9))
    padded, packed = bert_task.collate(indices, step=5), packed_task.collate(indices, step=5)
    assert packed["input_ids"].shape == (1, int(padded["attention_mask"].sum()))
    assert packed["sequence_lengths"].tolist() == padded["attention_mask"].sum(dim=1).tolist()
    assert bert_task.counts(padded) == packed_task.counts(packed)
    results = []
    for task, batch in ((bert_task, padded), (packed_task, packed)):
        model.zero_grad()
        sums = task.loss_sums(model, batch)
        (sums["mlm"] + sums["nsp"]).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append(({k: v.detach() for k, v in sums.items()}, grads))
    (padded_sums, padded_grads), (packed_sums, packed_grads) = results
    for name in ("mlm", "nsp"):
        torch.testing.assert_close(packed_sums[name], padded_sums[name])
    assert len(packed_grads) == len(padded_grads)
    for got, want in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpt_packed_documents_give_the_loss_of_every_piece_alone(family):
    """--pack: blocks cut after every <|endoftext|>, each piece attending only to itself; the
    summed loss equals running every piece alone (a padded batch of documents)."""
    torch.manual_seed(0)
    task = GPTTask(dataclasses.replace(TINY_GPT, family=family, pack=True))
    model = task.build_model().double().eval()
    end = task.end_of_text
    ending = [i for i, block in enumerate(task.train_blocks.blocks) if (block == end).any()]
    batch = task.collate([0, *ending[:2]], step=0)  # blocks where documents end
    lengths = batch["sequence_lengths"].tolist()
    assert batch["input_ids"].shape == (1, 3 * 32) and sum(lengths) == 3 * 32
    assert len(lengths) > 3
    pieces = torch.split(batch["input_ids"][0], lengths)
    assert all(int(end) not in piece[:-1].tolist() for piece in pieces)  # an end closes a piece
    expected = sum(
        float(summed_next_token_loss(model(piece[None]).logits, {"input_ids": piece[None]}))
        for piece in pieces
    )
    with torch.no_grad():
        sums = task.loss_sums(model, batch)
    assert task.counts(batch) == {"tokens": sum(n - 1 for n in lengths)}
    assert math.isclose(float(sums["tokens"]), expected, rel_tol=1e-6)  # the sum is in fp32
