"""A model's forward compiled by `torch.compile`, public API only: one graph for every decoding
step and cache length, every guard checked at every call.

`decoding_steps(model, "compiled")` runs every step through it, and `decoding_steps(model)` (the
step compiled ahead of time by AOTInductor, qkv.acceleration.exported) runs through it the calls
its library does not serve (a padding mask). Compiled with dynamic shapes (the key length grows
every step) and no graph breaks (`fullgraph`: a break fails loudly rather than decode slowly);
the norms, RoPE, casts and cache writes between the products fuse into a few C++ kernels
(qkv.acceleration.packing says what one-row products compile to).
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
import torch.fx.experimental._config
from torch import nn

from qkv.acceleration.exported import INDUCTOR_OPTIONS

__all__ = ["INDUCTOR_OPTIONS", "CompiledForward"]


class CompiledForward:
    """`model`'s forward through torch.compile, called as the model is. One compiled function
    per model, kept for its later calls, compiled from its own copy of the forward's code:
    torch.compile keeps graphs on a code object, and models sharing one would share its
    recompilation limit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        if model not in _COMPILED:
            forward = _own_copy(type(model).forward)
            _COMPILED[model] = torch.compile(
                forward, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS
            )
        self.forward = _COMPILED[model]

    def __call__(self, *args, **kwargs):
        # Sizes are not duck-typed: two sizes equal in the first call (a cache of head_dim
        # slots, say) stay two symbols, rather than one that a later call with other sizes
        # fails and compiles again. A private switch of torch.fx (checked with torch 2.13),
        # read when a graph is traced; the compiled graph is torch.compile's own. Set and reset
        # as an attribute: a few microseconds, against tens for its `patch` context manager.
        config = torch.fx.experimental._config
        duck = config.use_duck_shape
        config.use_duck_shape = False
        try:
            return self.forward(self.model, *args, **kwargs)
        finally:
            config.use_duck_shape = duck


_COMPILED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """The same function on a new code object (same bytecode, globals, defaults, closure)."""
    copy = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__,
        function.__defaults__, function.__closure__,
    )  # fmt: skip
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy
