"""What this CPU and this PyTorch build can do, asked before any fast path is taken.

qkv's CPU speed-ups (oneDNN-packed linears, their bf16 copies under autocast, compiled decoding
steps) depend on things a machine may lack: oneDNN's bf16 kernels need AVX512-BW/VL/DQ or
AVX-NE-CONVERT, an ARM build may have no packed-linear ops at all, and torch.compile's CPU
backend needs a C++ compiler. Each question here is answered once per process, by asking
PyTorch and, where PyTorch's own answer can be wrong (a CPU feature masked with
`ONEDNN_MAX_CPU_ISA`), by running the operation once on a tiny input. A fast path that is not
supported falls back to the plain PyTorch operation, with the same results.

    print(qkv.capabilities.describe())   # the whole picture, in words

The answers honour the variables that mask CPU features, so the fallbacks can be tested on any
machine: `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN) and `ATEN_CPU_CAPABILITY=avx2` or `default`
(PyTorch's own vectorised kernels, and the ISA inductor compiles for).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "Support",
    "bf16_products",
    "bf16_slowdown",
    "compiler",
    "cpu_isa",
    "describe",
    "flex_attention_cpu",
    "onednn_fp32_products",
    "onednn_linear",
    "warn_if_bf16_is_emulated",
]

_ONEDNN_OPS = ("_reorder_linear_weight", "_linear_pointwise")


@dataclass(frozen=True)
class Support:
    """An answer: whether a fast path can run here, and why (or why not), in words."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@functools.cache
def onednn_linear(dtype: torch.dtype) -> Support:
    """Can oneDNN pack a linear weight of `dtype` and multiply with it on this CPU?

    PyTorch's checks first (oneDNN in the build, its ops, bf16 support of the CPU), then one
    packed product of a (8, 16) weight compared with F.linear: a masked or missing CPU feature
    shows up as an error or a wrong result there, not in the middle of a model."""
    if dtype not in (torch.float32, torch.bfloat16):
        return Support(False, f"oneDNN packing serves float32 and bfloat16, not {dtype}")
    if not torch.backends.mkldnn.is_available():
        return Support(False, "this PyTorch build has no oneDNN (torch.backends.mkldnn)")
    missing = [op for op in _ONEDNN_OPS if not hasattr(torch.ops.mkldnn, op)]
    if missing:
        return Support(False, f"this PyTorch build lacks the oneDNN ops {', '.join(missing)}")
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return Support(
            False, "oneDNN's bf16 kernels need AVX512-BW/VL/DQ or AVX-NE-CONVERT on this CPU"
        )
    return _probe_packed_product(dtype)


def _probe_packed_product(dtype: torch.dtype) -> Support:
    """One packed product on a tiny input, against F.linear in float32, outside any autocast
    region of the caller (the first call may come from inside one, where F.linear of float32
    inputs gives bf16) and without recording gradients."""
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        return _packed_product_verdict(dtype)


def _packed_product_verdict(dtype: torch.dtype) -> Support:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=generator).to(dtype)  # (out, in)
    x = torch.randn(2, 16, generator=generator).to(dtype)  # (rows, in)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
        return Support(False, f"oneDNN refused a {dtype} packed product here: {first_line}")
    expected = F.linear(x.float(), weight.float())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    if y.shape != expected.shape or not torch.allclose(y.float(), expected, atol=tolerance):
        return Support(False, f"oneDNN's {dtype} packed product gave wrong results here")
    return Support(True, f"oneDNN packs {dtype} weights on this CPU")


# oneDNN's float32 products must take at most this share of F.linear's time to be used by
# default (qkv.layers.linear): a clear win, not a draw decided by noise.
ONEDNN_FP32_SPEEDUP = 0.95


@functools.cache
def onednn_fp32_products() -> Support:
    """Are oneDNN's float32 products (on plain, unpacked weights) faster than F.linear's here?
    Measured once per process: a (256, 512) x (512, 1024) product, each the best of five,
    outside any autocast region; and checked against F.linear. qkv's `Linear` uses them where
    they are (on an AMD EPYC: 0.43x MKL's time with AVX-512, 0.90x capped at AVX2)."""
    support = onednn_linear(torch.float32)
    if not support:
        return support
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=generator)
    weight = torch.randn(1024, 512, generator=generator)  # (out, in)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        ours = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        if not torch.allclose(ours, F.linear(x, weight), rtol=1e-4, atol=1e-3):
            return Support(False, "oneDNN's float32 product on a plain weight gave wrong results")
        onednn = _best_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""), 5
        )
        plain = _best_seconds(lambda: F.linear(x, weight), 5)
    share = onednn / plain
    if share > ONEDNN_FP32_SPEEDUP:
        return Support(False, f"oneDNN's float32 products take {share:.2f}x F.linear's time here")
    return Support(True, f"oneDNN's float32 products take {share:.2f}x F.linear's time here")


# bf16 products slower than fp32 ones by more than this count as emulated. Measured on an AMD
# EPYC (2 threads): 0.5x with native bf16 (AVX512-BF16); 1.8x with oneDNN capped at AVX512_CORE
# (bf16 converted in AVX-512 registers); 5.7x (F.linear) to 72x (matmul) capped at AVX2.
BF16_SLOWDOWN_LIMIT = 1.5


@functools.cache
def bf16_products() -> Support:
    """Are bf16 matrix products (several rows: a prefill, training under autocast) at least
    about as fast as fp32 ones on this CPU? Measured, not looked up: `bf16_slowdown`. One row
    (a decoding step) is not asked about: PyTorch's own kernel reads bf16 fast on any CPU."""
    slowdown = bf16_slowdown()
    if slowdown > BF16_SLOWDOWN_LIMIT:
        return Support(
            False,
            f"bf16 matrix products take {slowdown:.1f}x the time of fp32 ones on this CPU "
            f"(no native bf16: AVX512-BF16, AMX or AVX-NE-CONVERT)",
        )
    return Support(True, f"bf16 matrix products take {slowdown:.1f}x the time of fp32 ones")


@functools.cache
def bf16_slowdown() -> float:
    """bf16 time over fp32 time of a (256, 256) x (256, 256) product, the slower of F.linear
    (a model's linears) and matmul (attention's products, which can take another path), each
    the best of ten (on a busy machine, three could all be preempted: a 0.3x answer read 1.5x
    beside compilers running), outside any autocast region."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=generator)
    b = torch.randn(256, 256, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        linear = _best_seconds(lambda: F.linear(a16, b16)) / _best_seconds(lambda: F.linear(a, b))
        matmul = _best_seconds(lambda: a16 @ b16) / _best_seconds(lambda: a @ b)
    return max(linear, matmul)


def _best_seconds(product, repeats: int = 10, budget_s: float = 0.02) -> float:
    """The fastest of `repeats` calls, or of 3 once they took `budget_s` (a product that slow,
    emulated bf16 say, is not one a preemption could make look fast)."""
    product()  # a first call may initialise the kernel
    best, spent = float("inf"), 0.0
    for done in range(repeats):
        if done >= 3 and spent > budget_s:
            break
        started = time.perf_counter()
        product()
        seconds = time.perf_counter() - started
        best, spent = min(best, seconds), spent + seconds
    return max(best, 1e-9)


def warn_if_bf16_is_emulated(what: str, instead: str = "fp32 runs at full speed here") -> None:
    """Log, before `what` starts (e.g. "training with bf16 autocast"), once per process, what
    bf16 products cost on this CPU where they are emulated, and what to do `instead`."""
    answer = bf16_products()
    if not answer and what not in _WARNED:
        _WARNED.add(what)
        logging.getLogger("qkv").warning(
            "%s: %s, so its matrix products will run that much slower than in fp32; %s",
            what, answer.reason, instead,
        )  # fmt: skip


_WARNED: set[str] = set()


@functools.cache
def compiler() -> Support:
    """Can torch.compile's CPU backend (inductor) build its C++ kernels here? It needs a C++
    compiler (`CXX`, or inductor's default, g++) and a Python that torch.compile supports."""
    if not torch._dynamo.is_dynamo_supported():
        return Support(False, "torch.compile does not support this Python version")
    candidates = [os.environ.get("CXX")] + list(torch._inductor.config.cpp.cxx)
    for name in candidates:
        if name and shutil.which(name):
            return Support(True, f"torch.compile builds C++ kernels with {shutil.which(name)}")
    return Support(
        False,
        "torch.compile needs a C++ compiler for CPU kernels and none was found "
        "(install g++, or point CXX at one)",
    )


def flex_attention_cpu() -> Support:
    """Can FlexAttention's compiled CPU kernel be built here? Inductor's CPU template for it
    needs AVX2 vectors (not the portable baseline that ATEN_CPU_CAPABILITY=default selects),
    Linux or Windows (not macOS), and a C++ compiler. Read each call: the variable may change."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return Support(False, "ATEN_CPU_CAPABILITY=default: FlexAttention's CPU kernel needs AVX2")
    if not torch.cpu._is_avx2_supported():
        return Support(False, "this CPU has no AVX2, which FlexAttention's CPU kernel needs")
    if sys.platform == "darwin":
        return Support(False, "FlexAttention's compiled CPU kernel does not build on macOS")
    build = compiler()
    if not build:
        return build
    return Support(True, "AVX2 vectors and a C++ compiler: FlexAttention compiles here")


def cpu_isa() -> dict[str, object]:
    """The CPU features PyTorch sees: the ISA its kernels dispatch to (after
    ATEN_CPU_CAPABILITY), AVX-512, AMX, and the oneDNN ISA cap if one is set."""
    cpu = torch.cpu
    return {
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "avx2": cpu._is_avx2_supported(),
        "avx512": cpu._is_avx512_supported(),
        "avx512_bf16": cpu._is_avx512_bf16_supported(),
        "amx": cpu._is_amx_tile_supported(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    }


def describe() -> str:
    """Every answer above, one line each, for a person (`qkv check` and bug reports)."""
    isa = cpu_isa()
    flags = ", ".join(f"{name}={value}" for name, value in isa.items() if value is not None)
    lines = [f"torch {torch.__version__}; CPU: {flags}; {torch.get_num_threads()} threads"]
    for dtype in (torch.float32, torch.bfloat16):
        answer = onednn_linear(dtype)
        lines.append(f"packed {dtype} linears: {'yes' if answer else 'no'} ({answer.reason})")
    answer = onednn_fp32_products()
    lines.append(f"oneDNN float32 linears: {'yes' if answer else 'no'} ({answer.reason})")
    answer = bf16_products()
    lines.append(f"fast bf16 products: {'yes' if answer else 'no'} ({answer.reason})")
    answer = compiler()
    lines.append(f"compiled decoding: {'yes' if answer else 'no'} ({answer.reason})")
    answer = flex_attention_cpu()
    lines.append(f"FlexAttention on the CPU: {'yes' if answer else 'no'} ({answer.reason})")
    return "\n".join(lines)
