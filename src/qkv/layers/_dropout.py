"""`make_dropout`: the dropout module of a layer, or the identity when its probability is 0."""

from __future__ import annotations

from torch import nn


def make_dropout(p: float) -> nn.Module:
    """nn.Dropout(p), or nn.Identity() when p == 0 (checked by nn.Dropout as before otherwise).

    Dropout with p = 0 is the identity in train and eval mode alike, yet nn.Dropout still costs
    a module call and a dispatch through F.dropout on every forward: a few microseconds, paid
    about 17 times per decoded token by an 8-layer GPT. Neither module has parameters or
    buffers, so state dicts and checkpoint key maps are the same either way.
    """
    return nn.Identity() if p == 0 else nn.Dropout(p)
