"""Looking inside: sanity checks (`qkv check`), exact attention maps from any backend, the cost
planner (`qkv cost`), the complexity benchmark (`qkv bench complexity`), the attention viewer
(`qkv viz`). The seeds' plots are in `qkv.analysis.plots` (imported on its own: it needs
matplotlib)."""

from qkv.analysis.attention_maps import (
    AttentionMap,
    AttentionRecording,
    attention_map,
    record_attention,
)
from qkv.analysis.complexity import measure_complexity
from qkv.analysis.cost import CostReport, cost_report
from qkv.analysis.sanity import CheckResult, run_checks
from qkv.analysis.viz import attention_view_html

__all__ = [
    "AttentionMap",
    "AttentionRecording",
    "CheckResult",
    "CostReport",
    "attention_map",
    "attention_view_html",
    "cost_report",
    "measure_complexity",
    "record_attention",
    "run_checks",
]
