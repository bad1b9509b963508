"""Next-sentence pairs (Devlin et al. 2019, section 3.1 and appendix A.2): half IsNext
(B really follows A in the same document, checked against the text), half NotNext (B from another
document); [CLS] A [SEP] B [SEP] with segment ids 0/1 as transformers' BERT tokenizer builds them
from the same two texts; never longer than max_length."""

import math
from collections import Counter

import pytest
import transformers

from qkv.data import IS_NEXT, NOT_NEXT, bert_special_ids, make_nsp_examples

SIGMAS = 5


def span_ids(tokenizer, documents, document_index, span):
    """Token ids of sentences [start, stop) of a document, re-encoded from their text."""
    text = " ".join(documents[document_index][span[0] : span[1]])
    return tokenizer.encode(text, add_special_tokens=False).ids


def is_sublist(part, whole):
    return any(whole[i : i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def split_pair(example, special):
    ids = list(example.input_ids)
    first_sep = ids.index(special.sep)
    return ids[1:first_sep], ids[first_sep + 1 : -1]


def test_half_of_the_pairs_are_next(documents, minilm, nsp_examples):
    other_seed = make_nsp_examples(documents, minilm, max_length=128, seed=1)
    assert other_seed != nsp_examples  # a new seed (epoch) gives new pairs
    labels = [example.next_sentence_label for example in nsp_examples + other_seed]
    n = len(labels)
    assert n > 2000
    tolerance = SIGMAS * math.sqrt(0.25 / n)
    assert abs(labels.count(IS_NEXT) / n - 0.5) <= tolerance
    assert set(labels) == {IS_NEXT, NOT_NEXT}


def test_pairs_come_from_where_they_say(documents, minilm, nsp_examples):
    """A is a run of tokens of its sentences; an IsNext B is a run of tokens of the sentences
    right after A's in the same document; a NotNext B comes from another document."""
    special = bert_special_ids(minilm)
    for example in nsp_examples:
        tokens_a, tokens_b = split_pair(example, special)
        assert tokens_a and tokens_b
        assert is_sublist(
            tokens_a, span_ids(minilm, documents, example.document_index, example.a_sentences)
        )
        assert is_sublist(
            tokens_b, span_ids(minilm, documents, example.b_document_index, example.b_sentences)
        )
        if example.next_sentence_label == IS_NEXT:
            assert example.b_document_index == example.document_index
            assert example.b_sentences[0] == example.a_sentences[1]
        else:
            assert example.b_document_index != example.document_index


def test_untruncated_pairs_are_whole_consecutive_sentences(documents, minilm):
    """With room to spare, nothing is cut: A is exactly its sentences, and an IsNext pair is
    exactly consecutive text of one document, A's last sentence followed by B's first."""
    special = bert_special_ids(minilm)
    examples = make_nsp_examples(documents[:20], minilm, max_length=512, seed=3)
    whole = [e for e in examples if len(e.input_ids) < 512]
    assert len(whole) > len(examples) / 2
    for example in whole:
        tokens_a, tokens_b = split_pair(example, special)
        assert tokens_a == span_ids(minilm, documents, example.document_index, example.a_sentences)
        assert tokens_b == span_ids(
            minilm, documents, example.b_document_index, example.b_sentences
        )
        if example.next_sentence_label == IS_NEXT:
            start, stop = example.a_sentences[0], example.b_sentences[1]
            assert tokens_a + tokens_b == span_ids(
                minilm, documents, example.document_index, (start, stop)
            )


def test_layout_and_segments_match_transformers(nsp_examples, minilm, minilm_folder):
    """[CLS] A [SEP] B [SEP], type ids 0 then 1: what transformers' BertTokenizer makes of the
    pair of texts (compared where decoding and re-encoding A and B gives back their ids: not
    when truncation cut a word in two)."""
    reference = transformers.BertTokenizer.from_pretrained(str(minilm_folder))
    special = bert_special_ids(minilm)
    compared = 0
    for example in nsp_examples[:300]:
        tokens_a, tokens_b = split_pair(example, special)
        text_a, text_b = minilm.decode(tokens_a), minilm.decode(tokens_b)
        if minilm.encode(text_a, text_b).ids != list(example.input_ids):
            continue
        theirs = reference(text_a, text_b)
        assert list(example.input_ids) == theirs["input_ids"]
        assert list(example.token_type_ids) == theirs["token_type_ids"]
        compared += 1
    assert compared > 200


def test_lengths_and_packing(nsp_examples, minilm):
    lengths = Counter(len(example.input_ids) for example in nsp_examples)
    assert max(lengths) <= 128 and min(lengths) >= 5
    assert lengths[128] > 0.7 * len(nsp_examples)  # spans are packed up to the length
    for example in nsp_examples:
        assert len(example.token_type_ids) == len(example.input_ids)
        assert example.input_ids.count(bert_special_ids(minilm).sep) >= 2


def test_deterministic_per_seed(documents, minilm, nsp_examples):
    assert make_nsp_examples(documents, minilm, max_length=128, seed=0) == nsp_examples


def test_short_sequences_and_errors(documents, minilm):
    short = make_nsp_examples(documents, minilm, max_length=128, short_seq_prob=1.0, seed=0)
    assert sum(len(e.input_ids) for e in short) / len(short) < 100
    with pytest.raises(ValueError, match="at least 2 documents"):
        make_nsp_examples([documents[0], [], [""]], minilm)
    with pytest.raises(ValueError, match="max_length"):
        make_nsp_examples(documents, minilm, max_length=4)
    with pytest.raises(ValueError, match="random_next_prob"):
        make_nsp_examples(documents, minilm, random_next_prob=1.5)
    with pytest.raises(TypeError, match="documents"):
        make_nsp_examples(["a sentence", "another"], minilm)
