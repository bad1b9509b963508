"""`qkv.generate(..., compile=True)`: decoding steps through the model's forward compiled ahead
of time by torch.compile, one graph for every step, called directly once two steps checked it.

See generate.py's module doc for what compiling buys and costs, and qkv.acceleration.packing for
what the products of one row compile to.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from typing import Any

import torch
from torch import nn

from qkv import capabilities
from qkv.acceleration.compile_store import GraphStore, model_key, store_directory
from qkv.acceleration.flat_call import flat_call

__all__ = [
    "CompiledSteps",
    "GuardFreeUnavailableError",
    "GuardedSteps",
    "compiled_steps",
]

logger = logging.getLogger(__name__)

# A model's compiled forwards (torch.compile's AOTCompiledFunction: a graph, its guards, and the
# bytecode that gathers its inputs and replays the forward's side effects), by the model's key in
# the compile store (its form: packed or not, its dtype). Weak keys: a model dropped by its user
# takes its graphs with it.
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[str, list[Any]]] = weakref.WeakKeyDictionary()

# -ffp-contract=fast: a product and the running sum it feeds compile to one fused multiply-add
# (one rounding instead of two) rather than two vector instructions. A one-row product's
# reduction (qkv.acceleration.packing) then keeps up with the memory: it reads a bf16 weight
# about as fast as a .sum() over it does, where without the flag it is instruction-bound.
# emulate_precision_casts: a cast to bf16 rounds, as it does eagerly, even where inductor keeps
# the value in fp32 (a bf16 row converted once for the products, qkv.acceleration.packing); without
# it, x.to(bf16).float() may be compiled as x, and compiled decoding would compute with values
# eager decoding never sees.
_INDUCTOR_OPTIONS = {
    "cpp.enable_floating_point_contract_flag": "fast",
    "emulate_precision_casts": True,
}


def compiled_steps(
    model: nn.Module, sinks: tuple[int, int] | None = None, *, guarded: bool = False
) -> CompiledSteps | GuardedSteps | nn.Module:
    """What runs the decoding steps after the prefill with `compile=True` (see `CompiledSteps`)
    or `compile="guarded"` (`GuardedSteps`): the model's forward compiled with dynamic shapes
    (the key length grows every step) and no graph breaks (`fullgraph`: a break fails loudly
    rather than decode slowly). A model's graphs are kept for its later calls. Its C++ kernels
    may fuse a product and a sum into one FMA (`_INDUCTOR_OPTIONS`).

    Where torch.compile cannot build CPU kernels here (no C++ compiler: see
    `qkv.capabilities.compiler`), the steps run eagerly through `model` itself, with the same
    tokens, and a warning is logged once."""
    if sinks is not None:
        raise ValueError(
            "compile: not supported with sinks (a StreamingLLM cache re-rotates a window that "
            "moves every step); expected compile=False, or no sinks"
        )
    support = capabilities.compiler()
    if not support and _on_cpu(model):
        _warn_once(f"compile=True: decoding eagerly instead: {support.reason}")
        return model
    if guarded:
        return GuardedSteps(model)
    return CompiledSteps(model, _graphs_of(model), compile=compile_and_store)


def _graphs_of(model: nn.Module) -> list[Any]:
    """The graphs of the model in its present form: those compiled or loaded in this process,
    and, the first time the model is seen in this form, those stored for it."""
    key = model_key(model, _INDUCTOR_OPTIONS)
    by_key = _GRAPHS.setdefault(model, {})
    if key not in by_key:
        directory = store_directory()
        stored = [] if directory is None else GraphStore(directory).load(key, _globals(model))
        by_key[key] = stored
    return by_key[key]


def _globals(model: nn.Module) -> dict[str, Any]:
    return type(model).forward.__globals__


def compile_seconds(model: nn.Module) -> float | None:
    """What compiled steps would cost the model before their first step, in seconds: 0 with
    graphs in memory, else the compile store's estimate (`GraphStore.seconds`: a load, or the
    compilation measured for this model here), or None where nothing is known."""
    key = model_key(model, _INDUCTOR_OPTIONS)
    if _GRAPHS.get(model, {}).get(key):
        return 0.0
    directory = store_directory()
    if directory is None:
        return None
    return GraphStore(directory).seconds(key)


def compile_and_store(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """`compile_forward`, the graph then written to the compile store (if one is configured),
    for later processes to load instead of compiling."""
    started = time.perf_counter()
    graph = compile_forward(model, args, kwargs)
    seconds = time.perf_counter() - started
    directory = store_directory()
    if directory is not None:
        GraphStore(directory).save(model_key(model, _INDUCTOR_OPTIONS), graph, seconds)
    return graph


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        logger.warning("%s", message)
        _WARNED.append(message)


_WARNED: list[str] = []  # each fallback's warning is logged once per process


def _on_cpu(model: nn.Module) -> bool:
    parameter = next(model.parameters(), None)
    return parameter is None or parameter.device.type == "cpu"


def compile_forward(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The model's forward compiled ahead of time for calls like `model(*args, **kwargs)`
    (`torch.compile(...).aot_compile`, experimental in torch 2.13): the graph, its guards, and
    `fn`, the forward's bytecode rewritten to call the graph, which runs without any guard.

    Python floats (an eps, a RoPE base) are compiled as constants, guarded like any attribute:
    with dynamic shapes torch.compile otherwise turns them into graph inputs, then retraces
    when one of them cannot be one, which aot_compile does not do (it raises).

    Sizes are not duck-typed: two sizes equal in the first call (a cache of head_dim slots,
    say) stay two symbols, rather than one that a later call with other sizes fails and
    compiles again. That, not `torch._dynamo.mark_dynamic` on the cache, keeps one graph for
    every cache length: a marked tensor's guards do not survive the graph's serialization
    (qkv.acceleration.compile_store), and a stored graph would fail them in every process."""
    if torch._inductor.config.force_disable_caches:
        raise RuntimeError(
            "compile=True: torch._inductor.config.force_disable_caches is set, and the ahead-of-"
            "time compilation behind compile=True needs torch.compile's caches; expected it "
            "unset (for a cold compile, point TORCHINDUCTOR_CACHE_DIR at an empty directory)"
        )
    forward = torch.compile(
        type(model).forward, dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS
    )
    if not hasattr(forward, "aot_compile"):
        raise GuardFreeUnavailableError(
            f"torch {torch.__version__} has no torch.compile(...).aot_compile"
        )
    with (
        torch._dynamo.config.patch(specialize_float=True),
        torch.fx.experimental._config.patch(use_duck_shape=False),
    ):
        graph = forward.aot_compile(((model, *args), kwargs))
    missing = [name for name in ("fn", "guard_check") if not hasattr(graph, name)]
    if missing:
        raise GuardFreeUnavailableError(f"aot_compile's result has no {' or '.join(missing)}")
    return graph


def _rewritten_forward(graph):
    return lambda model, args, kwargs: graph.fn(model, *args, **kwargs)


class GuardFreeUnavailableError(RuntimeError):
    """This torch lacks what `CompiledSteps` calls beyond torch.compile's public API."""


class CompiledSteps:
    """The compiled forward for the steps of one decoding call, called without guards once two
    consecutive steps passed every guard of the same graph.

    A graph's guards check what it was compiled for: every module attribute, parameter and
    shape it read (about 1700 for the Llama of benchmarks/decode.py), a large share of a
    memory-bound decoding step; torch.compile's own call adds more (its frame hook, the guards
    on tensors that even `skip_guard_eval_unsafe` keeps). Within one call, the steps differ
    only by the token ids, positions (same shapes), the key mask and the cache length, which
    grow by one; a graph compiled for dynamic shapes guards on them only through range checks
    that the cache, sized for the whole call, satisfies (e.g. length + 1 <= max_length). So
    each step checks every guard of the model's graphs, compiling one that fits when none
    does, until two consecutive steps (two cache lengths: a graph specialised on a length of 1
    fails at the second) passed the same graph; every later step calls that graph's `fn`
    directly, which makes a step measurably faster than torch.compile with
    `skip_guard_eval_unsafe` (benchmarks/decode.py). Those steps go through a
    `qkv.acceleration.flat_call.FlatCall`: the first two are recorded, the third checks the
    plan made from them, and from the fourth on the graph is called with its inputs gathered
    by that plan rather than by the rewritten forward's walk of the module tree.
    A step that raises there runs again with every guard checked (compiling what it needs, or
    raising a genuine error; a failed graph wrote only cache slots the rerun writes again), and
    so does the next one.

    Guards on module globals are not kept (aot_compile drops them: an attention backend
    registered, or an environment variable changed, after a model's first compiled call does
    not reach its graphs). Changing the model while iterating `decode_steps` is not supported
    (nor is it in eager decoding: the cache holds keys computed with the old weights).
    """

    def __init__(self, model: nn.Module, graphs: list, compile=compile_forward) -> None:
        self.model = model
        self.graphs = graphs  # the model's, shared with its other calls
        self.compile = compile
        self.checked_graph = None  # the graph the last checked step ran
        self.checked_steps = 0  # how many consecutive checked steps ran it
        self.trusted = None  # the graph later steps run without guards
        self.direct = None  # how they run it: a FlatCall, or its rewritten forward
        self.fallback: GuardedSteps | None = None  # where the guard-free path is unavailable

    def __call__(self, *args, **kwargs):
        if self.fallback is not None:
            return self.fallback(*args, **kwargs)
        if self.trusted is not None:
            try:
                return self.direct(self.model, args, kwargs)
            except Exception:  # a genuine error raises again below, with guards checked
                self.trusted, self.direct, self.checked_steps = None, None, 0
        try:
            graph = self._graph_for(args, kwargs)
        except GuardFreeUnavailableError as error:  # a torch whose private API moved: stay public
            _warn_once(f"compile=True: every step checks its guards ({error})")
            self.fallback = GuardedSteps(self.model)
            return self.fallback(*args, **kwargs)
        same = graph is self.checked_graph
        self.checked_graph, self.checked_steps = graph, self.checked_steps + 1 if same else 1
        if self.checked_steps == 2:
            self.trusted, self.direct = graph, flat_call(graph) or _rewritten_forward(graph)
        return graph.fn(self.model, *args, **kwargs)

    def _graph_for(self, args: tuple, kwargs: dict):
        """The first of the model's graphs whose every guard passes, or a new one."""
        for graph in self.graphs:
            if graph.guard_check(self.model, *args, **kwargs):
                return graph
        graph = self.compile(self.model, args, kwargs)
        self.graphs.append(graph)
        return graph


class GuardedSteps:
    """The model's forward compiled by `torch.compile` alone (public API), every guard checked
    at every step: what `compile="guarded"` runs, and what `compile=True` falls back to where
    this torch lacks the ahead-of-time compilation `CompiledSteps` calls. One compiled
    function per model, compiled from its own copy of the forward's code: torch.compile keeps
    graphs on a code object, and models sharing one would share its recompilation limit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        if model not in _GUARDED:
            forward = _own_copy(type(model).forward)
            _GUARDED[model] = torch.compile(
                forward, dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS
            )
        self.forward = _GUARDED[model]

    def __call__(self, *args, **kwargs):
        return self.forward(self.model, *args, **kwargs)


_GUARDED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """The same function on a new code object (same bytecode, globals, defaults, closure)."""
    copy = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__,
        function.__defaults__, function.__closure__,
    )  # fmt: skip
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy
