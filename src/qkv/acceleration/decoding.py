"""`decoding_steps(model)`: what runs a decoder-only model's decoding steps fast, chosen here.

`qkv.generate(model, ids, steps=...)` calls its `steps` for every step after the prefill, as it
would call the model; by default it calls the model, eager PyTorch. The steps returned here
compute the same tokens faster, at the one-time cost of compiling (benchmarks/decode.py):

    with qkv.acceleration.packed_linears(model):      # oneDNN products, fused projections
        tokens = qkv.generate(model, ids, max_new_tokens=128,
                              steps=qkv.acceleration.decoding_steps(model))

mode="aot" (the default): the step exported and compiled ahead of time by AOTInductor into a
    library whose C++ wrapper calls the kernels, no Python between them
    (qkv.acceleration.exported); kept on disk for later processes (compile_store).
mode="compiled": the model's forward compiled by torch.compile, its public API alone, every
    guard checked at every step (qkv.acceleration.compiled).
mode="eager": the model itself, with `fast_rope` swapped in around each step (`EagerSteps`):
    RoPE's tables made once a step instead of once a layer, its rotation in fewer ops, the
    model's outputs bit for bit; SmolLM2's quantized steps 12% faster (40.1 tok/s against
    35.8, Intel AVX-512, 2 threads).
mode="auto": the exported library where one is compiled already for the call's batch size and
    padding (in memory, or stored by an earlier process: a load of well under a second), else
    the eager steps: a call never waits tens of seconds for a compilation it did not ask for.
    Decided from what is on disk, never timed.

Each call goes to the fastest that serves it (`DecodingSteps`): the exported library for steps
over a StaticKVCache (unpadded, or left-padded: a library each), torch.compile's forward for
what the library cannot serve (a step that cannot be exported, such as the packed products of
several rows, which torch.compile calls as one opaque operator; eager in mode "auto"), the
eager steps for the first steps over a cache of fewer than 2 tokens, and the model itself for
a StreamingLLM cache (whose window is re-rotated every step). Where torch.compile cannot build
CPU kernels (no C++ compiler) every step is eager (logged once); off the CPU, the model's.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from qkv import capabilities
from qkv.acceleration.compiled import INDUCTOR_OPTIONS, CompiledForward
from qkv.acceleration.exported import ExportedStep, ready
from qkv.acceleration.fast_rotary import fast_rope
from qkv.layers.sink_cache import SinkKVCache

__all__ = ["MODES", "DecodingSteps", "EagerSteps", "compiled_ready", "decoding_steps"]

logger = logging.getLogger(__name__)

MODES = ("aot", "compiled", "eager", "auto")


def decoding_steps(model: nn.Module, mode: str = "aot") -> DecodingSteps | EagerSteps | nn.Module:
    """The steps for `qkv.generate(..., steps=)` in `mode` (one of MODES, see the module doc):
    a `DecodingSteps`; `EagerSteps` for "eager" and where nothing can be compiled; the model
    itself off the CPU."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type != "cpu":
        _log_once(f"decoding_steps: the model's own steps on {parameter.device.type}")
        return model
    if mode == "eager":
        return EagerSteps(model)
    support = capabilities.compiler()
    if not support:
        _log_once(f"decoding_steps: eager steps: {support.reason}")
        return EagerSteps(model)
    return DecodingSteps(model, mode)


def compiled_ready(model: nn.Module) -> bool:
    """Whether mode "auto" would take the AOT steps for `model` now: its library is in memory,
    or stored by an earlier process (then loaded in well under a second)."""
    return ready(model, INDUCTOR_OPTIONS)


class EagerSteps:
    """The model's own steps, with `fast_rope` in it for each call: called as the model is,
    returning what it returns, bit for bit. The swap is entered and left around every call (a
    walk over the model's modules), so that between steps, and after the decoding, the model is
    exactly the caller's."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, **kwargs):
        with fast_rope(self.model):
            return self.model(input_ids, **kwargs)


class DecodingSteps:
    """A model's steps in mode "aot", "compiled" or "auto", each call sent to the fastest path
    that serves it (see the module doc): called as the model is, returning its CausalLMOutput.
    The library is looked up at each decoding call, on the model as it then is (packed inside a
    `packed_linears` block, its library is another than the plain model's)."""

    def __init__(self, model: nn.Module, mode: str) -> None:
        self.model, self.mode, self.eager = model, mode, EagerSteps(model)
        # "auto": only a library already built serves; nothing is compiled
        compile_ = mode == "aot"
        self.exported = (
            None if mode == "compiled" else ExportedStep(model, INDUCTOR_OPTIONS, compile_)
        )
        self.compiled = None if mode == "auto" else CompiledForward(model)

    def __call__(self, input_ids: torch.Tensor, **kwargs):
        cache = kwargs.get("cache")
        if isinstance(cache, SinkKVCache):
            return self.model(input_ids, **kwargs)
        if self.exported is not None:
            output = self.exported.run(input_ids, kwargs)
            if output is not None:
                return output
        short = cache is not None and cache.length < 2  # torch.compile would specialise on it
        if self.compiled is None or short:
            return self.eager(input_ids, **kwargs)
        return self.compiled(input_ids, **kwargs)


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        logger.warning("%s", message)
        _LOGGED.add(message)


_LOGGED: set[str] = set()
