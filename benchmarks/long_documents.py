"""Benchmark: long-document classification three ways, on frozen all-MiniLM-L6-v2.

    .venv/bin/python benchmarks/long_documents.py            # default (minutes on 2 idle cores)
    .venv/bin/python benchmarks/long_documents.py --quick    # smoke run, results/..._quick.json

The task (`qkv.data.topic_documents.pydoc_topic_documents`): documents built from CPython's
pydoc topics, labelled by the part of the language reference (five groups) that gives most of
their words (at least 60%), the segments shuffled, so the label is spread over the whole
document; most documents are longer than 512 tokens. Train and test documents share no text.

Every method but "truncation 512" reads the same windows (`chunk_texts`, max_length 256,
MiniLM's training length, stride 32); all run the same frozen MiniLM, mean-pooled per window,
and train only what sits on top:
    truncation         the first window alone (`embed_long(..., aggregation="first")`)
                       -> logistic regression
    truncation 512     the first 512 tokens in one window (MiniLM's position table allows 512,
                       its training stopped at 256) -> logistic regression
    window mean        every window, averaged by token count (`embed_long`, "mean")
                       -> logistic regression
    hierarchical       every window's vector -> a 2-block Transformer over the chunks with
                       learned chunk positions and a chunk padding mask, mean over chunks
                       (`HierarchicalClassifier`, Pappagari et al. 2019) -> linear head
    sparse 512         one pass over the first 512 tokens with Longformer's attention, a
                       window of --sparse-window keys each side + global [CLS] (Beltagy et al.
                       2020; `whole_documents(..., overflow="truncate")`, `embed_long(...,
                       pattern=longformer_pattern(w))`) -> logistic regression. MiniLM's
                       learned positions stop at 512, so the rest of a longer document is not
                       read (the row says so); a band of 2 w + 1 = 257 keys (w = 128) keeps each
                       token's view about as wide as the 256 tokens MiniLM was trained on
    sparse windows     the same attention in windows of 512 (stride 32), averaged: the whole
                       document (one pass computes both rows' windows)
MiniLM runs once per window; the window vectors are cached and the embeddings of the first and
third methods are taken from them with `aggregate_windows` (checked here against `embed_long`
on the first documents). Each logistic regression (standardised features, L-BFGS) takes its L2
penalty from PENALTIES by accuracy on the last 20% of the training documents; the hierarchical
model's settings (HIERARCHICAL) were chosen on such a validation split too. The test split is
used once, for the table. Each head is trained with `--head-seeds` seeds (L-BFGS on a convex
loss gives the same head for every seed); the table reports the test accuracy's mean and range
over them. Chance is 20% (the labels are balanced).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import format_table, log, machine_info, write_json

from qkv.applications import (
    HierarchicalClassifier,
    HierarchicalEncoder,
    Windows,
    aggregate_windows,
    chunk_texts,
    embed_long,
    longformer_pattern,
    whole_documents,
)
from qkv.data.tokenizers import minilm_wordpiece
from qkv.data.topic_documents import pydoc_topic_documents
from qkv.models.bert import BertModel
from qkv.models.checkpoints.bundled import default_model_path

RESULTS = Path(__file__).resolve().parent / "results"
# chosen on a validation split of the training documents (about 0.90 for every choice tried:
# 1 or 2 blocks, mean or attention pooling over chunks, learning rate 1e-4 or 3e-4)
HIERARCHICAL = {"num_layers": 2, "num_heads": 6, "dropout": 0.1, "lr": 1e-4, "batch_size": 16}
PENALTIES = (1e-3, 1e-2, 1e-1, 1.0)  # the L2 penalties the logistic regressions choose from


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few documents")
    parser.add_argument("--num-train", type=int, default=480)
    parser.add_argument("--num-test", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0, help="the documents' seed")
    parser.add_argument("--head-seeds", type=int, default=3, help="training seeds per method")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--stride", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=20, help="hierarchical training epochs")
    parser.add_argument("--sparse-window", type=int, default=128, help="keys each side")
    parser.add_argument("--no-dense", action="store_true", help="only the sparse rows")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_train, args.num_test, args.head_seeds, args.epochs = 60, 30, 1, 5
    if args.out is None:
        args.out = RESULTS / f"long_documents{'_quick' if args.quick else ''}.json"
    return args


def select(windows: Windows, chunks: torch.Tensor, texts: list[int]) -> tuple:
    """The windows and window vectors of some texts (ascending indices), renumbered 0.."""
    keep = torch.isin(windows.text_index, torch.tensor(texts))  # (W,)
    renumber = torch.full((windows.num_texts,), -1, dtype=torch.long)
    renumber[torch.tensor(texts)] = torch.arange(len(texts))
    index = renumber[windows.text_index[keep]]  # (w,)
    part = Windows(windows.input_ids[keep], windows.attention_mask[keep], index, len(texts))
    return part, chunks[keep]


def logistic_regression(train_x, train_y, test_x, num_labels: int, seed: int, penalty: float):
    """Multinomial logistic regression on standardised features: L-BFGS, an L2 penalty on the
    weights. Returns the predicted labels of the training and the test rows."""
    torch.manual_seed(seed)
    mean, std = train_x.mean(dim=0), train_x.std(dim=0).clamp(min=1e-6)
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    head = torch.nn.Linear(train_x.shape[1], num_labels)
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(head(train_x), train_y) + penalty * head.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return {"train": head(train_x).argmax(1), "test": head(test_x).argmax(1)}


def choose_penalty(train_x, train_y, num_labels: int) -> float:
    """The L2 penalty of PENALTIES with the best accuracy on the last 20% of the training
    documents, fitted on the rest (the test split is never looked at)."""
    cut = int(0.8 * len(train_y))
    scores = []
    for penalty in PENALTIES:
        fit = logistic_regression(
            train_x[:cut], train_y[:cut], train_x[cut:], num_labels, 0, penalty
        )
        scores.append(accuracy(fit["test"], train_y[cut:]))
    return PENALTIES[scores.index(max(scores))]


def train_hierarchical(model, data: dict, num_labels: int, seed: int, args) -> dict:
    """HierarchicalClassifier over the cached window vectors: AdamW, mini-batches of 16."""
    torch.manual_seed(seed)
    config = HIERARCHICAL
    encoder = HierarchicalEncoder(
        model,
        num_layers=config["num_layers"],
        num_heads=config["num_heads"],
        dropout=config["dropout"],
    )
    classifier = HierarchicalClassifier(encoder, num_labels, dropout=config["dropout"])
    trained = [p for p in classifier.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=config["lr"], weight_decay=0.01)
    size = config["batch_size"]
    windows, chunks, labels = data["train"]
    order = torch.Generator().manual_seed(seed)
    for _ in range(args.epochs):
        classifier.train()
        permutation = torch.randperm(windows.num_texts, generator=order).tolist()
        for start in range(0, len(permutation), size):
            batch = sorted(permutation[start : start + size])
            part, part_chunks = select(windows, chunks, batch)
            loss = F.cross_entropy(classifier.classify_chunks(part_chunks, part), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    classifier.eval()
    with torch.no_grad():
        return {
            split: classifier.classify_chunks(data[split][1], data[split][0]).argmax(1)
            for split in ("train", "test")
        }


def embed_windows(model: BertModel, tokenizer, texts: list[str], args) -> dict:
    """Windows of the texts and MiniLM's mean-pooled vector of each, timed."""
    windows = chunk_texts(tokenizer, texts, max_length=args.max_length, stride=args.stride)
    encoder = HierarchicalEncoder(model, chunk_pooling="mean")
    start = time.perf_counter()
    with torch.inference_mode():
        chunks = encoder.embed_chunks(windows)  # (W, E)
    seconds = time.perf_counter() - start
    tokens = int(windows.attention_mask.sum())
    log(f"  {len(texts)} texts, {chunks.shape[0]} windows, {seconds:.1f} s")
    return {"windows": windows, "chunks": chunks, "seconds": seconds, "tokens": tokens}


def check_against_embed_long(model: BertModel, tokenizer, texts, embedded, args) -> float:
    """The cached window vectors, aggregated, equal `embed_long` on the first texts."""
    windows = chunk_texts(tokenizer, texts[:4], max_length=args.max_length, stride=args.stride)
    part, chunks = select(embedded["windows"], embedded["chunks"], [0, 1, 2, 3])
    worst = 0.0
    with torch.inference_mode():
        for aggregation in ("first", "mean"):
            want = embed_long(model, windows, aggregation=aggregation)
            got = F.normalize(aggregate_windows(chunks, part, aggregation=aggregation), dim=1)
            worst = max(worst, float((want - got).abs().max()))
    if worst > 1e-5:
        raise RuntimeError(f"cached window vectors differ from embed_long by {worst:.2e}")
    return worst


def truncated_512(model: BertModel, tokenizer, texts: list[str]) -> torch.Tensor:
    """The first 512 tokens of each text in one window, mean-pooled, normalised: (N, E)."""
    windows = chunk_texts(tokenizer, texts, max_length=512, stride=0)
    with torch.inference_mode():
        return embed_long(model, windows, aggregation="first", batch_size=16)


def sparse_windows(model: BertModel, tokenizer, texts: list[str], args) -> dict:
    """Windows of 512 with Longformer's attention, mean-pooled: the "sparse" rows' vectors.
    The first window of each text is the one-pass row; checked against `embed_long` over
    `whole_documents` on the first texts."""
    windows = chunk_texts(tokenizer, texts, max_length=512, stride=args.stride)
    pattern = longformer_pattern(args.sparse_window)
    encoder = HierarchicalEncoder(model, chunk_pattern=pattern)
    start = time.perf_counter()
    with torch.inference_mode():
        chunks = encoder.embed_chunks(windows, batch_size=16)  # (W, E)
        seconds = time.perf_counter() - start
        docs = whole_documents(tokenizer, texts[:4], max_length=512, overflow="truncate")
        want = embed_long(model, docs, aggregation="first", pattern=pattern)
    part, part_chunks = select(windows, chunks, [0, 1, 2, 3])
    got = F.normalize(aggregate_windows(part_chunks, part, aggregation="first"), dim=1)
    if float((want - got).abs().max()) > 1e-5:
        raise RuntimeError("sparse window vectors differ from embed_long over whole_documents")
    log(f"  sparse: {len(texts)} texts, {chunks.shape[0]} windows of 512, {seconds:.1f} s")
    return {"windows": windows, "chunks": chunks, "seconds": seconds}


def features(embedded: dict, aggregation: str) -> torch.Tensor:
    pooled = aggregate_windows(embedded["chunks"], embedded["windows"], aggregation=aggregation)
    return F.normalize(pooled, dim=1)  # (N, E), what embed_long returns


def accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    return float((predicted == labels).float().mean())


def document_stats(texts: list[str], tokenizer, windows: Windows) -> dict:
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    per_text = torch.bincount(windows.text_index, minlength=windows.num_texts)
    return {
        "documents": len(texts),
        "tokens_min": min(lengths),
        "tokens_median": statistics.median(lengths),
        "tokens_max": max(lengths),
        "share_over_512_tokens": sum(n > 512 for n in lengths) / len(lengths),
        "share_over_256_tokens": sum(n > 256 for n in lengths) / len(lengths),
        "windows_mean": float(per_text.float().mean()),
        "windows_max": int(per_text.max()),
    }


LINEAR_METHODS = {  # name -> how a document's vector is taken from the windows
    "truncation (256 tokens)": "first",
    "truncation (512 tokens)": "first 512",
    "window mean (256, stride 32)": "mean",
}
SPARSE_METHODS = {"sparse, one pass (first 512 tokens)": "first", "sparse windows (512)": "mean"}


def linear_rows(model, tokenizer, documents, embedded: dict, labels: dict, args) -> list[dict]:
    """The logistic-regression methods, each with its own chosen L2 penalty."""
    rows = []
    methods = {} if args.no_dense else dict(LINEAR_METHODS)
    for name, aggregation in {**methods, **SPARSE_METHODS}.items():
        start = time.perf_counter()
        if aggregation == "first 512":
            log("truncation at 512 tokens ...")
            x = {
                s: truncated_512(model, tokenizer, [d.text for d in getattr(documents, s)])
                for s in embedded
            }
        elif name in SPARSE_METHODS:
            x = {s: features(embedded[s]["sparse"], aggregation) for s in embedded}
        else:
            x = {s: features(embedded[s], aggregation) for s in embedded}
        minilm_seconds = time.perf_counter() - start
        penalty = choose_penalty(x["train"], labels["train"], len(documents.labels))
        runs = [
            logistic_regression(
                x["train"], labels["train"], x["test"], len(documents.labels), seed, penalty
            )
            for seed in range(args.head_seeds)
        ]
        rows.append(summarise(name, "logistic regression", runs, labels))
        rows[-1]["l2_penalty"] = penalty
        if aggregation == "first 512":
            rows[-1]["extra_minilm_seconds"] = minilm_seconds
        if name in SPARSE_METHODS:
            rows[-1]["window_each_side"] = args.sparse_window
            rows[-1]["extra_minilm_seconds"] = sum(embedded[s]["sparse"]["seconds"] for s in x)
    return rows


def hierarchical_row(model, embedded: dict, labels: dict, num_labels: int, args) -> dict:
    """The hierarchical classifier, trained once per head seed on the cached window vectors."""
    data = {s: (embedded[s]["windows"], embedded[s]["chunks"], labels[s]) for s in embedded}
    log("training the hierarchical classifier ...")
    start = time.perf_counter()
    runs = [
        train_hierarchical(model, data, num_labels, seed, args) for seed in range(args.head_seeds)
    ]
    row = summarise("hierarchical (2 blocks)", "Transformer over chunks", runs, labels)
    row["train_seconds_per_seed"] = (time.perf_counter() - start) / args.head_seeds
    row["hyperparameters"] = dict(HIERARCHICAL, epochs=args.epochs)
    return row


def summarise(method: str, head: str, runs: list[dict], labels: dict) -> dict:
    test = [accuracy(run["test"], labels["test"]) for run in runs]
    train = [accuracy(run["train"], labels["train"]) for run in runs]
    return {
        "method": method,
        "head": head,
        "test_accuracy": statistics.mean(test),
        "test_accuracy_min": min(test),
        "test_accuracy_max": max(test),
        "test_accuracy_runs": test,
        "train_accuracy": statistics.mean(train),
    }


def table(rows: list[dict]) -> str:
    keys = ("test_accuracy", "test_accuracy_min", "test_accuracy_max", "train_accuracy")
    cells = [[r["method"], r["head"], *(f"{r[k]:.3f}" for k in keys)] for r in rows]
    return format_table(cells, ["method", "head", "test acc", "min", "max", "train acc"])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = BertModel.from_pretrained(default_model_path()).eval()
    tokenizer = minilm_wordpiece()
    documents = pydoc_topic_documents(
        num_train=args.num_train, num_test=args.num_test, seed=args.seed
    )
    embedded, stats = {}, {}
    for split in ("train", "test"):
        texts = [d.text for d in getattr(documents, split)]
        log(f"{split}: MiniLM over the windows ...")
        embedded[split] = embed_windows(model, tokenizer, texts, args)
        embedded[split]["sparse"] = sparse_windows(model, tokenizer, texts, args)
        stats[split] = document_stats(texts, tokenizer, embedded[split]["windows"])
    first_texts = [d.text for d in documents.train]
    deviation = check_against_embed_long(model, tokenizer, first_texts, embedded["train"], args)
    labels = {s: torch.tensor([d.label for d in getattr(documents, s)]) for s in embedded}
    rows = linear_rows(model, tokenizer, documents, embedded, labels, args)
    if not args.no_dense:
        rows.append(hierarchical_row(model, embedded, labels, len(documents.labels), args))
    info = machine_info("cpu")
    print(f"# {info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}")
    print(f"# {args.num_train} train / {args.num_test} test documents, labels {documents.labels}")
    print(table(rows))
    payload = {
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "labels": list(documents.labels),
        "documents": stats,
        "minilm_seconds": {s: embedded[s]["seconds"] for s in embedded},
        "minilm_tokens": {s: embedded[s]["tokens"] for s in embedded},
        "embed_long_max_deviation": deviation,
        "rows": rows,
        "total_seconds": time.perf_counter() - started,
    }
    write_json(args.out, payload)
    log(f"wrote {args.out} ({payload['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
