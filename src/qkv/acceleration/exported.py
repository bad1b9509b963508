"""The decoding step compiled ahead of time by AOTInductor: no Python between its kernels.

`torch.compile` (qkv.acceleration.compiled) runs inductor's kernels from a Python wrapper that
checks the size of every input, allocates and reinterprets buffers and calls each kernel, one
line at a time: on the 55M Llama of benchmarks/decode.py about a tenth of a bf16 step, and
more again to check its guards. Here the step is exported once (`torch.export`) and compiled
ahead of time by AOTInductor into a C++ library whose own wrapper makes those calls; the
model's weights are its constants, pointing at the model's own tensors (no copy: a weight
changed in place is seen by the next step).

    with qkv.acceleration.packed_linears(model):      # one-row products as streaming kernels
        steps = qkv.acceleration.decoding_steps(model)
        tokens = qkv.generate(model, prompt, max_new_tokens=128, steps=steps)

One library serves every prompt and cache length of a model at one batch size (the cache's
length and slot count are symbolic), with the same tokens as the model's forward compiled by
torch.compile: the same kernels. A left-padded batch's steps (a padding mask) have a library
of their own, whose mask is an input of symbolic length. It also returns each row's largest
logit and its index (`CausalLMOutput.top_logit`, `top_token`), which greedy decoding takes as
its check and its choice instead of reducing the logits again in Python between two steps.
It is compiled once per machine where the compile store is on (qkv.acceleration.compile_store:
`<key>/exported-b<B>-<ids dtype>-<positions dtype>.pt2`) and loaded by later processes: only
from a store no one else can write (`compile_store.untrusted`), and only where each constant the
library reads has the shape and dtype recorded in its metadata when it was built (a library
copied from another model would read out of bounds).

What the libraries do not serve (`_served`) runs elsewhere (qkv.acceleration.decoding routes
it): a call with another cache, or a mask other than a bool (B, cached + 1), a step over a
cache of fewer than 2 tokens (export treats sizes 0 and 1 as constants), and a model whose step
cannot be exported or compiled (an operator with no C++ kernel, such as the packed products of
several rows; logged).

Two things here are AOTInductor's, not public API, checked against torch 2.13: the library is
run through its loader's `boxed_run` (the list of inputs handed over as it is, which the public
call re-flattens at every step), and the cache's length reaches the library as the length of a
`carrier` tensor (or the padding mask's length), because an exported program's symbolic sizes
come only from its inputs' shapes.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.acceleration import inductor_constants
from qkv.acceleration.compile_store import make_folder, model_key, store_directory, untrusted
from qkv.acceleration.packing import PackedLinear
from qkv.layers.kv_cache import StaticKVCache
from qkv.models.outputs import CausalLMOutput
from qkv.models.safetensors_io import write_atomically

__all__ = ["INDUCTOR_OPTIONS", "ExportedStep", "ready"]

# -ffp-contract=fast: a product and the running sum it feeds compile to one fused multiply-add
# (one rounding instead of two) rather than two vector instructions. A one-row product's
# reduction (qkv.acceleration.packing) then keeps up with the memory: it reads a bf16 weight
# about as fast as a .sum() over it does, where without the flag it is instruction-bound.
# emulate_precision_casts: a cast to bf16 rounds, as it does eagerly, even where inductor keeps
# the value in fp32 (a bf16 row converted once for the products, qkv.acceleration.packing); without
# it, x.to(bf16).float() may be compiled as x, and compiled decoding would compute with values
# eager decoding never sees.
INDUCTOR_OPTIONS = {
    "cpp.enable_floating_point_contract_flag": "fast",
    "emulate_precision_casts": True,
}

logger = logging.getLogger(__name__)

# The library's metadata entry that records each constant's shape and dtype (`_Runner.refuses`).
CONSTANTS_METADATA = "qkv_constants"

# By model (weak: gone with it): the loaded libraries by (model key, batch size, dtypes of the
# token ids and positions), or the reason the model's step could not be exported.
_RUNNERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()


class ExportedStep:
    """The decoding steps of a model through its exported step (see the module doc). `run`
    takes a call as the model does (`input_ids (B, 1), position_ids=(B, 1), cache=...,
    attention_mask=None or (B, cached + 1) bool, logits_to_keep=1, check_ids=False`) and returns
    its CausalLMOutput (logits (B, 1, V) fp32, top_logit (B,), top_token (B,)), or None where no
    library serves it (nothing done then)."""

    def __init__(self, model: nn.Module, options: dict[str, Any], compile: bool = True) -> None:
        self.model, self.options = model, options
        self.compile = compile  # False: only libraries in memory or stored serve (never built)
        self.runners: dict[tuple, _Runner | None] = {}  # by (batch size, masked), pointed
        self.cache = None  # the decoding call (its cache) the runners were pointed for
        self.carrier: torch.Tensor | None = None  # its first `length` items carry the length

    def run(self, input_ids, kwargs: dict) -> CausalLMOutput | None:
        if not _served(input_ids, kwargs):
            return None
        cache = kwargs["cache"]
        if cache is not self.cache:  # a new call: the model's tensors may have been replaced
            self.cache, self.runners = cache, {}
        mask = kwargs.get("attention_mask")
        kind = (input_ids.shape[0], mask is not None)
        if kind not in self.runners:  # once per call: the weights do not change within it
            self.runners[kind] = self._runner(input_ids, kwargs)
        runner = self.runners[kind]
        if runner is None:
            return None
        cache.check_room(1)  # the library's own check would fail with less to say
        if mask is None:
            if self.carrier is None or self.carrier.numel() < cache.length:
                self.carrier = torch.empty(cache.max_length, device=input_ids.device)
            mask = self.carrier[: cache.length]
        inputs = [input_ids, kwargs["position_ids"], mask]
        logits, top, argmax = runner.loader.boxed_run([*inputs, *cache.keys, *cache.values])
        cache.advance(1)
        return CausalLMOutput(logits=logits.unsqueeze(1), top_logit=top, top_token=argmax)

    def _runner(self, input_ids: torch.Tensor, kwargs: dict):
        """The model's library for this batch size (and padding): in memory, loaded from the
        store, or compiled now (where `self.compile`); None where there is none, or the step
        cannot be exported here (the reason is logged once)."""
        ids, positions = input_ids.dtype, kwargs["position_ids"].dtype
        masked = kwargs.get("attention_mask") is not None
        kv = kwargs["cache"].keys[0].dtype  # a library per cache dtype other than the model's
        kv = None if kv == next(self.model.parameters()).dtype else kv
        key = (model_key(self.model, self.options), input_ids.shape[0], ids, positions, masked, kv)
        runners = _RUNNERS.setdefault(self.model, {})
        if key not in runners:
            found = _load_or_compile(self.model, key, self.options, input_ids, kwargs, self.compile)
            if found is None:  # none built, and none to be built now
                return None
            runners[key] = found
        runner = runners[key]
        if isinstance(runner, str):
            return None
        runner.point_at(self.model)
        return runner


def ready(model: nn.Module, options: dict[str, Any]) -> bool:
    """Whether the model's unpadded step is compiled already: a library in memory, or one
    stored that a later call would load (well under a second) rather than compile (tens of
    seconds). A padded batch's library alone does not count, nor one for a cache of another
    dtype than the model's (`kv_dtype`)."""
    key = model_key(model, options)
    loaded = _RUNNERS.get(model, {})
    if any(k[0] == key and not k[4] and k[5] is None and not isinstance(r, str)
           for k, r in loaded.items()):  # fmt: skip
        return True
    directory = store_directory()
    stored = [] if directory is None else (directory / key).glob("exported-*.pt2")
    return any("-masked" not in path.stem and "-kv-" not in path.stem for path in stored)


def _served(input_ids: torch.Tensor, kwargs: dict) -> bool:
    """Whether a call is one the exported steps compute: one new token per row over a
    StaticKVCache of at least 2 tokens, unpadded or with a bool padding mask over the cache and
    the new token, its last logits only, ids not checked."""
    cache, mask = kwargs.get("cache"), kwargs.get("attention_mask")
    return (
        type(cache) is StaticKVCache
        and cache.length >= 2
        and (mask is None or _step_mask(mask, input_ids.shape[0], cache.length + 1))
        and kwargs.get("position_ids") is not None
        and kwargs.get("logits_to_keep") == 1
        and kwargs.get("check_ids") is False
        and input_ids.dim() == 2
        and input_ids.shape[1] == 1
        and set(kwargs) <= _STEP_ARGUMENTS
    )


_STEP_ARGUMENTS = {"cache", "attention_mask", "position_ids", "logits_to_keep", "check_ids"}


def _step_mask(mask: object, B: int, L: int) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == (B, L)


class _Step(nn.Module):
    """What is exported: the model's step over a cache given as tensors: its last logits in
    fp32, with each row's largest logit and its index (all a greedy loop reads of them). The
    products that `packed_linears` holds outside the module tree are registered here, so that
    their weights are named constants, like every other parameter.

    `carrier`: the padding mask (B, length + 1) bool for a masked step, else a tensor of
    `length` items, the cache's length as a shape."""

    def __init__(self, model: nn.Module, masked: bool = False) -> None:
        super().__init__()
        self.model, self.masked = model, masked
        self.packed = nn.ModuleList(_packed_linears(model))

    def forward(self, input_ids, position_ids, carrier, keys: list, values: list):
        cache = StaticKVCache.__new__(StaticKVCache)  # the call's cache, its sizes symbolic
        cache.keys, cache.values = tuple(keys), tuple(values)
        length = carrier.shape[1] - 1 if self.masked else carrier.shape[0]
        cache.length, cache.max_length = length, keys[0].shape[2]
        output = self.model(
            input_ids, attention_mask=carrier if self.masked else None,
            position_ids=position_ids, cache=cache, logits_to_keep=1, check_ids=False,
        )  # fmt: skip
        logits = output.logits[:, -1].float()  # (B, V)
        return logits, logits.amax(dim=-1), logits.argmax(dim=-1)  # and (B,), (B,)


def _packed_linears(model: nn.Module) -> list[nn.Module]:
    return [linear for m in model.modules() if isinstance(m, PackedLinear) for linear in m._linears]


class _Runner:
    """A loaded library and the tensors its constants point at (kept alive here)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.names = loader.get_constant_fqns()
        self.constants: dict[str, torch.Tensor] = {}
        self.inductor_constants = inductor_constants.read(loader.get_metadata())

    def refuses(self, model: nn.Module) -> str | None:
        """Why this library cannot read `model`'s tensors, or None: each constant it reads must
        have the shape and dtype recorded when it was built (a library copied from another
        model would read out of bounds)."""
        recorded = json.loads(self.loader.get_metadata().get(CONSTANTS_METADATA, "null"))
        if not isinstance(recorded, dict):
            return "it records no shapes for its constants"
        tensors = _tensors(model)
        for name in self.names:
            tensor = tensors.get(name)
            found = None if tensor is None else [list(tensor.shape), str(tensor.dtype)]
            if recorded.get(name) != found:
                return (
                    f"its constant {name} was built as {recorded.get(name)}, the model has {found}"
                )
        return None

    def point_at(self, model: nn.Module) -> None:
        """Point the constants at the model's present tensors, where any of them changed (a
        parameter replaced rather than written in place)."""
        tensors = {**self.inductor_constants, **_tensors(model)}
        if all(tensors.get(name) is self.constants.get(name) for name in self.names):
            return
        missing = [name for name in self.names if name not in tensors]
        if missing:
            raise RuntimeError(f"the exported step: the model lost the tensors {missing[:4]}")
        self.use(tensors)

    def use(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point the constants at `tensors` (by name; each constant's must be there): user
        managed, so the library reads those very tensors and copies nothing."""
        self.constants = {name: tensors[name] for name in self.names}
        self.loader.load_constants(self.constants, False, True, True, False)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    step = _Step(model)
    return {**dict(step.named_parameters(remove_duplicate=False)),
            **dict(step.named_buffers(remove_duplicate=False))}  # fmt: skip


def _load_or_compile(model, key: tuple, options: dict, input_ids, kwargs, compile=True):
    """The library of `key` from the compile store, or (with `compile`) compiled now and
    stored: a _Runner; the reason as a string where the step cannot be exported or compiled;
    None where none is stored and `compile` is False."""
    path = _library_path(key)
    runner = _load(model, path, "compiling again" if compile else "not compiled")
    if runner is not None or not compile:
        return runner
    try:
        return _Runner(_compile(model, options, input_ids, kwargs, path).loader)
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        logger.warning("no exported step: decoding through torch.compile instead (%s)", reason)
        return reason


def _library_path(key: tuple) -> Path | None:
    """Where the compile store keeps the library of `key` (None: no store)."""
    directory = store_directory()
    if directory is None:
        return None
    kv = "" if key[5] is None else f"-kv-{key[5]}"
    name = "exported-b{}-{}-{}{}{}.pt2".format(*key[1:4], "-masked" if key[4] else "", kv)
    return directory / key[0] / name.replace("torch.", "")


def _load(model, path: Path | None, otherwise: str) -> _Runner | None:
    """The library stored at `path`; None where there is none, or where it cannot be trusted or
    read, or was built for other tensors (the reason logged, with what happens `otherwise`)."""
    if path is None or not path.exists():
        return None
    refused = untrusted(path, path.parent.parent)
    if refused is None:
        try:
            runner = _Runner(torch._inductor.aoti_load_package(str(path)).loader)
            refused = runner.refuses(model)
        except Exception as error:  # another torch's file, or a damaged one
            refused = str(error)
        if refused is None:
            return runner
    logger.warning("exported step %s not loaded (%s): %s", path, otherwise, refused)
    return None


def _compile(model, options: dict, input_ids, kwargs: dict, path: Path | None):
    """Export the step for this batch size and compile it with AOTInductor, into `path` (or a
    temporary file), with its constants left out of the library: they are the model's."""
    cache, masked = kwargs["cache"], kwargs.get("attention_mask") is not None
    B, D = input_ids.shape[0], cache.keys[0].shape[-1]
    slots, length = 8, 3  # examples: any sizes >= 2, which export keeps symbolic
    example_cache = [torch.zeros(B, t.shape[1], slots, D, dtype=t.dtype) for t in cache.keys]
    carrier = torch.ones(B, length + 1, dtype=torch.bool) if masked else torch.empty(length)
    example = (
        torch.zeros(B, 1, dtype=input_ids.dtype),
        torch.full((B, 1), length, dtype=kwargs["position_ids"].dtype),
        carrier, example_cache, [t.clone() for t in example_cache],
    )  # fmt: skip
    auto = torch.export.Dim.AUTO
    carrier_shape = {1: auto} if masked else {0: auto}
    shapes = ({}, {}, carrier_shape, [{2: auto}] * len(cache.keys), [{2: auto}] * len(cache.keys))
    started = time.perf_counter()
    with torch.no_grad():
        step = _Step(model, masked)
        program = torch.export.export(step, example, dynamic_shapes=shapes, strict=False)
    opaque = {str(n.target) for n in program.graph.nodes if str(n.target).startswith("qkv.")}
    if opaque:
        raise RuntimeError(f"the step calls {sorted(opaque)}, which have no C++ kernel")
    constants = {name: [list(t.shape), str(t.dtype)] for name, t in _tensors(model).items()}
    configs = {
        **options,
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.metadata": {CONSTANTS_METADATA: json.dumps(constants, sort_keys=True)},
    }
    if path is None:  # no store: a file of this process, gone once loaded
        with tempfile.TemporaryDirectory(prefix="qkv-step-") as folder:
            target = Path(folder) / "step.pt2"
            _package(program, target, configs, frozenset(constants))
            return torch._inductor.aoti_load_package(str(target))
    make_folder(path.parent)
    skip = frozenset(constants)  # the model's tensors: supplied by the model itself
    write_atomically(path, lambda partial: _package(program, partial, configs, skip), suffix=".pt2")
    seconds = time.perf_counter() - started
    logger.info("decoding step exported and compiled in %.1f s (%s)", seconds, path)
    return torch._inductor.aoti_load_package(str(path))


def _package(program, path: Path, configs: dict, skip: frozenset[str] = frozenset()) -> None:
    """AOTInductor's compile of `program` into the package `path`. Torch 2.13's inductor copies
    the graph with a deprecated pytree class and warns of it (a FutureWarning about `LeafSpec`)
    at every compile: torch's own use, which nothing a user does can change, so that one warning
    is not passed on; any other is. The small constants inductor adds while lowering (not the
    model's tensors, named in `skip`) are recorded in the library's metadata
    (`inductor_constants.recorded`)."""
    with warnings.catch_warnings(), inductor_constants.recorded(skip):
        warnings.filterwarnings("ignore", message=_TORCH_LEAFSPEC_WARNING, category=FutureWarning)
        # inductor's note that a kernel reads both (a Q8_0 table's fp16 scales beside bf16
        # products): how it fuses, not a fault of the model's
        warnings.filterwarnings("ignore", message=_TORCH_MIXED_WARNING, category=UserWarning)
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(path), inductor_configs=configs
        )


_TORCH_LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_TORCH_MIXED_WARNING = r"bf16 and fp16 are mixed in the scheduler node"
