"""Linears of one module that read the same input, computed as one product: the fusion that
`packed_linears` does, learned from the model's first call instead of declared by the layers.

The linear children of one module with the same input width and dtype may read one tensor
(MultiHeadAttention's q, k and v in self-attention; SwiGLU's gate and up) or not (out_proj reads
the attention's output; in cross-attention q reads x while k and v read the memory). Each is
swapped for a `SharedInputMember` of one `SharedInputGroup`:

- the first round of calls (until every member was called, or one is called a second time)
  runs each member's own packed product and notes the tensor each one read;
- from then on, the members that read one tensor in that round are fused: the first of them
  to be called computes one product over their stacked weights and keeps the others' slices,
  which each takes if it is called with that very tensor, unchanged since (the same object,
  the same `_version`; an inference tensor has no version: the same object); a member called
  with anything else computes a product of its own.

So every output is a product of the member's own input: what is learned only decides how many
products are computed (fewer, larger ones are faster on the CPU). Under torch.compile each member
computes its own product: a compiled one-row product is a reduction per linear anyway
(`PackedLinear`), and the cached slices would be state inside the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qkv.acceleration.packing import PackedLinear

__all__ = ["InputSharing", "SharedInputGroup", "SharedInputMember"]


class SharedInputMember(nn.Module):
    """Stands in for one linear of a `SharedInputGroup`: (..., in_features) -> (...,
    out_features), the linear's product. `own` is its own PackedLinear."""

    def __init__(self, group: SharedInputGroup, index: int, own: PackedLinear) -> None:
        super().__init__()
        self.group, self.index, self.own = group, index, own  # `group` is no submodule
        self.in_features, self.out_features = own.in_features, own.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.own(x)
        return self.group.product(self.index, x)

    def extra_repr(self) -> str:
        shared = self.group.shares_with(self.index)
        how = f"fused with {', '.join(shared)}" if shared else "not fused (yet)"
        return f"{self.group.names[self.index]}, {how}"


class InputSharing:
    """What members of one module read: the first round of calls learns it, then the members
    that read one tensor share one product and each takes its slice (see the module doc).
    Subclasses say how a member computes alone (`_own`) and how a subset is fused (`_fuse`)."""

    def __init__(self, names: tuple[str, ...], widths: tuple[int, ...]) -> None:
        self.names, self.widths = names, widths
        self.forget()

    def forget(self) -> None:
        """Forget what was learned and the kept slices."""
        # what the first round taught, empty until then: index -> (the members that read its
        # input, their fused product or None, their widths)
        self._plans: dict[int, tuple[tuple[int, ...], Callable | None, list[int]]] = {}
        self._round: dict[int, torch.Tensor] = {}  # the learning round: index -> its input
        self._input: torch.Tensor | None = None  # the input of the kept slices
        self._version = -1
        self._kept: dict[int, torch.Tensor] = {}  # index -> its slice of the last fused product

    def _own(self, index: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _fuse(self, subset: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """One product for the members `subset`, or None: each computes alone."""
        raise NotImplementedError

    def shares_with(self, index: int) -> list[str]:
        subset = self._plans[index][0] if self._plans else (index,)
        return [self.names[j] for j in subset if j != index]

    def product(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s product of x: a kept slice, a new fused product, or its own."""
        kept = self._kept
        if kept and self._input is x and index in kept and _version(x) == self._version:
            out = kept.pop(index)
            if not kept:  # every slice taken: x is not held past its layer (a prompt's rows)
                self._input = None
            return out
        if not self._plans:
            if torch.compiler.is_compiling():  # traced before any eager round: each alone
                return self._own(index, x)
            if index not in self._round:
                self._round[index] = x
                own = self._own(index, x)
                if len(self._round) == len(self.names):  # every member called: learned
                    self._learn()
                return own
            self._learn()
        subset, fused, widths = self._plans[index]
        if fused is None:
            return self._own(index, x)
        outputs = fused(x).split(widths, dim=-1)  # one product, then its slices
        self._input, self._version = x, _version(x)
        self._kept = {j: out for j, out in zip(subset, outputs, strict=True) if j != index}
        return outputs[subset.index(index)]

    def _learn(self) -> None:
        """Group the members of the round by the tensor they read (held, so ids are unique)."""
        readers: dict[int, list[int]] = {}
        for index, x in self._round.items():
            readers.setdefault(id(x), []).append(index)
        for indices in readers.values():
            subset = tuple(sorted(indices))
            fused = self._fuse(subset) if len(subset) > 1 else None
            widths = [self.widths[j] for j in subset]
            self._plans.update({j: (subset, fused, widths) for j in subset})
        for index in range(len(self.names)):  # never called in the round: alone
            self._plans.setdefault(index, ((index,), None, [self.widths[index]]))
        self._round = {}


class SharedInputGroup(InputSharing):
    """The linears `names` of one module (same input width and dtype), packed; members stand in
    for them, and those found to read one tensor share one product (see the module doc)."""

    def __init__(self, names: tuple[str, ...], linears: tuple[nn.Linear, ...], batch_hint: int):
        self.linears, self.batch_hint = linears, batch_hint
        self.members = tuple(
            SharedInputMember(self, i, PackedLinear(linear, batch_hint=batch_hint))
            for i, linear in enumerate(linears)
        )
        super().__init__(names, tuple(linear.out_features for linear in linears))
        self.reset()

    def reset(self) -> None:
        """Forget what was learned, the kept slices and every packed copy (a block's exit)."""
        self.forget()
        self.fused: dict[tuple[int, ...], PackedLinear] = {}
        for member in self.members:
            member.own._packed.clear()
            member.own.packing_seconds = 0.0

    def _own(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Through `_linear` (no module call, no shape check: the member stands where a linear
        of these sizes was), as this runs for every projection of a decoding step."""
        return self.members[index].own._linear(x)

    def _fuse(self, subset: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
        stacked = [self.linears[j] for j in subset]
        fused = self.fused[subset] = PackedLinear(*stacked, batch_hint=self.batch_hint)
        return fused._linear


def _version(x: torch.Tensor) -> int:
    """x's version counter; -2 for an inference tensor (torch.inference_mode), which has none:
    there, the same object is taken as unchanged."""
    return -2 if x.is_inference() else x._version
