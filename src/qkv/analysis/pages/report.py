"""`qkv report`: one self-contained HTML page with everything qkv can show about a model.

Sections (`SECTIONS`, in page order):

- model: the class, its config and its parameter count.
- attention: heat maps of chosen layers, one panel per head, of the model's attention over a
  text, all heads of a layer side by side (Clark et al. 2019), with the exact
  weights behind them as JSON (`<script type="application/json" id="qkv-attention-data">`).
- viewer: the interactive head view of `qkv viz` (every layer and head) in an iframe.
- heads (on request): the input/output cosine similarity of each attention module and,
  for a GPT, head importance on the text (Michel et al. 2019; `qkv.analysis.inspection.heads`).
- cost: `qkv cost` for the model's own config: parameters, FLOPs, score-matrix and KV-cache
  memory (Kaplan et al. 2020 for FLOPs, Pope et al. 2022 for the KV cache).
- complexity: the doubling benchmark of the O(L^2) problem (`qkv bench complexity`) at the model's
  own heads and head size, small (one repeat, L = 128 .. 1024): a glimpse, not a measurement.
- figures: the classic, model-independent figures of the papers (`qkv.analysis.plots`):
  softmax saturation and sqrt(d_k) scaling, masks, positional encodings, GELU vs ReLU.

The page loads nothing: figures are PNG data: URIs, tables are HTML tables, the CSS is inline,
and the viewer travels in the iframe's srcdoc. It can be mailed as one file and opened offline.
The maps come from one forward pass under `record_attention`, exact whatever backend runs.
"""

from __future__ import annotations

import dataclasses
import html
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from qkv.analysis.cost.complexity import measure_complexity
from qkv.analysis.cost.complexity_report import plot_complexity
from qkv.analysis.cost.estimate import cost_report
from qkv.analysis.cost.format import report_rows as cost_rows
from qkv.analysis.inspection.attention_maps import AttentionMap, record_attention
from qkv.analysis.inspection.heads import head_importance, position_cosine_similarity
from qkv.analysis.pages.report_html import figure, json_script, page, section, table
from qkv.analysis.pages.viz import attention_view_html
from qkv.models import GPT, Transformer

__all__ = ["CLASSIC_FIGURES", "COMPLEXITY_LENGTHS", "DEFAULT_SECTIONS", "SECTIONS", "build_report"]

logger = logging.getLogger(__name__)

SECTIONS = {  # name -> heading, in page order
    "model": "Model", "attention": "Attention maps", "viewer": "Attention viewer", "heads": "Heads",
    "cost": "Cost", "complexity": "Complexity", "figures": "Classic figures",
}  # fmt: skip
DEFAULT_SECTIONS = tuple(name for name in SECTIONS if name != "heads")  # heads: on request
COMPLEXITY_LENGTHS = (128, 256, 512, 1024)
VIEWER_HEIGHT, VIEWER_ROW_HEIGHT = 160, 22  # pixels: controls, then one row per token
EXAMPLE_TOKENS = ("The", "cat", "sat", "down")  # a short sentence, readable cell by cell


def _example_attention():
    """Random Q and K for the 4 example tokens, d_k = 8, seed 0."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, len(EXAMPLE_TOKENS), 8, generator=generator, dtype=torch.float64)
    return {"q": q, "k": k, "tokens": list(EXAMPLE_TOKENS), "annotate": True}


# name -> (caption, arguments); each is `qkv.analysis.plots.<name>(**arguments())`.
CLASSIC_FIGURES: dict[str, tuple[str, Callable[[], dict]]] = {
    "bidirectional_vs_causal": (
        "Bidirectional (BERT) vs causal (GPT) attention of the same queries and keys",
        _example_attention,
    ),
    "mask_gallery": ("Padding, causal and structured masks", dict),
    "softmax_scaling": ("Softmax of unscaled vs scaled scores (Vaswani et al. 2017, s3.2.1)", dict),
    "softmax_saturation": ("softmax([a, a, 2a]) saturates, its gradient vanishes", dict),
    "scaling_comparison": ("Scaling by d_k vs sqrt(d_k) vs none", dict),
    "rope_vs_sinusoidal_decay": ("RoPE's decay vs sinusoidal encodings (Su et al. 2021)", dict),
    "alibi_biases": ("ALiBi's per-head linear biases (Press et al. 2022)", dict),
    "permutation_equivariance": (
        "Without positions, permuting the input permutes the output (Vaswani et al. 2017, s3.5)",
        dict,
    ),
    "gelu_vs_relu": ("GELU vs ReLU and their derivatives (Hendrycks & Gimpel 2016)", dict),
}


def build_report(
    model: nn.Module,
    tokenizer,
    text: str,
    *,
    model_name: str,
    sections: Sequence[str] = DEFAULT_SECTIONS,
    complexity: bool = True,
    layers: Sequence[int] = (0, -1),
    heads: Sequence[int] | None = None,
    complexity_lengths: Sequence[int] = COMPLEXITY_LENGTHS,
    extra_sections: Sequence[tuple[str, str, str]] = (),
) -> str:
    """The report page for `model` (a qkv BERT, GPT or encoder-decoder `Transformer`) as one
    HTML string.

    tokenizer: a `tokenizers.Tokenizer` (the model's tokenizer.json); text: what the model reads
    for the attention sections (the source, for an encoder-decoder, whose decoder reads only
    its start token). sections: a subset of `SECTIONS`, shown in `SECTIONS` order (the default
    leaves out "heads", which runs a backward pass);
    complexity=False drops the benchmark (the only part that takes seconds). layers: the layers
    drawn as heat maps (negative ones count from the end); heads: the heads drawn (default all).
    extra_sections: (id, heading, HTML body) appended after these, e.g. the studies' results
    (`qkv.studies.report_section`). Needs matplotlib.
    """
    wanted = _check_sections(sections, complexity)
    plots = _import_plots()
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text: expected a non-empty string, got {text!r}")
    recorded = (
        _run_text(model, tokenizer, text) if {"attention", "viewer", "heads"} & {*wanted} else None
    )
    builders = {
        "model": lambda: _model_section(model, model_name),
        "attention": lambda: _attention_section(plots, recorded, layers=layers, heads=heads),
        "viewer": lambda: _viewer_section(recorded, title=f"{model_name}: {text}"),
        "heads": lambda: _heads_section(model, recorded),
        "cost": lambda: _cost_section(model, model_name),
        "complexity": lambda: _complexity_section(model, complexity_lengths),
        "figures": lambda: _figures_section(plots),
    }
    bodies = []
    for name in wanted:
        logger.info("report: building the %s section", name)
        bodies.append(section(name, SECTIONS[name], builders[name]()))
    headings = {n: SECTIONS[n] for n in wanted}
    for name, heading, body in extra_sections:
        headings[name] = heading
        bodies.append(section(name, heading, body))
    return page(f"qkv report: {model_name}", headings, bodies)


def _check_sections(sections: Sequence[str], complexity: bool) -> list[str]:
    if isinstance(sections, str) or not all(isinstance(name, str) for name in sections):
        raise TypeError(f"sections: expected a sequence of section names, got {sections!r}")
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown or not sections:
        raise ValueError(
            f"sections: expected a non-empty subset of {list(SECTIONS)}, got {sections!r}"
        )
    return [name for name in SECTIONS if name in sections and (complexity or name != "complexity")]


def _import_plots():
    try:
        from qkv.analysis import plots
    except ImportError as error:
        raise ImportError(
            "qkv report draws its figures with matplotlib, an optional dependency: "
            "pip install matplotlib"
        ) from error
    return plots


@dataclasses.dataclass(frozen=True)
class _TextRun:
    """The model's inputs for the text, their tokens, and every attention map of one forward
    pass over them (all layers and heads)."""

    input_ids: torch.Tensor  # (1, L)
    forward_kwargs: dict  # an encoder-decoder's decoder_input_ids: its start token
    tokens: list[str]  # the text's tokens
    start_tokens: list[str] | None  # an encoder-decoder's decoder input; None otherwise
    maps: list[AttentionMap]


def _run_text(model: nn.Module, tokenizer, text: str) -> _TextRun:
    """Run the model once on `text` (an encoder-decoder: as the source, the decoder reading its
    start token) and record every layer and head."""
    encoding = tokenizer.encode(text)
    device = next(model.parameters()).device
    input_ids = torch.tensor([encoding.ids], device=device)  # (1, L)
    forward_kwargs, start_tokens = {}, None
    if isinstance(model, Transformer):
        bos = model.config.bos_token_id
        forward_kwargs["decoder_input_ids"] = torch.tensor([[bos]], device=device)  # (1, 1)
        start_tokens = [tokenizer.id_to_token(bos) or "<bos>"]
    with record_attention(model) as recording, torch.inference_mode():
        model(input_ids, **forward_kwargs)
    return _TextRun(input_ids, forward_kwargs, list(encoding.tokens), start_tokens, recording.maps)


def _text_maps(recorded: _TextRun, layers: Sequence[int]) -> list[AttentionMap]:
    """The chosen layers of the self-attention over the text (the first stack that ran)."""
    stack = recorded.maps[0].stack
    text_maps = [m for m in recorded.maps if m.stack == stack and m.call == 0]
    count = len(text_maps)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not -count <= layer < count:
            raise ValueError(f"layers: expected ints in [-{count}, {count}), got {list(layers)!r}")
    return [text_maps[i] for i in dict.fromkeys(layer % count for layer in layers)]


def _attention_section(plots, recorded: _TextRun, *, layers, heads) -> str:
    chosen = _text_maps(recorded, layers)
    num_heads = chosen[0].weights.shape[1]
    head_index = list(range(num_heads)) if heads is None else list(heads)
    if not head_index or any(not 0 <= h < num_heads for h in head_index):
        raise ValueError(f"heads: expected head indices in [0, {num_heads}), got {heads!r}")
    parts = [
        f"<p>Tokens: <code>{html.escape(' '.join(recorded.tokens))}</code>. Each panel is one "
        "head: row i is query token i's softmax over the keys.</p>"
    ]
    data = {"tokens": recorded.tokens, "maps": []}
    for attention in chosen:
        weights = attention.weights[0, head_index]  # (h, L, L)
        fig = plots.attention_heatmaps(
            weights, tokens=recorded.tokens, title=f"{attention.name}", max_columns=6
        )
        caption = f"{attention.name}: heads {head_index}"
        parts.append(figure(fig, figure_id=f"fig-attention-{attention.name}", caption=caption))
        rounded = [[[round(w, 6) for w in row] for row in head] for head in weights.tolist()]
        data["maps"].append({"name": attention.name, "heads": head_index, "weights": rounded})
    parts.append(json_script("qkv-attention-data", data))
    return "\n".join(parts)


def _viewer_section(recorded: _TextRun, *, title: str) -> str:
    if recorded.start_tokens is None:
        page = attention_view_html(recorded.maps, recorded.tokens, title=title)
    else:
        page = attention_view_html(
            recorded.maps, recorded.start_tokens, recorded.tokens, title=title
        )
    rows = max(len(recorded.tokens), len(recorded.start_tokens or ()))
    height = VIEWER_HEIGHT + VIEWER_ROW_HEIGHT * rows  # the viewer draws one token per row
    return (
        "<p>Every layer and head, as in <code>qkv viz</code>: pick a layer and a head, hover a "
        "token to keep its row.</p>\n"
        f'<iframe title="attention viewer" sandbox="allow-scripts" style="height: {height}px" '
        f'srcdoc="{html.escape(page, quote=True)}"></iframe>'
    )


def _heads_section(model: nn.Module, recorded: _TextRun) -> str:
    """The input/output cosine similarity per attention module, and, for a model that
    predicts the next token, head importance on the text (Michel et al. 2019, section 4.1)."""

    similarity = position_cosine_similarity(
        model, recorded.input_ids, **recorded.forward_kwargs
    )  # {name: (1, L)}
    rows = [(name, *(f"{float(f(v)):.3f}" for f in (torch.mean, torch.min, torch.max)))
            for name, v in similarity.items()]  # fmt: skip
    parts = [
        "<p>Cosine similarity between each attention module's input and output, per position "
        "(low means attention does substantial work, high that its output stays close to its "
        "input).</p>",
        table(rows, header=("attention", "mean", "min", "max"), row_headers=False),
    ]
    if not isinstance(model, GPT) or recorded.input_ids.shape[1] < 2:
        parts.append(
            '<p class="note">Head importance (Michel et al. 2019) needs a loss: it is drawn for '
            "models that predict the next token (GPT), on the text. For this model, call "
            "<code>qkv.analysis.inspection.heads.head_importance</code> with a task loss.</p>"
        )
        return "\n".join(parts)

    def next_token_loss(gated: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        logits = gated(input_ids).logits[0]  # (L, V)
        return nn.functional.cross_entropy(logits[:-1], input_ids[0, 1:])

    scores = head_importance(model, [recorded.input_ids], next_token_loss)  # {name: (H,)}
    parts.append(_importance_figure(scores))
    parts.append(json_script("qkv-head-importance", {
        "names": list(scores), "importance": [v.tolist() for v in scores.values()],
    }))  # fmt: skip
    return "\n".join(parts)


def _importance_figure(scores: dict[str, torch.Tensor]) -> str:
    from qkv.analysis.plots.common import draw_heatmap, new_figure

    matrix = torch.stack([score.double().cpu() for score in scores.values()])  # (layers, H)
    layers, heads = matrix.shape
    fig = new_figure(figsize=(max(5.0, 2.5 + 0.6 * heads), max(2.5, 1.5 + 0.45 * layers)))
    ax = fig.subplots()
    image = draw_heatmap(
        ax, matrix.numpy(), title="|dL/d xi_h|, normalised per layer",
        query_labels=list(scores), key_labels=[str(h) for h in range(heads)],
        cmap="viridis",
    )  # fmt: skip
    ax.set_xlabel("head")
    ax.set_ylabel("attention module")
    fig.colorbar(image, ax=ax)
    caption = "Head importance on the text: next-token loss (Michel et al. 2019, section 4.1)"
    return figure(fig, figure_id="fig-heads-importance", caption=caption)


def _model_section(model: nn.Module, model_name: str) -> str:
    parameters = list(model.parameters())
    rows = [
        ("model", model_name),
        ("class", type(model).__name__),
        ("parameters (PyTorch's count)", f"{sum(p.numel() for p in parameters):,}"),
        ("dtype / device", f"{parameters[0].dtype} / {parameters[0].device}"),
    ]
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config):
        rows += [(f"config.{key}", repr(value)) for key, value in vars(config).items()]
    return table(rows)


def _cost_report(model: nn.Module):
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return cost_report(model, dtype=dtype)


def _cost_section(model: nn.Module, model_name: str) -> str:
    report = _cost_report(model)
    rows = cost_rows(report)
    return (
        f"<p>{html.escape(model_name)} at its full context of {report.context} tokens, batch "
        f"{report.batch}, {report.dtype} (as <code>qkv cost</code>; formulas only).</p>\n"
        + table(rows, header=("", report.name))
        + '\n<p class="note">FLOPs: 2 per multiply-add, matrix products only, dense L x L '
        "scores; training ~ 3 x forward (Kaplan et al. 2020). Scores: one head of one sample; "
        "one layer = all H heads x batch. KV cache: Pope et al. 2022.</p>"
    )


def _complexity_section(model: nn.Module, lengths: Sequence[int]) -> str:

    report = _cost_report(model)
    result = measure_complexity(
        lengths=lengths, heads=report.num_heads, head_dim=report.head_dim,
        causal=report.family == "decoder-only", repeats=1,
    )  # fmt: skip
    rows = [("backend", "L", "time (ms)", "ratio", "peak (MB)", "ratio", "L*L formula (MB)")]
    for point in result.points:
        measured = point.skipped is None
        rows.append((
            point.backend, str(point.length),
            f"{point.seconds * 1e3:.2f}" if measured else point.skipped,
            _ratio(point.time_ratio),
            f"{point.peak_bytes / 1e6:.2f}" if measured else "",
            _ratio(point.memory_ratio), f"{point.score_bytes / 1e6:.2f}",
        ))  # fmt: skip
    fits = ", ".join(
        f"{fit.backend} time L^{_exponent(fit.time_exponent)}, memory "
        f"L^{_exponent(fit.memory_exponent)}"
        for fit in result.fits
    )
    plot = figure(
        plot_complexity(result), figure_id="fig-complexity", caption="Time and memory against L"
    )
    return (
        f"<p>Self-attention at this model's shape ({report.num_heads} heads of {report.head_dim})"
        f", one repeat: a glimpse, not a measurement (<code>qkv bench complexity</code> measures)."
        f" Each doubling of L costs about 4x for O(L^2).</p>\n"
        + table(rows[1:], header=rows[0], row_headers=False)
        + f"\n<p>Fitted over L &gt;= {result.fit_from}: {html.escape(fits)}.</p>\n"
        + plot
    )


def _figures_section(plots) -> str:
    parts = [
        "<p>The classic figures of the papers: softmax saturation and the sqrt(d_k) scaling, "
        "masks, positional encodings, GELU vs ReLU. They do not depend on the model.</p>"
    ]
    for name, (caption, arguments) in CLASSIC_FIGURES.items():
        fig = getattr(plots, name)(**arguments())
        parts.append(figure(fig, figure_id=f"fig-figures-{name}", caption=caption))
    return "\n".join(parts)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}x"


def _exponent(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"
