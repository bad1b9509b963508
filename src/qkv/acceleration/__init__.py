"""CPU speed-ups, one optional layer above the models they speed up (nothing below imports it).
The models are plain PyTorch; what is faster is swapped in or wrapped around them from here.

- `packed_linears(model)`: every linear weight reordered once into oneDNN's blocked layout, and
  the projections that read one input fused into one product, for the length of a `with`
  block (inference); `explain_packing(model)` says what it packs on this machine, and why.
- `decoding_steps(model)`: the steps `qkv.generate(..., steps=)` runs after the prefill,
  compiled: the step exported and compiled ahead of time by AOTInductor (`exported`, kept on
  disk by `compile_store`), or the forward compiled by torch.compile (`compiled`); which one
  serves a call is decided in `decoding`, and nowhere else.
- `speed_up(model)`: the stand-ins for PyTorch's standard blocks that pay on this CPU, swapped
  in for the length of a `with` block (training and decoding alike): `onednn_linears`
  (`OneDNNLinear`), `fused_losses` (`fused_cross_entropy`), `fast_rope`
  (`FastRotaryEmbedding`); `speed_up_choices()` says which, and why (`swaps`).
- `quantize(model, "Q4_1")` and `quantized_from_gguf(path)`: linears whose weights stay GGUF
  blocks (`QuantizedLinear`: Q4_0, Q4_1, Q8_0; `quantize_blocks`), multiplied by PyTorch's
  int4 kernel or block by block in fp32; `explain_quantized(model)` says which, and why.

Each asks `qkv.capabilities` what this CPU and PyTorch build support and falls back to the plain
PyTorch op where they do not: the same results, slower.
"""

from qkv.acceleration.block import packed_linears
from qkv.acceleration.compiled import CompiledForward
from qkv.acceleration.decoding import MODES, DecodingSteps, decoding_steps
from qkv.acceleration.exported import ExportedStep
from qkv.acceleration.fast_rotary import FastRotaryEmbedding, fast_rope
from qkv.acceleration.fused_loss import LossInput, fused_cross_entropy, fused_losses
from qkv.acceleration.onednn_linear import OneDNNLinear
from qkv.acceleration.packing import PackedLinear
from qkv.acceleration.plan import PackingPlan, can_pack, explain_packing
from qkv.acceleration.quantized import QuantizedLinear, quantize_blocks
from qkv.acceleration.quantized_models import explain_quantized, quantize, quantized_from_gguf
from qkv.acceleration.shared_input import SharedInputGroup, SharedInputMember
from qkv.acceleration.swaps import (
    onednn_linears,
    speed_up,
    speed_up_choices,
    swapped_classes,
)

__all__ = [
    "MODES",
    "CompiledForward",
    "DecodingSteps",
    "ExportedStep",
    "FastRotaryEmbedding",
    "LossInput",
    "OneDNNLinear",
    "PackedLinear",
    "PackingPlan",
    "QuantizedLinear",
    "SharedInputGroup",
    "SharedInputMember",
    "can_pack",
    "decoding_steps",
    "explain_packing",
    "explain_quantized",
    "fast_rope",
    "fused_cross_entropy",
    "fused_losses",
    "onednn_linears",
    "packed_linears",
    "quantize",
    "quantize_blocks",
    "quantized_from_gguf",
    "speed_up",
    "speed_up_choices",
    "swapped_classes",
]
