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
from qkv.acceleration import onednn_probe
from qkv.acceleration.onednn_linear import OneDNNLinear
from qkv.acceleration.packing import packs
from qkv.capabilities import Support

__all__ = ["PackingPlan", "can_pack", "explain_packing", "packing_support"]


def packing_support(linear: nn.Linear) -> Support:
    """Whether `linear` can be packed on this machine, and why (or why not)."""
    weight = linear.weight
    if weight.device.type != "cpu":
        return Support(False, f"its weight is on {weight.device}, and packing is for the CPU")
    onednn = onednn_probe.packed_products(weight.dtype)
    if not onednn and weight.dtype == torch.bfloat16:
        products = capabilities.bf16_products()
        if not products:  # PackedLinear computes several rows in fp32 (bf16 storage)
            return Support(
                True, f"several rows computed in fp32: {products.reason}; {onednn.reason}"
            )
    return onednn


def can_pack(linear: nn.Linear) -> bool:
    """True if the weight is a CPU fp32/bf16 tensor and oneDNN packs that dtype here, or a bf16
    one whose products PackedLinear computes faster in fp32 (`packing_support`)."""
    return bool(packing_support(linear))


@dataclass
class PackingPlan:
    """groups: (module, child names, linears, label) per set of a module's packable linears of
    one input width and dtype, each linear a `SharedInputMember` (those that read one tensor are
    fused once a call has shown it). swaps: (parent, child name, linear, label) per other
    packable nn.Linear, swapped for a PackedLinear. left: (label, reason) per linear left as
    it is."""

    groups: list[tuple[nn.Module, tuple[str, ...], tuple[nn.Linear, ...], str]] = field(
        default_factory=list
    )
    swaps: list[tuple[nn.Module, str, nn.Linear, str]] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)

    def packed(self) -> list[nn.Linear]:
        """Every linear the block packs, grouped or not."""
        return [m for *_, linears, _ in self.groups for m in linears] + [
            linear for _, _, linear, _ in self.swaps
        ]

    def summary(self) -> str:
        """One line: how many linears are packed, in how many groups, how many are left."""
        packed = self.packed()
        dtypes = sorted({str(linear.weight.dtype) for linear in packed})
        return (
            f"packed_linears: {len(packed)} linears packed for oneDNN "
            f"({', '.join(dtypes) or 'none'}), {len(self.groups)} groups that may share an "
            f"input, {len(self.left)} left as they are"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  group {label}" for *_, label in self.groups]
        lines += [f"  left {label}: {reason}" for label, reason in self.left]
        if any(linear.weight.dtype == torch.float32 for linear in self.packed()):
            fp32 = packs(torch.float32)
            if not fp32:
                lines.append(
                    f"  fp32 products are F.linear's, unpacked, fused as above ({fp32.reason})"
                )
            bf16 = onednn_probe.packed_products(torch.bfloat16)
            how = "packed as bf16 copies" if bf16 else "computed by F.linear, as autocast does"
            lines.append(f"  under CPU autocast to bf16, products are {how} ({bf16.reason})")
        return "\n".join(lines)


def explain_packing(model: nn.Module, *, fuse: bool = True) -> PackingPlan:
    """The plan `packed_linears(model, fuse=fuse)` carries out on this machine; print it to
    read it. Nothing is packed or changed. With `fuse`, a module's packable linears of one input
    width and dtype form a group (`qkv.acceleration.shared_input`): the members a call shows
    to read one tensor are then computed as one product."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    plan = PackingPlan()
    names = {module: name or "(model)" for name, module in model.named_modules()}
    for parent in list(model.modules()):
        prefix = f"{names[parent]}." if parent is not model else ""
        packable: dict[tuple, list[tuple[str, nn.Linear]]] = {}
        for child_name, child in parent.named_children():
            if type(child) not in (nn.Linear, OneDNNLinear):
                continue
            support = packing_support(child)
            if not support:
                plan.left.append((prefix + child_name, support.reason))
                continue
            key = (child.in_features, child.weight.dtype) if fuse else (child_name,)
            packable.setdefault(key, []).append((child_name, child))
        for members in packable.values():
            if len(members) == 1:
                ((child_name, child),) = members
                plan.swaps.append((parent, child_name, child, prefix + child_name))
                continue
            child_names = tuple(name for name, _ in members)
            label = f"{names[parent]}: {' + '.join(child_names)}"
            plan.groups.append((parent, child_names, tuple(m for _, m in members), label))
    return plan
