"""Linears of one module that read the same input, computed as one product: the fusion that
`packed_linears` does, learned from the model's first call instead of declared by the layers.

The linear children of one module with the same input width and dtype may read one tensor
(MultiHeadAttention's q, k and v in self-attention; SwiGLU's gate and up) or not (out_proj reads
the attention's output; in cross-attention q reads x while k and v read the memory). Each is
swapped for a `SharedInputMember` of one `SharedInputGroup`:

- the first round of calls (until a member is called a second time) runs each member's own
  packed product and notes the tensor each one read;
- from then on, the members that read one tensor in that round are fused: the first of them
  to be called computes one product over their stacked weights and keeps the others' slices,
  which each takes if it is called with that very tensor, unchanged since (the same object,
  the same `_version`); a member called with anything else computes a product of its own.

So every output is a product of the member's own input: what is learned only decides how many
products are computed (fewer, larger ones are faster on the CPU). Under torch.compile each member
computes its own product: a compiled one-row product is a reduction per linear anyway
(`PackedLinear`), and the cached slices would be state inside the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.acceleration.packing import PackedLinear

__all__ = ["SharedInputGroup", "SharedInputMember"]


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


class SharedInputGroup:
    """The linears `names` of one module (same input width and dtype), packed; members stand in
    for them, and those found to read one tensor share one product (see the module doc)."""

    def __init__(self, names: tuple[str, ...], linears: tuple[nn.Linear, ...], batch_hint: int):
        self.names, self.linears, self.batch_hint = names, linears, batch_hint
        self.members = tuple(
            SharedInputMember(self, i, PackedLinear(linear, batch_hint=batch_hint))
            for i, linear in enumerate(linears)
        )
        self.reset()

    def reset(self) -> None:
        """Forget what was learned, the kept slices and every packed copy (a block's exit)."""
        self.fused: dict[tuple[int, ...], PackedLinear] = {}
        # what the first round taught, empty until then: index -> (the members that read its
        # input, their fused product or None, their widths)
        self._plans: dict[int, tuple[tuple[int, ...], PackedLinear | None, list[int]]] = {}
        self._round: dict[int, torch.Tensor] = {}  # the learning round: index -> its input
        self._input: torch.Tensor | None = None  # the input of the kept slices
        self._version = -1
        self._kept: dict[int, torch.Tensor] = {}  # index -> its slice of the last fused product
        for member in self.members:
            member.own._packed.clear()
            member.own.packing_seconds = 0.0

    def shares_with(self, index: int) -> list[str]:
        subset = self._plans[index][0] if self._plans else (index,)
        return [self.names[j] for j in subset if j != index]

    def product(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s product of x: a kept slice, a new fused product, or its own. The
        products are called through `_linear` (no module call, no shape check: the member
        stands where a linear of these sizes was), as this runs for every projection of a
        decoding step."""
        kept = self._kept
        if kept and self._input is x and index in kept and x._version == self._version:
            return kept.pop(index)
        if not self._plans:
            if index not in self._round:
                self._round[index] = x
                return self.members[index].own._linear(x)
            self._learn()
        subset, fused, widths = self._plans[index]
        if fused is None:
            return self.members[index].own._linear(x)
        outputs = fused._linear(x).split(widths, dim=-1)  # one product, then its slices
        self._input, self._version = x, x._version
        self._kept = {j: out for j, out in zip(subset, outputs, strict=True) if j != index}
        return outputs[subset.index(index)]

    def _learn(self) -> None:
        """Group the members of the round by the tensor they read (held, so ids are unique)."""
        readers: dict[int, list[int]] = {}
        for index, x in self._round.items():
            readers.setdefault(id(x), []).append(index)
        for indices in readers.values():
            subset = tuple(sorted(indices))
            fused = None
            if len(subset) > 1:
                stacked = [self.linears[j] for j in subset]
                fused = self.fused[subset] = PackedLinear(*stacked, batch_hint=self.batch_hint)
            widths = [self.linears[j].out_features for j in subset]
            self._plans.update({j: (subset, fused, widths) for j in subset})
        for index in range(len(self.members)):  # never called in the round: alone
            self._plans.setdefault(index, ((index,), None, [self.linears[index].out_features]))
        self._round = {}
