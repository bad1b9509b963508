"""Looking inside: sanity checks (`qkv check`), exact attention maps from any backend, attention
rollout through the layers (Abnar & Zuidema 2020), the cost planner (`qkv cost`), head
importance and pruning (Michel et al. 2019), the complexity benchmark (`qkv bench complexity`),
the attention viewer (`qkv viz`) and the report (`qkv report`). The classic figures (softmax
saturation, sqrt(d_k) scaling, positional encodings, masks, GELU) are in `qkv.analysis.plots`
(imported on its own: it needs matplotlib). The softmax Jacobian, softmax as written and
max-subtracted, and log-sum-exp are in `qkv.analysis.softmax_math`; attention and multi-head
attention in plain NumPy, forward and backward, in `qkv.analysis.numpy_lab`."""

from qkv.analysis.cost.complexity import measure_complexity
from qkv.analysis.cost.estimate import CostReport, cost_report
from qkv.analysis.inspection.attention_maps import (
    AttentionMap,
    AttentionRecording,
    attention_map,
    record_attention,
)
from qkv.analysis.inspection.heads import (
    HeadGates,
    PruningStep,
    head_gates,
    head_importance,
    position_cosine_similarity,
    prune_heads,
    pruning_curve,
)
from qkv.analysis.inspection.rollout import attention_rollout
from qkv.analysis.inspection.sanity import CheckResult, run_checks
from qkv.analysis.pages.viz import attention_view_html

__all__ = [
    "AttentionMap",
    "AttentionRecording",
    "CheckResult",
    "CostReport",
    "HeadGates",
    "PruningStep",
    "attention_map",
    "attention_rollout",
    "attention_view_html",
    "cost_report",
    "head_gates",
    "head_importance",
    "measure_complexity",
    "position_cosine_similarity",
    "prune_heads",
    "pruning_curve",
    "record_attention",
    "run_checks",
]
