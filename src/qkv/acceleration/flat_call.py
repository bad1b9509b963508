"""The last stage of `CompiledSteps`: a trusted graph called with its inputs gathered by a plan,
instead of by the forward torch.compile rewrote.

That rewritten forward (an `AOTCompiledFunction`'s `fn`) gathers the graph's inputs at every
call by walking the module tree: for the Llama of benchmarks/decode.py, 111 inputs reached
through about 200 module, parameter and dict lookups, most of them cache misses once a step's
weights have streamed through the caches. Within one decoding call the parameters never
change; what does is reachable from the step's own arguments: the new token ids, positions and
key mask, the cache's tensors and its length. So `FlatCall`

1. runs two steps through a copy of the rewritten forward whose graph records its inputs and
   outputs, and works out where each input comes from: an argument, an attribute of one, an
   item of a tuple attribute, a size of a tensor among them (the same at both steps), or else
   a constant (the same object, or number, at both steps: a parameter, say);
2. works out what the forward made of the outputs: its result (a tensor, or a dataclass whose
   tensors are outputs) and the attributes of its arguments that it set (the cache's length),
   each to an output;
3. checks that plan against a third recorded step, and from then on calls the graph itself
   with the gathered inputs, sets those attributes and builds the result.

Taking what did not change between two steps for a constant is the premise `CompiledSteps`
already trusts its guards on: within one call, steps differ only by their tokens, positions,
key mask and cache length. The checked step catches a plan that mistook anything else.

Anything the plan cannot explain (an input that changes but is reachable from no argument, an
attribute set to a value no output holds) leaves the steps on the rewritten forward, with a
debug log that says why. Side effects on the model itself are not looked for: the forward of a
decoding step must not change the model (qkv's do not; neither does trusting the guards).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["FlatCall", "flat_call"]

logger = logging.getLogger(__name__)

Path = tuple  # (("args", i) or ("kwargs", name), then ("attr", name), ("item", j), ("size", d))
Getter = Callable[[tuple, dict], Any]  # (args, kwargs) of a step -> the value a path reaches


def flat_call(graph: Any) -> FlatCall | None:
    """A `FlatCall` for an `AOTCompiledFunction`, or None where it lacks the private parts used
    here (the graph itself and the code that rewrote the forward): a torch whose internals
    moved keeps the rewritten forward."""
    artifacts = getattr(graph, "_artifacts", None)
    environment = getattr(artifacts, "runtime_env", None)
    if not hasattr(environment, "forward_callable") or not hasattr(artifacts, "compiled_fn"):
        return None
    recording = _Recording(artifacts.compiled_fn)
    recording_fn = environment.forward_callable(
        artifacts.backend_id, recording, extra_globals=graph.fn.__globals__
    )
    return FlatCall(graph.fn, recording_fn, recording)


class FlatCall:
    """One decoding call's steps through one trusted graph (see the module doc):
    `flat(model, args, kwargs)` returns what `fn(model, *args, **kwargs)` returns."""

    def __init__(self, fn: Callable, recording_fn: Callable, recording: _Recording) -> None:
        self.fn, self.recording_fn, self.recording = fn, recording_fn, recording
        self.records: list[_Record] = []
        self.plan: _Plan | None = None
        self.checked = False  # whether the plan reproduced a step it was not made from
        self.failed: str | None = None  # why the rewritten forward stays, once known

    def __call__(self, model, args: tuple, kwargs: dict):
        if self.checked and self.plan.fits(args, kwargs):
            return self.plan.call(self.recording.graph, args, kwargs)
        if self.failed is not None:
            return self.fn(model, *args, **kwargs)
        if self.plan is not None and not self.checked:  # a step to check the plan on
            gathered = self.plan.gather(args, kwargs) if self.plan.fits(args, kwargs) else None
            record = self._record(model, args, kwargs)
            self.checked = gathered is not None and self.plan.reproduces(record, gathered)
            if not self.checked:
                self._give_up("the plan does not reproduce a later step's graph inputs")
            return record.result
        record = self._record(model, args, kwargs)
        if self.plan is None:
            self.records.append(record)
            if len(self.records) == 2:
                self._make_plan()
        return record.result

    def _record(self, model, args: tuple, kwargs: dict) -> _Record:
        """The step run through the recording forward."""
        objects = list(_objects(args, kwargs))
        before = [dict(vars(value)) for _, value in objects]
        reach = list(_reachable(args, kwargs))  # before the step: it may advance a length
        self.recording.seen = None
        result = self.recording_fn(model, *args, **kwargs)
        if self.recording.seen is None:
            raise RuntimeError("compile=True: the rewritten forward did not call its graph")
        changed = {}
        for (place, value), old in zip(objects, before, strict=True):
            new = vars(value)
            for name in old.keys() | new.keys():
                if name not in old or name not in new or new[name] is not old[name]:
                    changed[(place, name)] = new.get(name, _MISSING)
        inputs, outputs = self.recording.seen
        return _Record(args, dict(kwargs), reach, inputs, outputs, result, changed)

    def _make_plan(self) -> None:
        try:
            self.plan = _Plan.from_records(*self.records)
        except _PlanError as reason:
            self._give_up(str(reason))
        self.records.clear()

    def _give_up(self, reason: str) -> None:
        self.plan, self.failed = None, reason
        logger.debug("compile=True: steps keep torch.compile's rewritten forward: %s", reason)


class _Recording:
    """The graph, standing in for itself in the recording forward: notes inputs and outputs."""

    def __init__(self, graph: Callable) -> None:
        self.graph = graph
        self.seen: tuple[list, list] | None = None

    def __call__(self, *inputs):
        outputs = self.graph(*inputs)
        self.seen = (list(inputs), list(outputs))
        return outputs


@dataclasses.dataclass
class _Record:
    """One step through the recording forward: its arguments, the graph's inputs and outputs,
    the forward's result, and the attributes of its object arguments that changed."""

    args: tuple
    kwargs: dict
    reach: list  # [(path, value)] of `_reachable`, before the step
    inputs: list
    outputs: list
    result: Any
    changed: dict  # (place of the object, attribute) -> its new value

    @property
    def shape(self) -> tuple:
        return len(self.args), tuple(self.kwargs)


class _PlanError(Exception):
    """Something about the recorded steps that a plan cannot reproduce."""


_MISSING = object()  # an attribute the step deleted, a path the second step lacks


class _Plan:
    """Where each graph input comes from, and what becomes of the outputs."""

    def __init__(self, shape: tuple, template: list, sources: list, result, attributes) -> None:
        self.shape = shape  # (number of positional arguments, keyword names)
        self.template = template  # the graph's inputs, constants filled in
        self.sources = sources  # [(input index, getter)]: the others
        self.result = result  # outputs -> the forward's result
        self.attributes = attributes  # [(object's path, attribute, output index)]
        self.setters = [(_getter(path), name, index) for path, name, index in attributes]

    def fits(self, args: tuple, kwargs: dict) -> bool:
        return len(args) == self.shape[0] and tuple(kwargs) == self.shape[1]

    def gather(self, args: tuple, kwargs: dict) -> list:
        inputs = self.template.copy()
        for index, getter in self.sources:
            inputs[index] = getter(args, kwargs)
        return inputs

    def call(self, graph: Callable, args: tuple, kwargs: dict):
        outputs = graph(*self.gather(args, kwargs))
        for owner, name, index in self.setters:
            vars(owner(args, kwargs))[name] = outputs[index]  # as the rewritten forward does
        return self.result(outputs)

    def reproduces(self, record: _Record, gathered: list) -> bool:
        """Whether `gathered`, what the plan gathered before a recorded step, are its graph
        inputs (the same tensors, equal numbers), and its changed attributes are outputs."""
        expected = {(path[0], name): record.outputs[index] for path, name, index in self.attributes}
        return (
            len(gathered) == len(record.inputs)
            and all(map(_same, gathered, record.inputs))
            and expected.keys() == record.changed.keys()
            and all(_same(expected[key], record.changed[key]) for key in expected)
        )

    @classmethod
    def from_records(cls, first: _Record, second: _Record) -> _Plan:
        if first.shape != second.shape or len(first.inputs) != len(second.inputs):
            raise _PlanError("two steps called the forward differently")
        reach = _Reach(first, second)
        template, sources = [], []
        for index, (a, b) in enumerate(zip(first.inputs, second.inputs, strict=True)):
            path = reach.source(a, b)
            if path is None and not _same(a, b):
                raise _PlanError(
                    f"graph input {index} ({type(a).__name__}) changes between steps and is "
                    f"reachable from no argument of the step"
                )
            template.append(a if path is None else None)
            if path is not None:
                sources.append((index, _getter(path)))
        attributes = _attributes(first, second)
        return cls(first.shape, template, sources, _result(first, second), attributes)


class _Reach:
    """What the arguments of two recorded steps reach, path by path (`_reachable`)."""

    def __init__(self, first: _Record, second: _Record) -> None:
        self.paths, self.firsts = zip(*first.reach, strict=True)
        seconds = dict(second.reach)
        self.seconds = [seconds.get(path, _MISSING) for path in self.paths]
        self.by_first: dict[Any, list[int]] = {}  # id of a tensor, or an int -> path indices
        for i, value in enumerate(self.firsts):
            if isinstance(value, torch.Tensor) or type(value) is int:
                self.by_first.setdefault(_key(value), []).append(i)

    def source(self, a, b) -> Path | None:
        """The first path that reaches graph input a at the first step and b at the second:
        the same tensors, or ints that change; None for anything else (a constant, if a is
        b)."""
        changing_int = type(a) is int and type(b) is int and a != b
        if not (isinstance(a, torch.Tensor) or changing_int):
            return None
        for i in self.by_first.get(_key(a), ()):
            if _same(self.firsts[i], a) and _same(self.seconds[i], b):
                return self.paths[i]
        return None


def _key(value) -> Any:
    return ("tensor", id(value)) if isinstance(value, torch.Tensor) else ("int", value)


def _attributes(first: _Record, second: _Record) -> list[tuple[Path, str, int]]:
    """Each attribute the forward set on an object argument, and the output it was set to
    (the same output at both steps)."""
    if first.changed.keys() != second.changed.keys():
        raise _PlanError("two steps changed different attributes of their arguments")
    attributes = []
    for place, name in sorted(first.changed, key=repr):
        values = first.changed[(place, name)], second.changed[(place, name)]
        index = _output_index(first, second, *values)
        if index is None:
            raise _PlanError(f"the step sets {name!r} of an argument to what no output holds")
        attributes.append(((place,), name, index))
    return attributes


def _result(first: _Record, second: _Record) -> Callable[[list], Any]:
    """outputs -> the forward's result: an output, or a dataclass of outputs and constants."""
    if isinstance(first.result, torch.Tensor):
        index = _output_index(first, second, first.result, second.result)
        if index is None:
            raise _PlanError("the forward's result is not one of the graph's outputs")
        return lambda outputs: outputs[index]
    if not dataclasses.is_dataclass(first.result) or type(first.result) is not type(second.result):
        raise _PlanError(f"the forward returns a {type(first.result).__name__}")
    template, fields = first.result, {}
    for field in dataclasses.fields(template):
        a, b = getattr(first.result, field.name), getattr(second.result, field.name)
        if isinstance(a, torch.Tensor):
            index = _output_index(first, second, a, b)
            if index is None:
                raise _PlanError(f"the result's {field.name} is not one of the graph's outputs")
            fields[field.name] = index
        elif not _same(a, b):
            raise _PlanError(f"the result's {field.name} changes and is no output")
    return lambda outputs: dataclasses.replace(
        template, **{name: outputs[index] for name, index in fields.items()}
    )


def _output_index(first: _Record, second: _Record, a, b) -> int | None:
    pairs = zip(first.outputs, second.outputs, strict=True)
    return next((i for i, (x, y) in enumerate(pairs) if _same(x, a) and _same(y, b)), None)


def _same(a, b) -> bool:
    """The same tensor, or equal values of one type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a is b or (type(a) is type(b) and a == b)


def _reachable(args: tuple, kwargs: dict) -> Iterator[tuple[Path, Any]]:
    """(path, value) for what a graph input can be taken from: each argument, the attributes
    of an object argument, the items of its tuple or list attributes, and the sizes of every
    tensor among them, in that order."""
    for root, value in _places(args, kwargs):
        yield from _with_sizes((root,), value)
        if _is_object(value):
            for name, attribute in vars(value).items():
                path = ((root), ("attr", name))
                yield from _with_sizes(path, attribute)
                if isinstance(attribute, (tuple, list)):
                    for j, item in enumerate(attribute):
                        yield from _with_sizes((*path, ("item", j)), item)


def _with_sizes(path: Path, value) -> Iterator[tuple[Path, Any]]:
    yield path, value
    if isinstance(value, torch.Tensor):
        for d, size in enumerate(value.shape):
            yield (*path, ("size", d)), size


def _objects(args: tuple, kwargs: dict) -> Iterator[tuple[tuple, Any]]:
    """(place, value) of the arguments whose attributes the forward may read or set."""
    return ((place, value) for place, value in _places(args, kwargs) if _is_object(value))


def _places(args: tuple, kwargs: dict) -> list[tuple[tuple, Any]]:
    """(place, value) of every argument: ("args", i) or ("kwargs", name)."""
    places = [(("args", i), v) for i, v in enumerate(args)]
    return places + [(("kwargs", name), v) for name, v in kwargs.items()]


def _is_object(value) -> bool:
    """An argument with attributes of its own (a cache), not a tensor or a plain value."""
    return hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type))


def _getter(path: Path) -> Getter:
    """(args, kwargs) -> what the path reaches: one small function per step of the path."""
    (kind, key), *steps = path
    get = (lambda a, k: a[key]) if kind == "args" else (lambda a, k: k[key])
    for step, argument in steps:
        get = _STEPS[step](get, argument)
    return get


_STEPS = {
    "attr": lambda get, name: lambda a, k: getattr(get(a, k), name),
    "item": lambda get, j: lambda a, k: get(a, k)[j],
    "size": lambda get, d: lambda a, k: get(a, k).shape[d],
}
