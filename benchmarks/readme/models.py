"""The section of benchmarks/models.py: whole models, qkv against transformers.

It explains why qkv is faster where it is, gives the range of qkv's best ratio over every row
against the target, a summary table of one cell per model, mode and dtype (the faster of the
plain and packed paths in bold) and a table of every row of `results/models.json`.
"""

from __future__ import annotations

from .format import dtype_name, dtype_rank, get, md_table, num, paired, pct, prose, span
from .machine import machine_table

# The default run, and the same run with PyTorch's kernels, oneDNN and MKL held to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2: the CPU kind
# without AVX-512).
MODELS_FILES = ("models", "models_avx2")

MODELS_TEXT = """\
Whole models, qkv against transformers with the same config, the same weights (qkv's
`save_pretrained`, loaded by transformers) and the same dtype; transformers runs with
`attn_implementation="sdpa"`, and bf16 is autocast over fp32 weights. The models: a BERT the
size of all-MiniLM-L6-v2 (B x L = 32 x 128, an attention mask of ones) and a ~50M-parameter
Llama-style GPT (grouped-query attention, 8 query heads over 4 K/V heads; B x L = 8 x 512, no
mask). Modes: forward (eval mode, no gradients) and a training step (forward, loss, backward,
AdamW step, zero_grad). "qkv" is the model as a user calls it. Forward rows also time qkv inside
`qkv.acceleration.packed_linears(model, batch_hint=B * L)`: every linear's weight reordered once
into oneDNN's blocked layout (a bf16 copy under autocast), q/k/v and gate/up fused into one product
each; "pack ms" is that one-time cost. Before timing, the outputs of both are compared (max abs
diff below). A ratio is qkv's tokens/s over transformers' (above 1: qkv is faster): the ratio of
the medians and, in brackets, the median of the per-round ratios. Target: at least 1.0 on every
row by the path a user gets by default (the "qkv" column).

Where qkv is faster, it runs other kernels or does less work:
- float32 products: every qkv projection is a `qkv.layers.Linear`, which runs CPU float32
  products (forward and backward) on oneDNN where a probe at the first product finds oneDNN
  faster than F.linear (MKL) on this machine, and F.linear elsewhere; bf16 products are oneDNN's
  in both libraries;
- training with dropout (BERT): PyTorch's CPU dropout draws its mask with `bernoulli_`;
  `qkv.attention.dropout` takes 16 random bits per element from 64-bit draws (keep probability
  on a 2^-16 grid, scaled by its exact inverse), and the `auto` backend runs CPU attention
  dropout on the `reference` backend, which uses it;
- the language-model loss: `qkv.models.losses.cross_entropy` writes its gradient into the saved
  log-probabilities, with no zero-filled (tokens, V) tensor for `nll_loss` and no `log_softmax`
  backward buffer;
- packed forward: oneDNN's GEMM on packed weights, fused where they read one input."""

AVX2_TEXT = """\
The same script with PyTorch's kernels, oneDNN and MKL held to AVX2 (`ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`), as on a CPU without AVX-512, fp32."""


def best_model_ratio(row: dict) -> float | None:
    found = [row.get("ratio"), row.get("packed_ratio")]
    found = [x for x in found if isinstance(x, int | float)]
    return max(found) if found else None


def _model_cell(row: dict | None) -> str:
    """'0.972 (0.952); packed **1.088** (1.089)': the faster path in bold."""
    if row is None:
        return "-"
    best = best_model_ratio(row)
    plain = paired(row.get("ratio"), row.get("paired_ratio"))
    if "packed_ratio" not in row:
        return f"**{plain}**" if row.get("ratio") == best else plain
    packed = paired(row.get("packed_ratio"), row.get("packed_paired_ratio"))
    if row.get("packed_ratio") == best:
        return f"{plain}; packed **{packed}**"
    return f"**{plain}**; packed {packed}"


def default_ratios(results: dict[str, dict]) -> list[float]:
    """The default path's ratio of every row of every models file."""
    rows = [r for stem in MODELS_FILES for r in results.get(stem, {}).get("rows", [])]
    return [r["ratio"] for r in rows if isinstance(r.get("ratio"), int | float)]


def models_section(results: dict[str, dict]) -> list[str]:
    lines: list[str] = []
    for stem in MODELS_FILES:
        if stem in results:
            lines += _file_section(stem, results[stem])
    return lines


def _file_section(stem: str, data: dict) -> list[str]:
    rows = data.get("rows", [])
    mode_order = {"forward": 0, "train": 1}
    rows = sorted(
        rows,
        key=lambda r: (
            str(r.get("model")),
            mode_order.get(r.get("mode"), 2),
            dtype_rank(r.get("dtype")),
        ),
    )
    if stem == "models":
        lines = ["## Models against transformers (`models.py`)", "", *prose(MODELS_TEXT)]
    else:
        lines = ["### The same, held to AVX2", "", *prose(AVX2_TEXT)]
    lines += ["", *machine_table([(stem, data)]), ""]
    default = [r["ratio"] for r in rows if isinstance(r.get("ratio"), int | float)]
    best = [best_model_ratio(r) for r in rows]
    best = [b for b in best if b is not None]
    rates = data.get("matmul_rate") or {}
    summary = []
    if default:
        verdict = "met" if min(default) >= 1.0 else "not met"
        summary.append(
            f"qkv as a user calls it: {span(default, '.3f', 'x')} transformers' tokens/s over "
            f"{len(default)} rows (target >= 1.0 on every row: {verdict}); the faster of it and "
            f"the packed path: {span(best, '.3f', 'x')}."
        )
    fractions = [
        get(r, "fraction_of_matmul", name) for r in rows for name in ("qkv", "transformers")
    ]
    fractions = [100 * x for x in fractions if isinstance(x, int | float)]
    if rates:
        summary.append(
            "Matmul rate: "
            + ", ".join(
                f"{dtype_name(d)} {num(r / 1e9, '.0f')} GFLOP/s"
                for d, r in sorted(rates.items(), key=lambda kv: dtype_rank(kv[0]))
            )
            + f"; unpacked, the two libraries reach {span(fractions, '.0f', '%')} of it."
        )
    lines += [*prose(" ".join(summary)), ""] if summary else []
    dtypes = sorted({r.get("dtype") for r in rows}, key=dtype_rank)
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r.get("model"), r.get("batch"), r.get("length"), r.get("mode")), {})
        groups[(r.get("model"), r.get("batch"), r.get("length"), r.get("mode"))][r.get("dtype")] = r
    lines += ["qkv tokens/s over transformers' (paired in brackets; the faster path in bold):", ""]
    lines += md_table(
        ["model", "B x L", "mode", *(dtype_name(d) for d in dtypes)],
        [
            [model, f"{batch} x {length}", mode, *(_model_cell(by.get(d)) for d in dtypes)]
            for (model, batch, length, mode), by in groups.items()
        ],
    )
    lines += ["", "Every row:", ""]
    header = [
        "model",
        "B x L",
        "mode",
        "dtype",
        "qkv tok/s",
        "transformers tok/s",
        "packed tok/s",
        "qkv / transformers",
        "packed / transformers",
        "pack ms",
        "qkv % of matmul",
        "transformers % of matmul",
        "packed % of matmul",
        "max abs diff",
    ]
    body = [
        [
            r.get("model"),
            f"{r.get('batch')} x {r.get('length')}",
            r.get("mode"),
            dtype_name(r.get("dtype")),
            num(get(r, "tokens_per_s", "qkv"), ",.0f"),
            num(get(r, "tokens_per_s", "transformers"), ",.0f"),
            num(get(r, "tokens_per_s", "qkv_packed"), ",.0f"),
            paired(r.get("ratio"), r.get("paired_ratio")),
            paired(r.get("packed_ratio"), r.get("packed_paired_ratio")),
            num(get(r, "packing", "ms"), ".0f"),
            pct(get(r, "fraction_of_matmul", "qkv")),
            pct(get(r, "fraction_of_matmul", "transformers")),
            pct(get(r, "fraction_of_matmul", "qkv_packed")),
            num(r.get("max_abs_diff"), ".2g"),
        ]
        for r in rows
    ]
    lines += md_table(header, body)
    skipped = data.get("skipped") or []
    lines += ["", *(f"Skipped: {s}" for s in skipped)] if skipped else []
    return lines
