"""Looking inside a model: exact attention maps from any backend, head importance and pruning
(Michel et al. 2019), the sanity checks of `qkv check`, attention rollout (Abnar & Zuidema
2020) with its map over a Vision Transformer's patches, sink heads (Xiao et al. 2024),
previous-token, duplicate-token and induction heads (Olsson et al. 2022), and the named
activation points of GPT, BERT, ViT, the encoder-decoder and T5, read or patched (Meng et al.
2022), with a GPT's read out by the logit lens (nostalgebraist 2020)."""

from qkv.analysis.inspection.attribution import (
    AttentionAttribution,
    LogitAttribution,
    attention_vs_attribution,
    direct_logit_attribution,
    spearman,
)
from qkv.analysis.inspection.hooks import (
    ActivationCache,
    activation_names,
    hooks,
    logit_lens,
    run_with_cache,
)
from qkv.analysis.inspection.patching import PatchSweep, ablate_heads, patch_sweep
from qkv.analysis.inspection.rollout import HEAD_FUSIONS, attention_rollout, vit_rollout_map
from qkv.analysis.inspection.sinks import attention_masses, sink_heads, uniform_mass

__all__ = [
    "HEAD_FUSIONS",
    "ActivationCache",
    "AttentionAttribution",
    "LogitAttribution",
    "PatchSweep",
    "ablate_heads",
    "activation_names",
    "attention_vs_attribution",
    "attention_masses",
    "attention_rollout",
    "direct_logit_attribution",
    "hooks",
    "logit_lens",
    "patch_sweep",
    "run_with_cache",
    "sink_heads",
    "spearman",
    "uniform_mass",
    "vit_rollout_map",
]
