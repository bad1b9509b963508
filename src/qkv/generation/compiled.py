"""`qkv.generate(..., compile=True)`: decoding steps through the model's forward compiled by
torch.compile, one graph for every step, with its guards trusted once two steps checked them.

See generate.py's module doc for what compiling buys and costs, and qkv.layers.packed for
what the products of one row compile to.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["CompiledSteps", "compiled_steps", "mark_cache_dynamic"]

# One compiled forward per model, each compiled from its own copy of the class's forward code:
# torch.compile keeps graphs and guards on a code object, so a model never runs a graph that
# another model's calls compiled (which CompiledSteps, trusting guards, could otherwise pick).
# Weak keys: a model dropped by its user takes its compiled forward with it.
_COMPILED_FORWARDS: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()

# -ffp-contract=fast: a product and the running sum it feeds compile to one fused multiply-add
# (one rounding instead of two) rather than two vector instructions. A one-row product's
# reduction (qkv.layers.packed) then keeps up with the memory: over a (32000, 512) bf16 weight
# on the dev VM, 42 GB/s where a .sum() read 43 (27 without); whole bf16 decoding calls 2-3%
# faster, fp32 unchanged (measured interleaved on the same weights).
# emulate_precision_casts: a cast to bf16 rounds, as it does eagerly, even where inductor keeps
# the value in fp32 (a bf16 row converted once for the products, qkv.layers.packed); without
# it, x.to(bf16).float() may be compiled as x, and compiled decoding would compute with values
# eager decoding never sees.
_INDUCTOR_OPTIONS = {
    "cpp.enable_floating_point_contract_flag": "fast",
    "emulate_precision_casts": True,
}


def compiled_steps(model: nn.Module, sinks: tuple[int, int] | None = None) -> CompiledSteps:
    """What runs the decoding steps after the prefill with `compile=True`: the model's forward
    compiled with dynamic shapes (the key length grows every step) and no graph breaks
    (`fullgraph`: a break would fail loudly rather than decode slowly). Compiled at the first
    call for a model; later calls reuse its graphs. Its C++ kernels may fuse a product and a
    sum into one FMA (`_INDUCTOR_OPTIONS`)."""
    if sinks is not None:
        raise ValueError(
            "compile: not supported with sinks (a StreamingLLM cache re-rotates a window that "
            "moves every step); expected compile=False, or no sinks"
        )
    forward = _COMPILED_FORWARDS.get(model)
    if forward is None:
        forward = torch.compile(
            _own_copy(type(model).forward), dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS
        )
        _COMPILED_FORWARDS[model] = forward
    return CompiledSteps(functools.partial(forward, model))


def mark_cache_dynamic(cache) -> None:
    """Compile the steps for any batch size and cache length. Unmarked, torch.compile may take
    the sizes of the cache's keys and values as constants (it did for a cache of head_dim
    slots, unified with the head size) and compile again for a call with another
    max_new_tokens."""
    for tensor in cache.keys + cache.values:  # (B, H_kv, slots, D) each
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(tensor, 2)


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """The same function on a new code object (same bytecode, globals, defaults)."""
    copy = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__,
        function.__defaults__, function.__closure__,
    )  # fmt: skip
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy


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
    torch.compile refuses to recompile in that stance; that, or any other error of a step run
    so, runs the step again with every guard checked (compiling what it needs, or raising a
    genuine error), and the next one as well.
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
        except Exception:  # a refused recompilation, or a guard accessor that failed: a genuine
            pass  # error raises again below (a failed graph wrote only slots it rewrites)
        self.checked_steps = 1  # the step again, every guard checked; the next one as well
        return self.forward(*args, **kwargs)
