"""Faster stand-ins for PyTorch's standard blocks, swapped into a built model from outside.

qkv's layers and models are built from PyTorch's own blocks (`nn.Linear`, `nn.Dropout`,
`F.cross_entropy`) and one plain RoPE (`qkv.positional.RotaryEmbedding`). On the CPU some of
these have faster equivalents that compute the same function, and a `with` block swaps them in:

    with qkv.acceleration.speed_up(model):      # the stand-ins that pay on this CPU
        train(model)

- `onednn_linears(model)`: every nn.Linear computes its CPU float32 products with oneDNN's
  kernels (`OneDNNLinear`), faster than MKL's on AMD CPUs with AVX-512.
- `fused_losses(model)`: F.cross_entropy on the model's CPU float32 logits gets a backward that
  writes the gradient into the saved log-probabilities (`fused_cross_entropy`): no new (N, V)
  buffer.
- `fast_rope(model)`: every RotaryEmbedding rotates by a roll and shares its tables across the
  layers of one call (`FastRotaryEmbedding`, Su et al. 2021's RoPE with the same bits).

A module swap changes the class of the model's own modules to a subclass that adds methods and
no state (as torch.nn.utils.parametrize changes classes): the same objects, parameters, hooks
and state-dict keys, so optimizers, DDP or FSDP wrappers and checkpoints see no difference. On
exit the classes are put back, even after an exception.

`speed_up(model)` chooses from what this CPU and build are (`speed_up_choices`), never from a
timing taken in the process, so that every process on a machine computes the same bits: a
training run resumed after a kill ends on the weights of a run never killed. The one choice that
depends on the CPU, oneDNN's float32 products, is `qkv.capabilities.onednn_fp32_products`,
which a training checkpoint records (`kernel_choices`) and a resumed run pins (`kernels_as`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

from qkv.acceleration import onednn_probe
from qkv.acceleration.fast_rotary import fast_rope
from qkv.acceleration.fused_loss import fused_losses
from qkv.acceleration.onednn_linear import OneDNNLinear
from qkv.capabilities import Support

__all__ = [
    "onednn_linears",
    "speed_up",
    "speed_up_choices",
    "swapped_classes",
]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def speed_up(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, the stand-ins that `speed_up_choices()` chooses on this machine are in
    `model`; on exit the model is as it was. Yields the
    model. Enter it inside `qkv.capabilities.kernels_as(...)` when resuming a training run, so
    that the run keeps the kernels its checkpoint recorded."""
    _check_model(model)
    choices = speed_up_choices()
    logger.info("speed_up: %s", "; ".join(f"{name}: {why.reason}" for name, why in choices.items()))
    with contextlib.ExitStack() as stack:
        if choices["onednn_linears"]:
            stack.enter_context(onednn_linears(model))
        if choices["fused_losses"]:
            stack.enter_context(fused_losses(model))
        if choices["fast_rope"]:
            stack.enter_context(fast_rope(model))
        yield model


def speed_up_choices() -> dict[str, Support]:
    """Which stand-ins `speed_up` swaps in here, and why (or why not), by name."""
    portable = "portable tensor ops, used on CPU tensors whatever the CPU"
    return {
        "onednn_linears": onednn_probe.plain_fp32_products(),
        "fused_losses": Support(True, f"a backward with no new (N, V) buffer: {portable}"),
        "fast_rope": Support(True, f"RoPE's bits in fewer ops, tables once a call: {portable}"),
    }


@contextlib.contextmanager
def onednn_linears(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every `nn.Linear` of `model` (that very class, not a subclass) is a
    `OneDNNLinear`: CPU float32 products on oneDNN, F.linear's outputs up to float rounding.
    Where this build's oneDNN cannot compute float32 products here
    (`qkv.acceleration.onednn_probe.plain_product_works`) the model is left as it is, and the
    reason logged. Yields the model."""
    _check_model(model)
    support = onednn_probe.plain_product_works()
    if not support:
        logger.info("onednn_linears: nothing swapped: %s", support.reason)
        yield model
        return
    with swapped_classes(model, {nn.Linear: OneDNNLinear}):
        yield model


@contextlib.contextmanager
def swapped_classes(model: nn.Module, stand_ins: dict[type, type]) -> Iterator[nn.Module]:
    """Inside the block, each module of `model` whose class is a key of `stand_ins` (exactly:
    not a subclass) has the class `stand_ins[key]` instead, a subclass of the key that adds
    methods and no state. On exit each module whose class is still the
    stand-in gets its own back (one that something else has changed since is left as it is).
    Yields the model."""
    for original, stand_in in stand_ins.items():
        if not (isinstance(stand_in, type) and issubclass(stand_in, original)):
            raise TypeError(
                f"stand_ins: expected a subclass of {original.__name__} for it, got {stand_in!r}"
            )
    swapped: list[tuple[nn.Module, type, type]] = []
    try:
        for module in model.modules():  # each module once, however often it is shared
            stand_in = stand_ins.get(type(module))
            if stand_in is not None:
                swapped.append((module, type(module), stand_in))
                module.__class__ = stand_in
        yield model
    finally:
        for module, original, stand_in in reversed(swapped):
            if type(module) is stand_in:
                module.__class__ = original


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
