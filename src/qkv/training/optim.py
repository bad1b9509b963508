"""AdamW with weight decay on the weight matrices only.

Decoupled weight decay (Loshchilov & Hutter 2019) shrinks weights towards 0. On a norm's gain
that fights the normalisation itself (it pulls the gain, not the activations' scale), and on a
bias it has no regularising effect worth the bias it adds, so BERT and GPT-2 exclude both
(Devlin et al. 2019's optimizer; `no_decay = ["bias", "LayerNorm.weight"]` in Hugging Face's
examples). A list of names misses any norm it does not name (BatchNorm, GroupNorm, a model's
own norm class) and any bias called otherwise (a GRU's `bias_ih`), so qkv decides by shape and
module type, as nanoGPT's GPT-2 (Radford et al. 2019) recipe decays only matrices: a parameter
decays when it has at least two dimensions (linear and recurrent weight matrices, token and
position embeddings, learned tokens) and belongs to no norm module. Every vector (every bias,
every norm's gain and shift, other learned vectors) and every parameter of a norm (LayerNorm,
RMSNorm, BatchNorm, GroupNorm, InstanceNorm) is in the no-decay group. Tied parameters appear
once.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.layers import BatchNorm, LayerNorm, RMSNorm

__all__ = ["build_optimizer", "parameter_groups"]

# every parameter of these is kept from decay; any other vector is kept by its shape
_NORMS = (
    LayerNorm, RMSNorm, BatchNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d,
    nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)  # fmt: skip


def parameter_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two AdamW groups: [{"params": decayed, "weight_decay": weight_decay}, {"params":
    norms, biases and other vectors, "weight_decay": 0.0}]; each trainable parameter in
    exactly one. A parameter decays when it is at least 2-D and not a norm module's."""
    no_decay: set[int] = set()
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            if parameter.dim() < 2 or isinstance(module, _NORMS):
                no_decay.add(id(parameter))
    decayed, kept = [], []
    for parameter in model.parameters():  # each tied parameter once
        if parameter.requires_grad:
            (kept if id(parameter) in no_decay else decayed).append(parameter)
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": kept, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    *,
    learning_rate: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over `parameter_groups(model)`."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate: expected a number > 0, got {learning_rate!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay: expected a number >= 0, got {weight_decay!r}")
    groups = parameter_groups(model, weight_decay=weight_decay)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps)
