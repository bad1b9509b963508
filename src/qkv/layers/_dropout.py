"""`make_dropout`: a layer's dropout (Srivastava et al. 2014), or the identity where p == 0."""

from __future__ import annotations

from torch import nn


def make_dropout(p: float) -> nn.Module:
    """nn.Dropout(p), or nn.Identity() when p == 0 (p checked by nn.Dropout otherwise).

    Inverted dropout (Srivastava et al. 2014; Vaswani et al. 2017 s5.4): in training each
    element is zeroed with probability p and the others are scaled by 1 / (1 - p).

    Dropout with p = 0 is the identity in train and eval mode alike, yet a dropout module still
    costs a module call and a dispatch on every forward: a few microseconds, paid about 17
    times per decoded token by an 8-layer GPT. Neither module has parameters or buffers, so
    state dicts and checkpoint key maps are the same either way.
    """
    return nn.Identity() if p == 0 else nn.Dropout(p)
