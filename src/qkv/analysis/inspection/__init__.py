"""Looking inside a model: exact attention maps from any backend, head importance and pruning
(Michel et al. 2019), the sanity checks of `qkv check`, attention rollout (Abnar & Zuidema
2020) with its map over a Vision Transformer's patches, and sink heads (Xiao et al. 2024)."""

from qkv.analysis.inspection.rollout import HEAD_FUSIONS, attention_rollout, vit_rollout_map
from qkv.analysis.inspection.sinks import attention_masses, sink_heads, uniform_mass

__all__ = [
    "HEAD_FUSIONS",
    "attention_masses",
    "attention_rollout",
    "sink_heads",
    "uniform_mass",
    "vit_rollout_map",
]
