"""`qkv.generate(..., compile=True)`: decoding steps through the model's forward compiled by
torch.compile, one graph for every step, with its guards trusted once two steps checked them.

See generate.py's module doc for what compiling buys and costs, and qkv.layers.packed for
what the products of one row compile to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["CompiledSteps", "compiled_steps"]

# One compiled forward per model class: torch.compile caches its graphs on the code object,
# guarded by the parameters' shapes and dtypes, so models of one config share them.
_COMPILED_FORWARDS: dict[type, Callable] = {}


def compiled_steps(model: nn.Module, sinks: tuple[int, int] | None = None) -> CompiledSteps:
    """What runs the decoding steps after the prefill with `compile=True`: the model's class's
    forward compiled with dynamic shapes (the key length grows every step) and no graph breaks
    (`fullgraph`: a break would fail loudly rather than decode slowly), bound to `model`."""
    if sinks is not None:
        raise ValueError(
            "compile: not supported with sinks (a StreamingLLM cache re-rotates a window that "
            "moves every step); expected compile=False, or no sinks"
        )
    cls = type(model)
    if cls not in _COMPILED_FORWARDS:
        _COMPILED_FORWARDS[cls] = torch.compile(cls.forward, dynamic=True, fullgraph=True)
    return CompiledSteps(functools.partial(_COMPILED_FORWARDS[cls], model))


class CompiledSteps:
    """The compiled forward for the steps of one decoding call, trusting its guards from the
    third step on.

    Before running a graph, torch.compile checks its guards: ~2000 of them for the 55M Llama of
    benchmarks/decode.py (every module attribute, parameter and shape it read), ~1 ms of a 5 ms
    step on the dev VM. Within one call, the steps differ only by the token ids, positions
    (same shapes), the key mask and the cache length, which grow by one; the graph compiled
    for dynamic shapes guards on them only through range checks that the cache, sized for the
    whole call, satisfies (e.g. length + 1 <= max_length). So the first two steps (lengths L and
    L + 1: a graph specialised on a length of 1 is left behind there) check every guard, and
    later steps run with `skip_guard_eval_unsafe`, which evaluates only the guards on tensors
    and those that told graphs apart before. Where one of those fails (a window outgrown, say),
    torch.compile refuses to recompile in that stance: the step is run again with every guard
    checked (compiling what it needs), and so is the next one.
    Changing the model while iterating `decode_steps` is not supported (nor is it in eager
    decoding: the cache holds keys computed with the old weights).
    """

    def __init__(self, forward: Callable) -> None:
        self.forward = forward
        self.checked_steps = 0  # consecutive steps run with every guard checked

    def __call__(self, *args, **kwargs):
        if self.checked_steps < 2:
            self.checked_steps += 1
            return self.forward(*args, **kwargs)
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.forward(*args, **kwargs)
        except RuntimeError as error:
            if "skip_guard_eval_unsafe" not in str(error):
                raise
        self.checked_steps = 1  # the step again, every guard checked; the next one as well
        return self.forward(*args, **kwargs)
