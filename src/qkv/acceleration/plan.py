"""What `packed_linears(model)` will do on this machine, and why: the plan it carries out.

    print(qkv.acceleration.explain_packing(model))

lists the linears that are packed for oneDNN, the projections fused into one product, and every
linear left as it is with the reason (its device, its dtype, or what this CPU lacks), in the
spirit of `qkv.explain` for attention backends. `packed_linears` follows this very plan and logs
its summary, so what is explained is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from qkv import capabilities
from qkv.capabilities import Support

__all__ = ["PackingPlan", "can_pack", "explain_packing", "packing_support"]


def packing_support(linear: nn.Linear) -> Support:
    """Whether `linear` can be packed on this machine, and why (or why not)."""
    weight = linear.weight
    if weight.device.type != "cpu":
        return Support(False, f"its weight is on {weight.device}, and packing is for the CPU")
    return capabilities.onednn_linear(weight.dtype)


def can_pack(linear: nn.Linear) -> bool:
    """True if the weight is a CPU fp32/bf16 tensor and oneDNN packs that dtype here."""
    return bool(packing_support(linear))


@dataclass
class PackingPlan:
    """fused: (module, attribute, linears, label) per FUSABLE group packed as one product.
    swaps: (parent, child name, linear, label) per nn.Linear swapped for a PackedLinear.
    left: (label, reason) per linear or group left as it is."""

    fused: list[tuple[nn.Module, str, tuple[nn.Linear, ...], str]] = field(default_factory=list)
    swaps: list[tuple[nn.Module, str, nn.Linear, str]] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        """One line: how many linears are packed and fused, how many are left."""
        dtypes = sorted({str(linear.weight.dtype) for _, _, linear, _ in self.swaps})
        return (
            f"packed_linears: {len(self.swaps)} linears packed for oneDNN "
            f"({', '.join(dtypes) or 'none'}), {len(self.fused)} projection groups fused, "
            f"{len(self.left)} left as they are"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  fused {label}" for _, _, _, label in self.fused]
        lines += [f"  left {label}: {reason}" for label, reason in self.left]
        if any(linear.weight.dtype == torch.float32 for _, _, linear, _ in self.swaps):
            bf16 = capabilities.onednn_linear(torch.bfloat16)
            how = "packed as bf16 copies" if bf16 else "computed by F.linear, as autocast does"
            lines.append(f"  under CPU autocast to bf16, products are {how} ({bf16.reason})")
        return "\n".join(lines)


def explain_packing(model: nn.Module, *, fuse: bool = True) -> PackingPlan:
    """The plan `packed_linears(model, fuse=fuse)` carries out on this machine; print it to
    read it. Nothing is packed or changed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    plan = PackingPlan()
    names = {module: name or "(model)" for name, module in model.named_modules()}
    if fuse:
        _plan_fusions(model, names, plan)
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            label = f"{names[parent]}.{child_name}" if parent is not model else child_name
            support = packing_support(child)
            if support:
                plan.swaps.append((parent, child_name, child, label))
            else:
                plan.left.append((label, support.reason))
    return plan


def _plan_fusions(model: nn.Module, names: dict[nn.Module, str], plan: PackingPlan) -> None:
    """Every `FUSABLE` group that can be packed as one: plain nn.Linears, packable, of the
    same input width and dtype."""
    for module in model.modules():
        for attribute, linear_names in getattr(type(module), "FUSABLE", {}).items():
            linears = tuple(getattr(module, name) for name in linear_names)
            label = f"{names[module]}.{attribute} = {' + '.join(linear_names)}"
            if not all(type(m) is nn.Linear for m in linears):
                continue  # already packed by an enclosing block, or not linears at all
            reasons = [packing_support(m).reason for m in linears if not can_pack(m)]
            if len({(m.in_features, m.weight.dtype) for m in linears}) != 1:
                reasons.append("their input widths or dtypes differ")
            if reasons:
                plan.left.append((label, reasons[0]))
            else:
                plan.fused.append((module, attribute, linears, label))
