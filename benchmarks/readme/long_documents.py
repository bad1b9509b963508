"""The section of benchmarks/long_documents.py: documents longer than BERT's window, classified
after truncation, window averaging, and a hierarchical encoder."""

from __future__ import annotations

from .format import get, md_table, num, prose
from .machine import machine_table

DOCUMENTS_TEXT = """\
Which of {labels} documentation groups a passage of CPython's documentation comes from
(`qkv.data.topic_documents`: passages built from the group's sentences, {share} of the words or
more, mixed with other groups' and shuffled; train and test share no sentence), on documents of
{median} MiniLM tokens (median; {over:.0%} longer than 512). Every method reads the same frozen
all-MiniLM-L6-v2 (mean pooling per window of {window} tokens): truncation and window averaging
feed a logistic regression, the hierarchical encoder (Pappagari et al. 2019) a small
Transformer over the windows' vectors. Test accuracy; min and max over head seeds."""


def long_documents_section(data: dict) -> list[str]:
    test = get(data, "documents", "test", default={}) or {}
    text = DOCUMENTS_TEXT.format(
        labels=len(data.get("labels", [])) or "?",
        share=f"{get(data, 'config', 'label_share', default=0.6):.0%}",
        median=num(test.get("tokens_median"), ".0f"),
        over=test.get("share_over_512_tokens", 0.0),
        window=get(data, "config", "max_length", default="?"),
    )
    lines = ["## Long documents (`long_documents.py`)", "", *prose(text), ""]
    header = ["method", "head", "test accuracy", "min", "max", "train accuracy"]
    body = [
        [r.get("method"), r.get("head"), num(r.get("test_accuracy"), ".3f"),
         num(r.get("test_accuracy_min"), ".3f"), num(r.get("test_accuracy_max"), ".3f"),
         num(r.get("train_accuracy"), ".3f")]
        for r in data.get("rows", [])
    ]  # fmt: skip
    return [*lines, *md_table(header, body), "", *machine_table([("long_documents", data)])]
