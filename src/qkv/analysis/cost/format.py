"""`CostReport`s as text tables: one column per model, or one row per preset.

Bytes are shown in binary units (KiB, MiB, GiB, TiB: powers of 1024), so Llama-2-70B's cache
reads "1.25 GiB"; counts and FLOPs in decimal units (M, B; GFLOP, TFLOP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qkv.analysis.cost.estimate import CostReport

__all__ = [
    "format_bytes",
    "format_count",
    "format_flops",
    "format_presets",
    "format_report",
    "report_rows",
    "text_table",
]


def format_bytes(value: int | None) -> str:
    """1342177280 -> "1.25 GiB"; None -> "-"."""
    if value is None:
        return "-"
    for unit, power in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 2**power:
            return f"{value / 2**power:.3g} {unit}"
    return f"{value} B"


def format_count(value: int) -> str:
    """124439808 -> "124.4M"; 6738415616 -> "6.74B"."""
    for unit, power in (("T", 12), ("B", 9), ("M", 6), ("K", 3)):
        if value >= 10**power:
            return f"{value / 10**power:.4g}{unit}"
    return str(value)


def format_flops(value: float | None) -> str:
    """2.9e12 -> "2.9 TFLOP"; None -> "-"."""
    if value is None:
        return "-"
    for unit, power in (("PFLOP", 15), ("TFLOP", 12), ("GFLOP", 9), ("MFLOP", 6), ("KFLOP", 3)):
        if value >= 10**power:
            return f"{value / 10**power:.3g} {unit}"
    return f"{value:.3g} FLOP"


def _layers(report: CostReport) -> str:
    if report.num_encoder_layers and report.num_decoder_layers:
        return f"{report.num_encoder_layers}+{report.num_decoder_layers}"
    return str(report.num_encoder_layers or report.num_decoder_layers)


def _heads(report: CostReport) -> str:
    return f"{report.num_heads}/{report.num_kv_heads}"


def _crossover(report: CostReport) -> str:
    """24704.0 -> "L = 24,704 (6.03 E)"."""
    length = report.attention_crossover_length
    if length is None:
        return "-"
    return f"L = {length:,.0f} ({length / report.embed_dim:.3g} E)"


def report_rows(report: CostReport) -> list[tuple[str, str]]:
    """(label, value) of every line of one model's column."""
    rows = [
        ("family", report.family),
        ("layers", _layers(report)),
        ("E / heads H/H_kv / D", f"{report.embed_dim} / {_heads(report)} / {report.head_dim}"),
        ("ffn / vocab", f"{report.ffn_dim} / {report.vocab_size or '-'}"),
        ("parameters", f"{report.parameters:,} ({format_count(report.parameters)})"),
        ("  of which embeddings", format_count(report.embedding_parameters)),
        (f"weights ({report.dtype})", format_bytes(report.weight_bytes)),
        ("context x batch", f"{report.context} x {report.batch}"),
        ("forward FLOPs / token", format_flops(report.flops_per_token)),
        ("forward FLOPs / sequence", format_flops(report.flops_per_sequence)),
        ("  one attention layer", format_flops(report.attention_flops_per_layer)),
        ("  scores = rest of block at", _crossover(report)),
        ("training FLOPs / batch", format_flops(report.training_flops)),
        ("decode step FLOPs", format_flops(report.decode_flops_per_token)),
        ("KV cache / sample", format_bytes(report.kv_cache_bytes_per_sample)),
        ("KV cache / batch", format_bytes(report.kv_cache_bytes)),
    ]
    if report.num_classes is not None:
        rows.insert(4, ("classes", str(report.num_classes)))
    for variant in report.kv_cache_variants:
        mark = " (model)" if variant.is_model else ""
        value = f"{format_bytes(variant.bytes_per_sample)} H_kv={variant.num_kv_heads}{mark}"
        rows.append((f"  as {variant.name}", value))
    cross = report.cross_attention_cache_bytes_per_sample
    if cross is not None:
        rows.append(("cross-attn cache / sample", format_bytes(cross)))
    lengths = [("context", report.score_matrix_at_context)]
    lengths += [(f"{s.length // 1024}K", s) for s in report.score_matrix]
    for title, scores in lengths:
        rows.append((f"scores at {title}: head", format_bytes(scores.per_head_bytes)))
        rows.append((f"scores at {title}: layer", format_bytes(scores.per_layer_bytes)))
    return rows


def format_report(reports: Sequence[CostReport]) -> str:
    """A table with one column per report. Rows that exist only for some models (a KV-cache
    variant) show "-" elsewhere; "(model)" marks the model's own number of K/V heads."""
    columns = [dict(report_rows(report)) for report in reports]
    labels: list[str] = []
    for column in columns:  # a label missing so far goes right after its predecessor
        position = 0
        for label in column:
            if label not in labels:
                labels.insert(position, label)
            position = labels.index(label) + 1
    header = ["", *(report.name for report in reports)]
    body = [[label, *(column.get(label, "-") for column in columns)] for label in labels]
    notes = (
        "FLOPs: 2 per multiply-add, matrix products only, dense L x L scores; training ~ 3 x "
        "forward. Scores: one head of one sample; one layer = all H heads x batch."
    )
    return text_table([header, *body]) + "\n" + notes


_PRESET_COLUMNS: tuple[tuple[str, Callable[[CostReport], str]], ...] = (
    ("preset", lambda r: r.name),
    ("family", lambda r: r.family),
    ("parameters", lambda r: format_count(r.parameters)),
    ("layers", _layers),
    ("E", lambda r: str(r.embed_dim)),
    ("H/H_kv", _heads),
    ("context", lambda r: str(r.context)),
    ("weights", lambda r: format_bytes(r.weight_bytes)),
    ("FLOPs/token", lambda r: format_flops(r.flops_per_token)),
    ("KV cache/sample", lambda r: format_bytes(r.kv_cache_bytes_per_sample)),
)


def format_presets(reports: Sequence[CostReport]) -> str:
    """One row per report (each at its own context): the overview `qkv cost` prints."""
    header = [title for title, _ in _PRESET_COLUMNS]
    rows = [[cell(report) for _, cell in _PRESET_COLUMNS] for report in reports]
    dtype = reports[0].dtype if reports else "fp16"
    return text_table([header, *rows]) + f"\nweights, FLOPs and KV cache at each context, {dtype}"


def text_table(rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
