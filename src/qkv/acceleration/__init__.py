"""CPU speed-ups, one optional layer above the models they speed up (nothing below imports it).

- `packed_linears(model)`: every linear weight reordered once into oneDNN's blocked layout, and
  the projections that read one input fused into one product, for the length of a `with`
  block (inference); `explain_packing(model)` says what it packs on this machine, and why.
- `compiled_steps`: decoding steps through the model's forward compiled by torch.compile,
  what `qkv.generate(..., compile=True)` runs; its graphs are kept on disk for later processes
  (`compile_store`), and `qkv.generate`'s default, compile="auto", switches to them once they
  pay for themselves (`auto`); once trusted, a graph is called with its inputs gathered by a
  plan learned from recorded steps (`flat_call`).
- `exported_steps`: the same steps exported once and compiled ahead of time by AOTInductor into
  a library whose C++ wrapper calls the kernels, what `qkv.generate(..., compile="aot")` runs;
  its weights are the model's own tensors, its libraries kept beside the graphs (`exported`).

Each asks `qkv.capabilities` what this CPU and PyTorch build support and falls back to the plain
PyTorch op where they do not: the same results, slower.
"""

from qkv.acceleration.block import packed_linears
from qkv.acceleration.compiled import CompiledSteps, GuardedSteps, compiled_steps
from qkv.acceleration.exported import ExportedSteps, exported_steps
from qkv.acceleration.packing import PackedLinear
from qkv.acceleration.plan import PackingPlan, can_pack, explain_packing
from qkv.acceleration.shared_input import SharedInputGroup, SharedInputMember

__all__ = [
    "CompiledSteps",
    "ExportedSteps",
    "GuardedSteps",
    "PackedLinear",
    "PackingPlan",
    "SharedInputGroup",
    "SharedInputMember",
    "can_pack",
    "compiled_steps",
    "explain_packing",
    "exported_steps",
    "packed_linears",
]
