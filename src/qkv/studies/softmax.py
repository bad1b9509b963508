"""Softmax, exactly: saturation of its whole Jacobian, and float16 overflow on real scores.

Two measurements on sets of attention scores, one softmax per row:

1. Saturation, on and off the diagonal. Vaswani et al. 2017 (s3.2.1, footnote 4) argue that q . k
   of d_k-dimensional vectors with unit-variance components has variance d_k, so unscaled
   scores grow with d_k and push softmax "into regions where it has extremely small
   gradients"; dividing by sqrt(d_k) restores unit variance. The gradient of a softmax row is
   its Jacobian J = diag(y) - y y^T (`qkv.analysis.softmax_math.softmax_jacobian`): the
   diagonal y_i (1 - y_i) and the off-diagonal terms -y_i y_j. For random q, k (num_queries x
   num_keys scores, each d_k in turn, unscaled and divided by sqrt(d_k)) and for the real scores
   of all-MiniLM-L6-v2, each row's largest |diagonal| and |off-diagonal| entry, its Frobenius
   norm and its entropy are averaged over the rows (float64). The Jacobian is small at both
   ends: near uniform, every y_i is about 1/n; near one-hot, all but one are about 0.
2. Overflow. exp passes float16's largest value (65504) at 11.09, float32's at 88.7. Every row
   is cast to float16 (and bfloat16, float32) and put through the softmax as written
   (`naive_softmax`: exp, sum, divide) and with the row maximum subtracted first
   (`stable_softmax`; Goodfellow et al. 2016, "Deep Learning", s4.1): the rows that fail (an
   inf or NaN; or all zeros, when the exponentials are finite but their sum overflows), and the
   largest error of the other rows against the float64 softmax, with torch.softmax at the same
   precision beside them. The real scores are the q . k of every
   head and layer of all-MiniLM-L6-v2 (head dimension 32) on documentation texts, read where
   the model attends (`MultiHeadAttention.register_attention_hook`): divided by sqrt(32) as
   the model computes them, and unscaled.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from qkv.analysis.softmax_math import naive_softmax, softmax_jacobian, stable_softmax
from qkv.data import minilm_wordpiece, pydoc_texts
from qkv.layers.attention import MultiHeadAttention
from qkv.models.bert import BertModel
from qkv.models.checkpoints.bundled import default_model_path
from qkv.studies.record import StudyResult, Verdict, grade

__all__ = [
    "CLAIM",
    "SIZES",
    "TITLE",
    "figure",
    "minilm_scores",
    "overflow",
    "run",
    "saturation",
    "verdicts",
]

logger = logging.getLogger(__name__)

TITLE = "Softmax, exactly: Jacobian saturation and float16 overflow"
CLAIM = (
    "Unscaled dot products of d_k-dimensional vectors push softmax into saturation, where every "
    "entry of its Jacobian diag(y) - y y^T, off the diagonal as well as on it, vanishes, and "
    "dividing by sqrt(d_k) prevents it (Vaswani et al. 2017, s3.2.1); softmax computed as "
    "written overflows in float16 on the real attention scores of all-MiniLM-L6-v2, where "
    "subtracting the row maximum first does not (Goodfellow et al. 2016, s4.1), and bfloat16, "
    "with float32's exponent range, does not overflow either (Kalamkar et al. 2019)."
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "d_k_values": [4, 256], "num_queries": 16, "num_keys": 8, "minilm_texts": 1,
        "minilm_length": 16, "jacobian_chunk": 256,
    },
    "default": {
        "d_k_values": [1, 4, 16, 64, 256, 1024, 4096], "num_queries": 512, "num_keys": 64,
        "minilm_texts": 8, "minilm_length": 128, "jacobian_chunk": 512,
    },
}  # fmt: skip
DIAGONAL, OFF_DIAGONAL, NORM = "J: max abs diagonal", "J: max abs off-diagonal", "J: Frobenius norm"
SATURATION = ("mean max y", DIAGONAL, OFF_DIAGONAL, NORM, "entropy")
OVERFLOW = (
    "fp16 naive: failed rows", "fp16 naive: rows of zeros", "fp16 stable: failed rows",
    "fp16 naive: max error", "fp16 stable: max error", "fp16 torch.softmax: max error",
    "bf16 naive: failed rows", "fp32 naive: failed rows",
)  # fmt: skip
COLUMNS = ["scores", "rows", "score std", "max score", *SATURATION, *OVERFLOW]


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """Both measurements on random q . k for every d_k (seed: their draw) and on MiniLM."""
    rows, synthetic = [], {"unscaled": [], "scaled": []}
    generator = torch.Generator().manual_seed(seed)
    for d_k in settings["d_k_values"]:
        shape = (settings["num_queries"], d_k), (settings["num_keys"], d_k)
        q, k = (torch.randn(*s, generator=generator, dtype=torch.float64) for s in shape)
        dots = q @ k.T  # (num_queries, num_keys): variance d_k
        for kind, scores in (("unscaled", dots), ("scaled", dots / math.sqrt(d_k))):
            label = f"random q.k, d_k={d_k}, " + (
                "unscaled" if kind == "unscaled" else "/ sqrt(d_k)"
            )
            row = _measure(label, scores, settings)
            rows.append(row)
            synthetic[kind].append(row)
    raw, head_dim = minilm_scores(_documentation_ids(settings))  # (layers, B, H, L, L)
    raw = raw.flatten(0, -2)  # (rows, L): one softmax row per layer, text, head and query
    minilm = {
        "scaled": _measure(f"MiniLM q.k / sqrt({head_dim}), as computed", raw / math.sqrt(head_dim),
                           settings),
        "unscaled": _measure("MiniLM q.k, unscaled", raw, settings),
    }  # fmt: skip
    rows += [minilm["scaled"], minilm["unscaled"]]
    series = {
        "d_k_values": list(settings["d_k_values"]), "num_keys": settings["num_keys"],
        "minilm_length": settings["minilm_length"], "minilm_head_dim": head_dim,
        "synthetic": {kind: _columns_of(found) for kind, found in synthetic.items()},
        "minilm": minilm, "overflow": {row["scores"]: _overflow_part(row) for row in rows},
    }  # fmt: skip
    return StudyResult(
        name="softmax", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=rows,
        findings=_findings(series), series=series,
    )  # fmt: skip


def _measure(label: str, scores: torch.Tensor, settings: dict[str, Any]) -> dict[str, Any]:
    """One table row: the scores (rows, n) float64, their saturation and their overflow."""
    logger.info("softmax: %s (%d rows of %d)", label, *scores.shape)
    return {
        "scores": label, "rows": scores.shape[0], "score std": float(scores.std()),
        "max score": float(scores.max()),
        **saturation(scores, chunk=settings["jacobian_chunk"]), **overflow(scores),
    }  # fmt: skip


def saturation(scores: torch.Tensor, *, chunk: int = 512) -> dict[str, float]:
    """Row means, over the rows of scores (R, n), of: the largest softmax output, the largest
    |diagonal| and |off-diagonal| entry of the Jacobian diag(y) - y y^T, its Frobenius norm
    and the entropy (nats); the Jacobians are formed `chunk` rows at a time, in float64."""
    totals = dict.fromkeys(SATURATION, 0.0)
    for start in range(0, scores.shape[0], chunk):
        y = torch.softmax(scores[start : start + chunk].double(), dim=-1)  # (r, n)
        jacobian = softmax_jacobian(y).abs_()  # (r, n, n)
        diagonal = jacobian.diagonal(dim1=-2, dim2=-1)  # (r, n): a view into jacobian
        totals["mean max y"] += float(y.amax(dim=-1).sum())
        totals[DIAGONAL] += float(diagonal.amax(dim=-1).sum())
        totals[NORM] += float(jacobian.flatten(1).norm(dim=-1).sum())
        diagonal.zero_()  # what is left is the off-diagonal part (all 0 when n = 1)
        totals[OFF_DIAGONAL] += float(jacobian.flatten(1).amax(dim=-1).sum())
        totals["entropy"] += float(-torch.special.xlogy(y, y).sum())
    return {name: total / scores.shape[0] for name, total in totals.items()}


def overflow(scores: torch.Tensor) -> dict[str, float | int | None]:
    """How softmax as written and max-subtracted fare in float16 (and as written in float32) on
    scores (R, n): the rows that fail (an inf or NaN, or a sum under 1/2: when the sum of the
    exponentials overflows, every output is x / inf = 0), and the largest error of the other
    rows against the float64 softmax (None where every row fails)."""
    reference = torch.softmax(scores.double(), dim=-1)  # (R, n)
    half = scores.to(torch.float16)
    found: dict[str, float | int | None] = {}
    for name, probabilities in (
        ("naive", naive_softmax(half)), ("stable", stable_softmax(half)),
        ("torch.softmax", torch.softmax(half, dim=-1)),
    ):  # fmt: skip
        kept = ~_failed(probabilities)  # (R,)
        if name != "torch.softmax":
            found[f"fp16 {name}: failed rows"] = int((~kept).sum())
        if name == "naive":
            found["fp16 naive: rows of zeros"] = int((probabilities == 0).all(dim=-1).sum())
        error = (probabilities[kept].double() - reference[kept]).abs()
        found[f"fp16 {name}: max error"] = float(error.max()) if error.numel() else None
    # bfloat16 keeps float32's 8 exponent bits (Kalamkar et al. 2019): exp overflows past 88.7
    found["bf16 naive: failed rows"] = int(_failed(naive_softmax(scores.bfloat16())).sum())
    found["fp32 naive: failed rows"] = int(_failed(naive_softmax(scores.float())).sum())
    return found


def _failed(probabilities: torch.Tensor) -> torch.Tensor:
    """(R,) True where a softmax row (R, n) holds an inf or NaN or sums to less than 1/2."""
    finite = torch.isfinite(probabilities).all(dim=-1)
    return ~finite | (probabilities.double().sum(dim=-1) < 0.5)


def minilm_scores(input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Unscaled q . k of every layer and head of all-MiniLM-L6-v2 on input_ids (B, L), no
    padding: (layers, B, H, L, L) float64, and the head dimension."""
    model = BertModel.from_pretrained(default_model_path()).eval()
    found: list[torch.Tensor] = []

    def keep_scores(module, q, k, *, mask, causal, window, bias, cross, pattern) -> None:
        found.append(q.double() @ k.double().transpose(-1, -2))  # (B, H, L, L)

    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    handles = [layer.register_attention_hook(keep_scores) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(found), layers[0].head_dim  # (layers, B, H, L, L)


def _documentation_ids(settings: dict[str, Any]) -> torch.Tensor:
    """`minilm_texts` documentation texts cut to `minilm_length` tokens ([CLS] ... [SEP]),
    spread over the topics: (texts, L)."""
    length, count = settings["minilm_length"], settings["minilm_texts"]
    tokenizer = minilm_wordpiece()
    tokenizer.enable_truncation(max_length=length)
    full = [ids for ids in (tokenizer.encode(t).ids for t in pydoc_texts()) if len(ids) == length]
    if len(full) < count:
        raise ValueError(f"minilm_texts: only {len(full)} texts reach {length} tokens, got {count}")
    return torch.tensor([full[i * len(full) // count] for i in range(count)])  # (texts, L)


def _columns_of(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {name: [row[name] for row in rows] for name in ("score std", *SATURATION)}


def _overflow_part(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in ("rows", "max score", *OVERFLOW)}


def _findings(series: dict[str, Any]) -> list[str]:
    d_k = series["d_k_values"]
    unscaled, scaled = series["synthetic"]["unscaled"], series["synthetic"]["scaled"]
    ratio = unscaled[OFF_DIAGONAL][-1] / unscaled[DIAGONAL][-1]
    findings = [
        f"Random q.k, {series['num_keys']} keys: unscaled, the score std grows from "
        f"{unscaled['score std'][0]:.3g} (d_k={d_k[0]}) to {unscaled['score std'][-1]:.3g} "
        f"(d_k={d_k[-1]}), the largest output from {unscaled['mean max y'][0]:.3g} to "
        f"{unscaled['mean max y'][-1]:.3g} and the entropy from {unscaled['entropy'][0]:.3g} to "
        f"{unscaled['entropy'][-1]:.3g} nats; divided by sqrt(d_k), the std stays within "
        f"{_span(scaled['score std'])} and the entropy within {_span(scaled['entropy'])} "
        f"(uniform: {math.log(series['num_keys']):.3g}).",
        "Unscaled, each Jacobian statistic (row means) against d_k: "
        + "; ".join(_trend(name, unscaled[name], d_k) for name in (NORM, DIAGONAL, OFF_DIAGONAL))
        + f". Divided by sqrt(d_k): {NORM} within {_span(scaled[NORM])}, {DIAGONAL} within "
        f"{_span(scaled[DIAGONAL])}, {OFF_DIAGONAL} within {_span(scaled[OFF_DIAGONAL])}.",
        f"Off the diagonal: at d_k={d_k[-1]} unscaled, the largest off-diagonal entry is "
        f"{ratio:.2f} of the largest diagonal one (divided by sqrt(d_k): "
        f"{scaled[OFF_DIAGONAL][-1] / scaled[DIAGONAL][-1]:.2f}): "
        + (
            "the cross terms -y_i y_j are as large as the diagonal ones there: saturation shrinks "
            "both, and the diagonal alone does not describe the gradient."
            if ratio >= 0.5
            else "the diagonal dominates there."
        ),
    ]
    minilm = series["minilm"]
    findings.append(
        f"all-MiniLM-L6-v2's own scores (divided by sqrt({series['minilm_head_dim']})): mean "
        f"{NORM} {minilm['scaled'][NORM]:.3g}, entropy {minilm['scaled']['entropy']:.3g} nats; "
        f"unscaled, the same q.k give {minilm['unscaled'][NORM]:.3g} and "
        f"{minilm['unscaled']['entropy']:.3g} nats."
    )
    findings += [_overflow_finding(label, minilm[kind]) for kind, label in
                 (("scaled", "as the model computes them"), ("unscaled", "unscaled"))]  # fmt: skip
    return findings


def _span(values: list[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def _trend(name: str, values: list[float], d_k: list[int]) -> str:
    """'name a at d_k=first, peak p at d_k=k, b at d_k=last' (the peak only where it is
    neither end)."""
    peak = max(range(len(values)), key=values.__getitem__)
    text = f"{name} {values[0]:.3g} at d_k={d_k[0]}"
    if 0 < peak < len(values) - 1:
        text += f", peak {values[peak]:.3g} at d_k={d_k[peak]}"
    return text + f", {values[-1]:.3g} at d_k={d_k[-1]}"


def _overflow_finding(label: str, row: dict[str, Any]) -> str:
    rows = row["rows"]
    naive, stable = row["fp16 naive: failed rows"], row["fp16 stable: failed rows"]
    text = (
        f"float16 on MiniLM's scores {label} (largest {row['max score']:.3g}; exp overflows "
        f"float16 past {math.log(torch.finfo(torch.float16).max):.2f}): softmax as written "
        f"fails in {naive:,} of {rows:,} rows ({naive / rows:.2%}; "
        f"{row['fp16 naive: rows of zeros']:,} of them all zeros, their exponentials finite but "
        f"their sum past 65504), the max-subtracted form in {stable:,}"
    )
    names = [name for name in ("naive", "stable", "torch.softmax")
             if row[f"fp16 {name}: max error"] is not None]  # fmt: skip
    errors = ", ".join(f"{name} {row[f'fp16 {name}: max error']:.3g}" for name in names)
    single, brain = row["fp32 naive: failed rows"], row.get("bf16 naive: failed rows")
    wider = "" if brain is None else f"{brain:,} rows in bfloat16 (float32's exponent range) and "
    return (
        f"{text}; max error against float64 on the rows each form does not fail: {errors}; "
        f"softmax as written fails in {wider}{single:,} rows in float32."
    )


def figure(result: StudyResult):
    """Left: the Jacobian's largest diagonal and off-diagonal entries and its norm against d_k,
    unscaled (solid) and divided by sqrt(d_k) (dashed), MiniLM's scores as horizontal lines.
    Middle: the entropy. Right: the share of rows on which softmax as written fails in
    float16, against the max-subtracted form, for every set of scores."""
    from matplotlib.figure import Figure

    series = result.series
    fig = Figure(figsize=(16, 4.8))
    jacobian_ax, entropy_ax, overflow_ax = fig.subplots(
        1, 3, gridspec_kw={"width_ratios": [1.2, 1, 1.4]}
    )
    d_k = series["d_k_values"]
    for index, name in enumerate((DIAGONAL, OFF_DIAGONAL, NORM)):
        for kind, style in (("unscaled", "-"), ("scaled", "--")):
            values = [max(value, 1e-300) for value in series["synthetic"][kind][name]]
            label = f"{name}, {'unscaled' if kind == 'unscaled' else '/ sqrt(d_k)'}"
            jacobian_ax.plot(d_k, values, style, marker="o", color=f"C{index}", label=label)
        jacobian_ax.axhline(series["minilm"]["scaled"][name], color=f"C{index}", linestyle=":")
    jacobian_ax.set(xscale="log", yscale="log", xlabel="d_k", ylabel="row mean",
                    title="Softmax Jacobian (dotted: MiniLM's own scores)")  # fmt: skip
    jacobian_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    for kind, style in (("unscaled", "-"), ("scaled", "--")):
        label = "unscaled" if kind == "unscaled" else "/ sqrt(d_k)"
        entropy_ax.plot(d_k, series["synthetic"][kind]["entropy"], style, marker="o", label=label)
    entropy_ax.axhline(math.log(series["num_keys"]), color="grey", linestyle=":",
                       label=f"uniform over {series['num_keys']} keys")  # fmt: skip
    entropy_ax.set(xscale="log", xlabel="d_k", ylabel="entropy (nats)", title="Softmax entropy")
    entropy_ax.legend(fontsize=8)
    _draw_overflow(overflow_ax, series["overflow"])
    for ax in (jacobian_ax, entropy_ax, overflow_ax):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(TITLE)
    fig.tight_layout()
    return fig


def _draw_overflow(ax: Any, found: dict[str, dict[str, Any]]) -> None:
    """Horizontal bars, one pair per set of scores: the share of rows that fail in float16,
    as written and max-subtracted, each labelled with its count."""
    labels = list(found)
    for offset, name, color in ((-0.2, "naive", "tab:red"), (0.2, "stable", "tab:blue")):
        counts = [found[label][f"fp16 {name}: failed rows"] for label in labels]
        shares = [count / found[label]["rows"] for count, label in zip(counts, labels, strict=True)]
        positions = [index + offset for index in range(len(labels))]
        ax.barh(positions, shares, height=0.4, color=color,
                label="as written" if name == "naive" else "max subtracted")  # fmt: skip
        for position, share, count in zip(positions, shares, counts, strict=True):
            ax.text(share + 0.01, position, f"{count:,}", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="share of rows that fail (inf, NaN or all 0)", xlim=(0, 1.1),
           title="float16 softmax: failed rows")  # fmt: skip
    ax.legend(fontsize=8)


VANISHED = 0.5  # "vanishes": at the largest d_k, at most half its largest value over d_k
WHY = "random q.k and one small model's scores are a narrow sample of attention."


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table: the random q.k rows by d_k, scaled and unscaled,
    and MiniLM's rows as the model computes them."""
    unscaled = [
        row for row in rows if row["scores"].startswith("random") and "unscaled" in row["scores"]
    ]
    scaled = [row for row in rows if row["scores"].startswith("random") and "sqrt" in row["scores"]]
    shrunk = {
        key: unscaled[-1][key] / max(row[key] for row in unscaled)
        for key in (DIAGONAL, OFF_DIAGONAL, NORM)
    }
    held = max(row[NORM] for row in scaled) / min(row[NORM] for row in scaled)
    found = [Verdict(
        "unscaled scores saturate softmax, its whole Jacobian vanishing; 1/sqrt(d_k) prevents it",
        grade((max(shrunk.values()) <= VANISHED) + (held <= 1 / VANISHED), 2),
        f"Supported if, unscaled, the largest diagonal and off-diagonal Jacobian entries and its "
        f"Frobenius norm each end at the largest d_k at most {VANISHED}x their peak over d_k, and, "
        f"scaled, the Frobenius norm stays within {1 / VANISHED:g}x over d_k; mixed if one holds.",
        ", ".join(f"{key} {value:.2f}x its peak" for key, value in shrunk.items())
        + f" unscaled; scaled Frobenius norm within {held:.2f}x", WHY)]  # fmt: skip
    minilm = next(
        row for row in rows if row["scores"].startswith("MiniLM") and "sqrt" in row["scores"]
    )
    naive, stable = minilm["fp16 naive: failed rows"], minilm["fp16 stable: failed rows"]
    found.append(Verdict(
        "softmax as written overflows in float16 on MiniLM's scores, max-subtracted does not",
        grade((naive > 0) + (stable == 0), 2),
        "Supported if on MiniLM's scores as computed softmax as written fails in some rows in "
        "float16 and the max-subtracted form in none; mixed if one holds.",
        f"{naive:,} and {stable:,} failed rows of {minilm['rows']:,}", WHY))  # fmt: skip
    if "bf16 naive: failed rows" in minilm:  # results recorded before the bfloat16 column
        brain = minilm["bf16 naive: failed rows"]
        found.append(Verdict(
            "the same scores stay finite in bfloat16, as written", grade(brain == 0, 1),
            "Supported if softmax as written fails in no row of MiniLM's scores as computed in "
            "bfloat16.", f"{brain:,} failed rows of {minilm['rows']:,}", WHY))  # fmt: skip
    return found
