"""Look inside qkv's Transformers: named activation points, read or edited, and the logit lens.

    from qkv import inspect
    output, cache = inspect.run_with_cache(model, input_ids, names="blocks.*.resid_post")
    cache["blocks.3.resid_post"]                       # (B, L, E)
    with inspect.hooks(model, {"blocks.2.attn.head_out": ablate_head_5}):
        logits = model(input_ids).logits               # head 5 of layer 2 zeroed
    lens = inspect.logit_lens(model, input_ids, top_k=5)   # (N, B, L, 5) token ids

The points exist for `GPT`, `BertModel` (and the BERT heads), `ViT`, the encoder-decoder
`Transformer` and `T5Transformer` ("encoder.blocks.{i}.…", "decoder.blocks.{i}.cross_attn.…");
the logit lens reads a GPT's lm_head or a BertForPreTraining's masked-LM head, the attribution
tools a GPT's lm_head; the points are checked against TransformerLens' on the same weights.
The points follow the residual stream of Elhage et al. 2021 ("A Mathematical Framework for
Transformer Circuits"); editing them is activation patching (Vig et al. 2020; Meng et al.
2022); the lens is nostalgebraist 2020 ("interpreting GPT: the logit lens"). The names, their
shapes and where each is taken are listed in `qkv.analysis.inspection.hooks`.
"""

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

__all__ = [
    "ActivationCache",
    "AttentionAttribution",
    "LogitAttribution",
    "PatchSweep",
    "ablate_heads",
    "activation_names",
    "attention_vs_attribution",
    "direct_logit_attribution",
    "hooks",
    "logit_lens",
    "patch_sweep",
    "run_with_cache",
    "spearman",
]
