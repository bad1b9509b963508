"""BERT's masking, tested statistically (Devlin et al. 2019, section 3.1, "Pre-training
BERT": 15% of the tokens selected, of those 80% [MASK], 10% random, 10% unchanged), with
tolerances from the binomial sample size: |observed - p| <= 5 sqrt(p (1 - p) / n). The outside
references: the paper's numbers, and transformers' DataCollatorForLanguageModeling, whose
statistics on the same batches must agree with ours within the same kind of tolerance."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from qkv.data import (
    IGNORE_INDEX,
    PretrainingCollator,
    bert_special_ids,
    make_nsp_examples,
    mask_tokens,
    pad_examples,
    train_wordpiece,
)
from qkv.models import BertConfig, BertForPreTraining

SIGMAS = 5  # fixed seeds make the tests repeatable; 5 sigma keeps them valid for any seed


def assert_rate(count, n, p, what):
    tolerance = SIGMAS * math.sqrt(p * (1 - p) / n)
    assert abs(count / n - p) <= tolerance, (
        f"{what}: {count}/{n} = {count / n:.4f}, expected {p} +/- {tolerance:.4f}"
    )


def batches(examples, size=32):
    return [examples[start : start + size] for start in range(0, len(examples), size)]


def tally(originals, masked, labels, candidates, mask_id):
    """Counts over a batch: candidates, selected, and among the selected [MASK] / kept / other."""
    selected = labels != IGNORE_INDEX
    return {
        "candidates": int(candidates.sum()),
        "selected": int(selected.sum()),
        "mask": int((selected & (masked == mask_id)).sum()),
        "kept": int((selected & (masked == originals)).sum()),
        "random": int((selected & (masked != mask_id) & (masked != originals)).sum()),
    }


def add(total, counts):
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


@pytest.fixture(scope="module")
def special(minilm):
    return bert_special_ids(minilm)


@pytest.fixture(scope="module")
def masked_epochs(nsp_examples, special, minilm):
    """Two epochs of the pydoc pairs through the collator (about 250k candidate tokens), every
    batch padded to 128 and stacked: original ids, attention mask, masked ids, labels (N, 128)."""
    collator = PretrainingCollator(special, vocab_size=minilm.get_vocab_size(), seed=0)
    parts = {"original": [], "attention_mask": [], "masked": [], "labels": []}
    for _ in range(2):
        for chunk in batches(nsp_examples):
            plain, batch = pad_examples(chunk, pad_id=special.pad), collator(chunk)
            for key, tensor, fill in (
                ("original", plain["input_ids"], special.pad),
                ("attention_mask", plain["attention_mask"], 0),
                ("masked", batch["input_ids"], special.pad),
                ("labels", batch["labels"], IGNORE_INDEX),
            ):
                parts[key].append(F.pad(tensor, (0, 128 - tensor.shape[1]), value=fill))
            for key in ("attention_mask", "token_type_ids", "next_sentence_label"):
                assert torch.equal(batch[key], plain[key])
    return {key: torch.cat(tensors) for key, tensors in parts.items()}


def test_fifteen_percent_selected_then_80_10_10(masked_epochs, special):
    data = masked_epochs
    structural = torch.isin(data["original"], torch.tensor(special.never_selected))
    candidates = (data["attention_mask"] == 1) & ~structural
    total = tally(data["original"], data["masked"], data["labels"], candidates, special.mask)
    assert total["candidates"] > 200_000
    assert_rate(total["selected"], total["candidates"], 0.15, "selected")
    assert total["mask"] + total["kept"] + total["random"] == total["selected"]
    assert_rate(total["mask"], total["selected"], 0.8, "[MASK]")
    # a random draw equal to the original counts as kept: 0.1 / 30517 more, far below tolerance
    assert_rate(total["random"], total["selected"], 0.1, "random")
    assert_rate(total["kept"], total["selected"], 0.1, "unchanged")


def test_masking_rules_hold_token_by_token(masked_epochs, special, minilm):
    structural = torch.tensor(special.never_selected)
    original, masked, labels = (
        masked_epochs["original"],
        masked_epochs["masked"],
        masked_epochs["labels"],
    )
    selected = labels != IGNORE_INDEX
    assert not (selected & torch.isin(original, structural)).any()  # [CLS] [SEP] [PAD]
    assert not (selected & (masked_epochs["attention_mask"] == 0)).any()
    assert torch.equal(labels[selected], original[selected])
    assert torch.equal(masked[~selected], original[~selected])
    replaced = masked[selected & (masked != special.mask)]
    assert not torch.isin(replaced, structural).any()
    assert int(replaced.max()) < minilm.get_vocab_size()


def test_random_replacements_are_uniform_over_the_ordinary_vocabulary():
    """Vocabulary 0..11 with specials 0..3 (3 = [MASK]); every input token is 5. Selected tokens
    become 3 with p = 0.8, each of 4..11 with p = 0.1 / 8, and 5 also when kept (+ 0.1)."""
    ids = torch.full((400, 1000), 5)
    generator = torch.Generator().manual_seed(0)
    masked, labels = mask_tokens(
        ids, special_ids=(0, 1, 2, 3), vocab_size=12, mask_token_id=3, generator=generator
    )
    selected = labels != IGNORE_INDEX
    n = int(selected.sum())
    assert_rate(n, ids.numel(), 0.15, "selected")
    counts = torch.bincount(masked[selected], minlength=12)
    assert counts[:3].sum() == 0
    assert_rate(int(counts[3]), n, 0.8, "[MASK]")
    assert_rate(int(counts[5]), n, 0.1 + 0.1 / 8, "kept or drawn 5")
    for token in (4, 6, 7, 8, 9, 10, 11):
        assert_rate(int(counts[token]), n, 0.1 / 8, f"random {token}")


def test_statistics_agree_with_transformers_collator(nsp_examples, special, minilm, minilm_folder):
    """transformers' collator on the same pairs: selection 15% of its candidates (it also never
    selects [UNK]), then 80% [MASK], and the two implementations agree within tolerance."""
    tokenizer = transformers.BertTokenizer.from_pretrained(str(minilm_folder))
    theirs_collator = transformers.DataCollatorForLanguageModeling(tokenizer, seed=0)
    ours_collator = PretrainingCollator(special, vocab_size=minilm.get_vocab_size(), seed=0)
    ours, theirs = {}, {}
    for chunk in batches(nsp_examples, 64):
        plain = pad_examples(chunk, pad_id=special.pad)
        real = plain["attention_mask"] == 1
        hf = theirs_collator([{"input_ids": list(example.input_ids)} for example in chunk])
        assert hf["input_ids"].shape == plain["input_ids"].shape
        hf_candidates = real & ~torch.isin(
            plain["input_ids"], torch.tensor(tokenizer.all_special_ids)
        )
        add(
            theirs,
            tally(plain["input_ids"], hf["input_ids"], hf["labels"], hf_candidates, special.mask),
        )
        batch = ours_collator(chunk)
        candidates = real & ~torch.isin(plain["input_ids"], torch.tensor(special.never_selected))
        add(
            ours,
            tally(
                plain["input_ids"], batch["input_ids"], batch["labels"], candidates, special.mask
            ),
        )
    for total in (ours, theirs):
        assert_rate(total["selected"], total["candidates"], 0.15, "selected")
        assert_rate(total["mask"], total["selected"], 0.8, "[MASK]")
        assert_rate(total["random"], total["selected"], 0.1, "random")
    for key in ("mask", "random", "kept"):
        p1, p2 = ours[key] / ours["selected"], theirs[key] / theirs["selected"]
        pooled = (ours[key] + theirs[key]) / (ours["selected"] + theirs["selected"])
        spread = math.sqrt(pooled * (1 - pooled) * (1 / ours["selected"] + 1 / theirs["selected"]))
        assert abs(p1 - p2) <= SIGMAS * spread, key


def test_masks_change_per_batch_and_resume_exactly(nsp_examples, special, minilm):
    V = minilm.get_vocab_size()
    chunk = nsp_examples[:16]
    first, second = (
        PretrainingCollator(special, vocab_size=V, seed=7),
        PretrainingCollator(special, vocab_size=V, seed=7),
    )
    a1, b1 = first(chunk), second(chunk)
    assert torch.equal(a1["input_ids"], b1["input_ids"]) and torch.equal(a1["labels"], b1["labels"])
    state = first.state_dict()
    a2 = first(chunk)
    assert not torch.equal(a1["labels"], a2["labels"])  # the next epoch masks differently
    resumed = PretrainingCollator(special, vocab_size=V, seed=123)
    resumed.load_state_dict(state)
    assert torch.equal(resumed(chunk)["input_ids"], a2["input_ids"])
    other_seed = PretrainingCollator(special, vocab_size=V, seed=8)(chunk)
    assert not torch.equal(other_seed["labels"], a1["labels"])


def test_batch_trains_qkv_and_transformers_bert_for_pretraining(documents, texts):
    """A batch as it comes from the collator (pairs from a WordPiece trained on pydoc):
    `model(**batch)` runs a small qkv BertForPreTraining (finite loss and gradients) and
    transformers' model of the same name, so the keys are the standard ones."""
    tokenizer = train_wordpiece(texts, vocab_size=2000)
    examples = make_nsp_examples(documents[:8], tokenizer, max_length=64)
    special = bert_special_ids(tokenizer)
    V = tokenizer.get_vocab_size()
    batch = PretrainingCollator(special, vocab_size=V, seed=0)(examples[:4])
    keys = {"input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label"}
    assert set(batch) == keys
    torch.manual_seed(0)
    sizes = dict(embed_dim=32, num_layers=2, num_heads=4, ffn_dim=64, max_positions=64)
    model = BertForPreTraining(BertConfig(vocab_size=V, **sizes))
    output = model(**batch)
    assert torch.isfinite(output.loss) and output.loss > 0
    output.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    reference = transformers.BertForPreTraining(
        transformers.BertConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        )
    )
    assert torch.isfinite(reference(**batch).loss)


def test_mask_tokens_errors():
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 5, 6, 2]])
    kwargs = dict(special_ids=(0, 1, 2, 3), vocab_size=10, mask_token_id=3, generator=generator)
    with pytest.raises(ValueError, match="probability"):
        mask_tokens(ids, **kwargs, probability=0.0)
    with pytest.raises(ValueError, match="mask_fraction"):
        mask_tokens(ids, **kwargs, mask_fraction=0.95, random_fraction=0.1)
    with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 10\)"):
        mask_tokens(ids + 8, **kwargs)
    with pytest.raises(TypeError, match="input_ids"):
        mask_tokens(ids.float(), **kwargs)
    with pytest.raises(ValueError, match="special_mask"):
        mask_tokens(ids, **kwargs, special_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="examples"):
        pad_examples([], pad_id=0)
    everything = torch.ones(1, 4, dtype=torch.bool)
    masked, labels = mask_tokens(ids, **kwargs, special_mask=everything, probability=0.99)
    assert torch.equal(masked, ids) and (labels == IGNORE_INDEX).all()
