"""Before the Transformer: a fixed context vector, additive and dot/general attention in GRU
encoder-decoders, and the Transformer, on the German -> English numbers task.

Five models translate German number words into English ones (`qkv.data.number_pairs`: the
German units come before the tens, so the order changes). All five read the same pairs through
the same shared BPE, train on the same batches in the same order for the same number of steps
(the budget is counted in steps, so the runs repeat exactly; the seconds each took are
reported beside), and are scored by exact match of their greedy translations of held-out
numbers, binned by the source's length in tokens:

- none: `RNNSeq2Seq(attention="none")`, a bidirectional GRU encoder whose final states are the
  one fixed context vector the decoder sees (Cho et al. 2014; Sutskever et al. 2014);
- additive: the same with Bahdanau et al. 2015's additive attention from s_{i-1};
- dot, general: the same with Luong et al. 2015's scores from the current state s_t;
- transformer: the translate task's `qkv.models.Transformer` (Vaswani et al. 2017), smaller.

At the default sizes every recurrent model's state, and so the fixed context vector, is 64
numbers wide (two directions of 32), the Transformer has about as many parameters as the
recurrent models, and the BPE vocabulary is small (64 tokens), so that sources run to about 30
tokens.

Bahdanau et al. (their Figure 2) and Cho et al. ("On the Properties of Neural Machine Translation:
Encoder-Decoder Approaches", 2014) found that the fixed-vector model's quality falls as sentences
grow, and that attention removes most of the fall. The figure also sets the additive model's
alignment weights for one held-out number beside the Transformer's cross-attention (its last
decoder layer, averaged over heads), each row the weights with which the model chose that output
token.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from qkv.analysis.inspection.attention_maps import record_attention
from qkv.data.translate import EOS_ID, PAD_ID
from qkv.generation.beam import greedy_decode
from qkv.models.rnn_seq2seq import RNNSeq2Seq, RNNSeq2SeqConfig
from qkv.studies.before_transformer_verdict import UNJUDGED, verdicts  # noqa: F401
from qkv.studies.inputs import data_order
from qkv.studies.record import StudyResult
from qkv.training.optim import build_optimizer
from qkv.training.schedule import build_scheduler
from qkv.training.tasks.translate import TranslateOptions, TranslateTask, translate

__all__ = ["CLAIM", "LABELS", "MODELS", "SIZES", "TITLE", "build_model", "figure", "run"]

TITLE = "Before the Transformer: fixed context, additive and dot attention, and the Transformer"
CLAIM = (
    "On German -> English number words, a GRU encoder-decoder with one fixed context vector "
    "(Cho et al. 2014; Sutskever et al. 2014) is expected to lose exact matches as the source "
    "grows, where additive (Bahdanau et al. 2015) and dot/general (Luong et al. 2015) attention "
    "and the Transformer (Vaswani et al. 2017) hold them; the additive model's alignments and "
    "the Transformer's cross-attention are expected to follow the reordering of the words."
)
MODELS = ("none", "additive", "dot", "general", "transformer")
LABELS = {
    "none": "GRU, fixed context", "additive": "GRU + additive", "dot": "GRU + dot",
    "general": "GRU + general", "transformer": "Transformer",
}  # fmt: skip
_EVAL_BATCH = 250

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "max_number": 99, "num_train": 64, "num_test": 16, "vocab_size": 40,
        "rnn_embed_dim": 8, "rnn_hidden_size": 8, "attention_dim": 8,
        "transformer_embed_dim": 8, "transformer_heads": 2, "transformer_layers": 1,
        "transformer_ffn_dim": 16, "train_steps": 3, "batch_size": 8, "learning_rate": 3e-3,
        "warmup_steps": 1, "weight_decay": 0.0, "label_smoothing": 0.1, "dropout": 0.0,
        "length_edges": [8], "max_length": 16,
    },
    "default": {
        "max_number": 999_999, "num_train": 10_000, "num_test": 600, "vocab_size": 64,
        "rnn_embed_dim": 32, "rnn_hidden_size": 32, "attention_dim": 32,
        "transformer_embed_dim": 32, "transformer_heads": 4, "transformer_layers": 2,
        "transformer_ffn_dim": 128, "train_steps": 800, "batch_size": 64,
        "learning_rate": 3e-3, "warmup_steps": 40, "weight_decay": 0.0, "label_smoothing": 0.1,
        "dropout": 0.0, "length_edges": [10, 14, 18, 22, 26], "max_length": 48,
    },
}  # fmt: skip

logger = logging.getLogger(__name__)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Train the five models on one data order, score each by source length, draw alignments.
    seed: the initial weights and the data order; the numbers drawn are the task's own."""
    task = _task(settings)
    order = data_order(len(task.train_set), steps=settings["train_steps"],
                       batch_size=settings["batch_size"], seed=seed)  # fmt: skip
    test = task.test_set
    source_lengths = [len(ids) for ids in test.sources]
    models, seconds, losses, correct = {}, {}, {}, {}
    for name in MODELS:
        torch.manual_seed(seed)  # each model's initial weights depend on the seed alone
        model = build_model(name, task, settings)
        seconds[name], losses[name] = _train(model, task, order, settings)
        correct[name] = _exact_matches(name, model, task)
        models[name] = model
        logger.info(
            "%s: %.1f%% exact match, %.0f s", name, 100 * sum(correct[name]) / len(test),
            seconds[name],
        )  # fmt: skip
    series = {
        "models": list(MODELS),
        "bins": _bin_labels(settings["length_edges"]),
        "bin_counts": _bin_counts(source_lengths, settings["length_edges"]),
        "exact_match_by_length": {
            name: _binned(correct[name], source_lengths, settings["length_edges"])
            for name in MODELS
        },
        "exact_match": {name: sum(hits) / len(hits) for name, hits in correct.items()},
        "train_seconds": seconds,
        "final_loss": losses,
        "parameters": {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()},
        "alignment": _alignments(models, task, correct, source_lengths),
    }
    columns, rows = _table(series)
    return StudyResult(
        name="before-transformer", title=TITLE, claim=CLAIM, columns=columns, rows=rows,
        findings=_findings(series, settings), series=series,
    )  # fmt: skip


def _task(settings: dict[str, Any]) -> TranslateTask:
    """The translate task's pairs, BPE and Transformer, at the study's sizes (its validation
    split, unused here, is one pair)."""
    options = TranslateOptions(
        max_number=settings["max_number"], num_train=settings["num_train"], num_valid=1,
        num_test=settings["num_test"], vocab_size=settings["vocab_size"],
        embed_dim=settings["transformer_embed_dim"], num_heads=settings["transformer_heads"],
        num_layers=settings["transformer_layers"], ffn_dim=settings["transformer_ffn_dim"],
        dropout=settings["dropout"], label_smoothing=settings["label_smoothing"],
        max_length=settings["max_length"],
    )  # fmt: skip
    return TranslateTask(options)


def build_model(name: str, task: TranslateTask, settings: dict[str, Any]) -> torch.nn.Module:
    """The study's model called `name` ("transformer" or an RNN attention kind) for `task`'s
    vocabulary, at the sizes in `settings`."""
    if name == "transformer":
        return task.build_model()
    vocab = task.tokenizer.get_vocab_size()
    return RNNSeq2Seq(
        RNNSeq2SeqConfig(
            src_vocab_size=vocab, tgt_vocab_size=vocab, attention=name,
            embed_dim=settings["rnn_embed_dim"], hidden_size=settings["rnn_hidden_size"],
            attention_dim=settings["attention_dim"], dropout=settings["dropout"],
            share_embeddings=True, label_smoothing=settings["label_smoothing"],
        )
    )  # fmt: skip


def _train(
    model: torch.nn.Module, task: TranslateTask, order: torch.Tensor, settings: dict[str, Any]
) -> tuple[float, float]:
    """AdamW, warm-up then cosine decay, gradients clipped at 1: (seconds, last loss)."""
    optimizer = build_optimizer(
        model, learning_rate=settings["learning_rate"], weight_decay=settings["weight_decay"]
    )
    scheduler = build_scheduler(
        optimizer, warmup_steps=settings["warmup_steps"], total_steps=len(order), kind="cosine"
    )
    model.train()
    started, loss = time.perf_counter(), torch.tensor(float("nan"))
    for indices in order.tolist():
        batch = task.train_set.collate(indices)
        loss = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    model.eval()
    return time.perf_counter() - started, float(loss.detach())


@torch.no_grad()
def _exact_matches(name: str, model: torch.nn.Module, task: TranslateTask) -> list[bool]:
    """Whether each test pair's greedy translation equals its reference exactly."""
    pairs = task.test_set.pairs
    outputs: list[str] = []
    for start in range(0, len(pairs), _EVAL_BATCH):
        indices = list(range(start, min(start + _EVAL_BATCH, len(pairs))))
        if name == "transformer":
            outputs += translate(model, task.tokenizer, [pairs[i][0] for i in indices])
            continue
        batch = task.test_set.collate(indices)
        sequences, _ = model.greedy_decode(
            batch["input_ids"], batch["attention_mask"], max_new_tokens=task.options.max_length
        )
        outputs += task.tokenizer.decode_batch(sequences.tolist(), skip_special_tokens=True)
    return [output == target for output, (_, target) in zip(outputs, pairs, strict=True)]


def _bin_labels(edges: list[int]) -> list[str]:
    """Source-length bins in tokens: "<= e0 - 1", "e0-e1 - 1", ..., ">= e_last"."""
    labels = [f"<={edges[0] - 1}"]
    labels += [f"{low}-{high - 1}" for low, high in zip(edges, edges[1:], strict=False)]
    return labels + [f">={edges[-1]}"]


def _bin_of(length: int, edges: list[int]) -> int:
    return sum(length >= edge for edge in edges)


def _bin_counts(lengths: list[int], edges: list[int]) -> list[int]:
    counts = [0] * (len(edges) + 1)
    for length in lengths:
        counts[_bin_of(length, edges)] += 1
    return counts


def _binned(hits: list[bool], lengths: list[int], edges: list[int]) -> list[float | None]:
    """Exact match in each length bin, None where a bin holds no test number."""
    totals, right = [0] * (len(edges) + 1), [0] * (len(edges) + 1)
    for hit, length in zip(hits, lengths, strict=True):
        totals[_bin_of(length, edges)] += 1
        right[_bin_of(length, edges)] += hit
    return [r / t if t else None for r, t in zip(right, totals, strict=True)]


@torch.no_grad()
def _alignments(
    models: dict[str, torch.nn.Module],
    task: TranslateTask,
    correct: dict[str, list[bool]],
    source_lengths: list[int],
) -> dict[str, Any]:
    """For one test number (the longest source both the additive model and the Transformer
    translate exactly; the longest source if none): each model's output tokens and the weights
    (output tokens x source tokens) it chose them with."""
    both = [i for i, hit in enumerate(correct["additive"]) if hit and correct["transformer"][i]]
    candidates = both or list(range(len(source_lengths)))
    index = max(candidates, key=lambda i: (source_lengths[i], -i))
    source_ids = torch.tensor([task.test_set.sources[index]])  # (1, S)
    token = task.tokenizer.id_to_token
    sequences, weights = models["additive"].greedy_decode(
        source_ids, max_new_tokens=task.options.max_length
    )  # (1, 1 + T), (1, T, S)
    maps = {"additive": _named_map(sequences[0, 1:], weights[0], token)}
    maps["transformer"] = _transformer_map(models["transformer"], source_ids, task)
    source, reference = task.test_set.pairs[index]
    return {
        "source": source, "reference": reference,
        "source_tokens": [token(i) for i in source_ids[0].tolist()], "maps": maps,
    }  # fmt: skip


def _transformer_map(model, source_ids: torch.Tensor, task: TranslateTask) -> dict[str, Any]:
    """The last decoder layer's cross-attention, averaged over heads, in a teacher-forced pass
    over the Transformer's own greedy output: row i chose output token i."""
    sequences, _ = greedy_decode(
        model,
        source_ids,
        attention_mask=source_ids != PAD_ID,
        max_new_tokens=task.options.max_length - 1,
    )  # fmt: skip  (1, 1 + T)
    name = f"decoder.{model.config.num_decoder_layers - 1}.cross"
    with record_attention(model, layers=[name]) as recording:
        model(source_ids, decoder_input_ids=sequences[:, :-1])
    weights = recording[name].weights[0].mean(dim=0)  # (T, S): heads averaged
    return _named_map(sequences[0, 1:], weights, task.tokenizer.id_to_token)


def _named_map(tokens: torch.Tensor, weights: torch.Tensor, token) -> dict[str, Any]:
    """Output tokens up to [EOS] (dropped with their rows) and their rows of weights."""
    ids = tokens.tolist()
    end = ids.index(EOS_ID) if EOS_ID in ids else len(ids)
    return {
        "tokens": [token(i) for i in ids[:end]],
        "weights": [[round(float(w), 4) for w in row] for row in weights[:end]],
    }


def _table(series: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per model: parameters, training seconds, last loss, exact match, by length."""
    bin_columns = [f"EM src {label}" for label in series["bins"]]
    columns = ["model", "parameters", "train s", "final loss", "exact match", *bin_columns]
    rows = []
    for name in series["models"]:
        row = {
            "model": LABELS[name], "parameters": series["parameters"][name],
            "train s": series["train_seconds"][name], "final loss": series["final_loss"][name],
            "exact match": series["exact_match"][name],
        }  # fmt: skip
        row.update(zip(bin_columns, series["exact_match_by_length"][name], strict=True))
        rows.append(row)
    return columns, rows


def _findings(series: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Sentences read off the numbers: overall exact match, the change from the shortest to the
    longest sources, training time, and how the two alignment maps compare."""
    exact, by_length = series["exact_match"], series["exact_match_by_length"]
    ranked = sorted(series["models"], key=lambda name: -exact[name])
    findings = [
        f"Exact match on {sum(series['bin_counts'])} held-out numbers after "
        f"{settings['train_steps']} steps of {settings['batch_size']} pairs: "
        + ", ".join(f"{LABELS[name]} {exact[name]:.1%}" for name in ranked) + "."
    ]  # fmt: skip
    filled = [i for i, count in enumerate(series["bin_counts"]) if count]
    if len(filled) > 1:
        first, last = filled[0], filled[-1]
        change = {name: by_length[name][last] - by_length[name][first] for name in ranked}
        worst = min(change, key=change.get)
        best_long = max(series["models"], key=lambda name: by_length[name][last])
        fall = f"the largest fall is {LABELS[worst]}'s" if change[worst] < 0 else "no model falls"
        findings.append(
            f"From sources of {series['bins'][first]} tokens to {series['bins'][last]} tokens, "
            "exact match changes by "
            + ", ".join(f"{100 * change[name]:+.0f} points ({LABELS[name]})" for name in ranked)
            + f": {fall}. On the longest sources {LABELS[best_long]} is best "
            f"({by_length[best_long][last]:.1%}); the fixed context vector reaches "
            f"{by_length['none'][last]:.1%}."
        )
    findings.append(_time_finding(series))
    findings.append(_alignment_finding(series["alignment"]))
    return findings


def _time_finding(series: dict[str, Any]) -> str:
    seconds = series["train_seconds"]
    ratio = seconds["additive"] / max(seconds["dot"], 1e-9)
    return (
        "Training seconds for the same steps: "
        + ", ".join(f"{LABELS[name]} {seconds[name]:.0f}" for name in series["models"])
        + f". The additive decoder attends before each step, so even teacher forcing runs it "
        f"one target token at a time: {ratio:.1f}x the dot decoder's time."
    )


def _alignment_finding(alignment: dict[str, Any]) -> str:
    """Where the two maps put each output token's largest weight, and how peaked they are."""
    additive, transformer = alignment["maps"]["additive"], alignment["maps"]["transformer"]
    peak = {
        name: sum(max(row) for row in part["weights"]) / max(len(part["weights"]), 1)
        for name, part in (("additive", additive), ("transformer", transformer))
    }
    text = (
        f"On {alignment['source']!r} the largest weight of an output token averages "
        f"{peak['additive']:.2f} (additive) and {peak['transformer']:.2f} (Transformer, mean of "
        "heads)"
    )
    if additive["tokens"] != transformer["tokens"]:
        return text + "; the two outputs differ, so their rows are not compared."
    agree = sum(
        a.index(max(a)) == t.index(max(t))
        for a, t in zip(additive["weights"], transformer["weights"], strict=True)
    )
    return (
        text + f"; their most-weighted source token is the same for {agree} of "
        f"{len(additive['tokens'])} output tokens."
    )


def figure(result: StudyResult):
    """Exact match by source length per model, and the two alignment maps side by side."""
    import matplotlib.pyplot as plt

    series = result.series
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    ax = axes[0]
    positions = list(range(len(series["bins"])))
    for name in series["models"]:
        values = series["exact_match_by_length"][name]
        points = [(x, y) for x, y in zip(positions, values, strict=True) if y is not None]
        ax.plot(*zip(*points, strict=True), marker="o", label=LABELS[name])
    labels = [f"{b}\n(n={n})" for b, n in zip(series["bins"], series["bin_counts"], strict=True)]
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_xlabel("source length (BPE tokens)")
    ax.set_ylabel("exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Exact match vs source length", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    alignment = series["alignment"]
    for ax, name, title in (
        (axes[1], "additive", "additive attention (Bahdanau)"),
        (axes[2], "transformer", "Transformer cross-attention, last layer"),
    ):
        _draw_map(ax, alignment["maps"][name], alignment["source_tokens"], title)
    fig.suptitle(f"{result.title}\n{alignment['source']} -> {alignment['reference']}", fontsize=10)
    fig.tight_layout()
    return fig


def _draw_map(ax, part: dict[str, Any], source_tokens: list[str], title: str) -> None:
    weights = part["weights"] or [[0.0] * len(source_tokens)]
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(source_tokens)), source_tokens, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(part["tokens"])), part["tokens"], fontsize=7)
    ax.set_xlabel("source token")
    ax.set_ylabel("output token")
    ax.set_title(title, fontsize=10)
    ax.figure.colorbar(image, ax=ax, fraction=0.046)
