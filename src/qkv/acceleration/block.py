"""`packed_linears(model)`: inside the `with` block, every packable `nn.Linear` of the model is
a packed one, and the linears of one module that read one input share a product.

    with qkv.acceleration.packed_linears(model):
        tokens = qkv.generate(model, prompt, max_new_tokens=128)

The block carries out `explain_packing(model)` (qkv.acceleration.plan): a linear alone among its
module's linears of its input width becomes a `PackedLinear`; several become the members of a
`SharedInputGroup` (qkv.acceleration.shared_input). On exit the model's own modules are back.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from qkv.acceleration.packing import PackedLinear
from qkv.acceleration.plan import explain_packing
from qkv.acceleration.shared_input import SharedInputGroup

__all__ = ["packed_linears"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def packed_linears(
    model: nn.Module, *, batch_hint: int = 1, fuse: bool = True
) -> Iterator[nn.Module]:
    """Inside the block, every packable `nn.Linear` of `model` computes the same outputs from a
    oneDNN-packed copy and, with `fuse`, the linears of one module that read one tensor share
    one product; on exit the original modules are back, even after an exception. A weight
    shared by two linears (or tied to an embedding) is packed once per linear; the model's own
    tensors are never modified. Gradients are off inside the block (torch.no_grad). Yields the
    model. A later block on the same model reuses its packed modules (not their packed copies,
    which are dropped on exit), so compiled decoding compiles once per model, not per block.

    What cannot be packed on this machine (see `qkv.capabilities`) keeps its nn.Linear; the
    plan is `explain_packing(model, fuse=fuse)`, and its summary is logged at INFO."""
    plan = explain_packing(model, fuse=fuse)
    logger.info("%s", plan.summary())
    for label, reason in plan.left:
        logger.debug("packed_linears: %s left as it is: %s", label, reason)
    previous = _LAST_BLOCK.get(model, {})
    used: dict[tuple[nn.Linear, ...], PackedLinear | SharedInputGroup] = {}
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    try:
        for parent, names, linears, _ in plan.groups:
            group = used[linears] = _reuse_group(previous.get(linears), names, linears, batch_hint)
            for name, linear, member in zip(names, linears, group.members, strict=True):
                setattr(parent, name, member)
                swapped.append((parent, name, linear))
        for parent, name, linear, _ in plan.swaps:
            key = (linear,)
            if key not in used:
                used[key] = _reuse(previous.get(key), key, batch_hint)
            setattr(parent, name, used[key])
            swapped.append((parent, name, linear))
        if used:  # a block nested in another finds nothing left to pack
            _LAST_BLOCK[model] = used
        with torch.no_grad():
            yield model
    finally:
        for parent, name, linear in reversed(swapped):
            setattr(parent, name, linear)
        for module in used.values():
            if isinstance(module, SharedInputGroup):
                module.reset()
            else:
                module._packed.clear()  # the packed copies live only inside the block


# model -> what its last packed_linears block swapped in, by the linears they stand for. The
# next block reuses what still fits, so that what torch.compile compiled for them (its guards
# name these very modules) serves again, where new modules would compile the model anew. Their
# packed copies are dropped on exit: weights changed between blocks are packed afresh. Weak: a
# dropped model takes its entry with it.
_LAST_BLOCK: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _reuse_group(
    group: SharedInputGroup | None,
    names: tuple[str, ...],
    linears: tuple[nn.Linear, ...],
    batch_hint: int,
) -> SharedInputGroup:
    """`group` if it still stands for `linears` (names, sizes, dtype, the batch hint), reset;
    a new SharedInputGroup otherwise."""
    fits = (
        isinstance(group, SharedInputGroup)
        and group.names == names
        and group.batch_hint == batch_hint
        and all(
            _describes(member.own, (linear,), batch_hint)
            for member, linear in zip(group.members, linears, strict=True)
        )
    )
    if not fits:
        return SharedInputGroup(names, linears, batch_hint)
    group.reset()  # drops packed copies and packing times too
    return group


def _reuse(module: PackedLinear | None, linears: tuple[nn.Linear, ...], batch_hint: int):
    """`module` if it still describes `linears` (their dtype and sizes, the batch hint), with its
    packing time reset and no packed copy (one made by a call outside any block, from a
    module kept past its block, may hold weights changed since); a new PackedLinear
    otherwise."""
    if not _describes(module, linears, batch_hint):
        return PackedLinear(*linears, batch_hint=batch_hint)
    module.packing_seconds = 0.0
    module._packed.clear()
    return module


def _describes(module: object, linears: tuple[nn.Linear, ...], batch_hint: int) -> bool:
    """Whether `module` is a PackedLinear of `linears`' dtype and sizes, for `batch_hint`."""
    return isinstance(module, PackedLinear) and (
        module.batch_hint == batch_hint
        and module._dtype == linears[0].weight.dtype
        and module.in_features == linears[0].in_features
        and module.out_features == sum(linear.out_features for linear in linears)
    )
