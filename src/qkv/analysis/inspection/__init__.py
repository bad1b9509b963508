"""Looking inside a model: exact attention maps from any backend, head importance and pruning
(Michel et al. 2019), the sanity checks of `qkv check`, and attention rollout (Abnar & Zuidema
2020) with its map over a Vision Transformer's patches."""

from qkv.analysis.inspection.rollout import HEAD_FUSIONS, attention_rollout, vit_rollout_map

__all__ = ["HEAD_FUSIONS", "attention_rollout", "vit_rollout_map"]
