"""What this CPU and this PyTorch build can do, asked before any fast path is taken.

qkv's CPU speed-ups (oneDNN-packed linears, their bf16 copies under autocast, compiled decoding
steps) depend on things a machine may lack: oneDNN's bf16 kernels need AVX512-BW/VL/DQ or
AVX-NE-CONVERT, an ARM build may have no packed-linear ops at all, and torch.compile's CPU
backend needs a C++ compiler. Each question here is answered once per process, by asking
PyTorch and the CPU's feature flags and, where PyTorch's own answer can be wrong (a CPU feature
masked with `ONEDNN_MAX_CPU_ISA`), by running the operation once on a tiny input. A fast path
that is not supported falls back to the plain PyTorch operation, with the same results.

Which kernel computes a result is decided from these facts alone, never from a timing taken in
the process: a timing differs between two processes on a busy machine, the kernels round
differently, and a training run resumed after a kill would no longer end on the weights of a
run never killed. `kernel_choices` names the choices that change bits; a training checkpoint
records them, and `kernels_as` pins them for the run resumed from it.

    print(qkv.capabilities.describe())   # the whole picture, in words

The answers honour the variables that mask CPU features, so the fallbacks can be tested on any
machine: `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN) and `ATEN_CPU_CAPABILITY=avx2` or `default`
(PyTorch's own vectorised kernels, and the ISA inductor compiles for).
"""

from __future__ import annotations

import contextlib
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
    "best_seconds",
    "bf16_slowdown",
    "compiler",
    "cpu_flags",
    "cpu_isa",
    "cpu_vendor",
    "describe",
    "flex_attention_cpu",
    "kernel_choices",
    "kernels_as",
    "onednn_allows",
    "onednn_fp32_products",
    "onednn_linear",
    "warn_if_bf16_is_emulated",
]


@dataclass(frozen=True)
class Support:
    """An answer: whether a fast path can run here, and why (or why not), in words."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@functools.cache
def onednn_linear(dtype: torch.dtype) -> Support:
    """Can oneDNN pack a linear weight of `dtype` and multiply with it on this CPU, by the facts:
    oneDNN in the build, and for bf16 the CPU features its bf16 kernels need (within
    ONEDNN_MAX_CPU_ISA). `qkv.acceleration.onednn_probe.packed_products` proves it on a tiny
    product before anything is packed."""
    if dtype not in (torch.float32, torch.bfloat16):
        return Support(False, f"oneDNN packing serves float32 and bfloat16, not {dtype}")
    if not torch.backends.mkldnn.is_available():
        return Support(False, "this PyTorch build has no oneDNN (torch.backends.mkldnn)")
    if dtype == torch.bfloat16 and not _onednn_bf16_isa():
        return Support(
            False, "oneDNN's bf16 kernels need AVX512-BW/VL/DQ or AVX-NE-CONVERT on this CPU"
        )
    return Support(True, f"oneDNN packs {dtype} weights on this CPU")


def _onednn_bf16_isa() -> bool:
    """Does this CPU have what oneDNN's bf16 kernels need (AVX512-BW/VL/DQ, AVX-NE-CONVERT, or
    Arm's BF16), by its flags?"""
    flags = cpu_flags()
    avx512 = {"avx512bw", "avx512vl", "avx512dq"} <= flags and onednn_allows("AVX512_CORE")
    arm = "bf16" in flags and not cpu_vendor()
    return avx512 or ("avx_ne_convert" in flags and onednn_allows("AVX2_VNNI_2")) or arm


# oneDNN's ISA names in oneDNN's own order (ONEDNN_MAX_CPU_ISA caps its kernels at one of them).
ONEDNN_ISAS = (
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16",
)  # fmt: skip
# CPU vendors on which PyTorch's MKL runs its AVX2 code even where the CPU has AVX-512, which
# oneDNN uses: its float32 products take 0.43x MKL's time on an AMD EPYC with AVX-512. Without
# AVX-512 there is no such gap (on a Zen 3 EPYC with AVX2 only: 0.75-0.95x on large products,
# 1.1-3x on a small model's), so oneDNN is chosen with AVX-512 only. `qkv check` measures the
# ratio on the machine at hand.
ONEDNN_FP32_VENDORS = ("AuthenticAMD", "HygonGenuine")


def onednn_allows(isa: str) -> bool:
    """Does ONEDNN_MAX_CPU_ISA (unset: no cap) let oneDNN use `isa`, one of ONEDNN_ISAS?"""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper()
    if cap not in ONEDNN_ISAS:  # ALL, DEFAULT, or a name oneDNN ignores
        return True
    return ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


@functools.cache
def cpu_vendor() -> str:
    """The x86 vendor string ("AuthenticAMD", "GenuineIntel", ...) where the OS tells it, else
    "" (another architecture, or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


# Kernel choices pinned by `kernels_as` (a resumed training run takes its checkpoint's).
_PINNED: dict[str, bool] = {}


def onednn_fp32_products() -> Support:
    """Do float32 linears run on oneDNN's kernels here (qkv.acceleration.speed_up)? Decided from
    what the CPU and the build are, never from a timing, so every process on a machine makes the
    same choice and computes the same bits: oneDNN packs float32 (`onednn_linear`), the CPU's
    vendor is one where MKL keeps to its AVX2 code (ONEDNN_FP32_VENDORS), and oneDNN may use
    AVX-512. `kernels_as` can pin the answer."""
    support = onednn_linear(torch.float32)
    pinned = _PINNED.get("onednn_fp32_linears")
    if pinned is not None:
        if pinned and not support:
            return support
        return Support(pinned, "pinned by kernels_as (a resumed run keeps its kernels)")
    return _onednn_fp32_products_here()


@functools.cache
def _onednn_fp32_products_here() -> Support:
    support = onednn_linear(torch.float32)
    if not support:
        return support
    vendor = cpu_vendor() or "unknown"
    if vendor not in ONEDNN_FP32_VENDORS:
        return Support(False, f"F.linear (MKL) on this {vendor} CPU: oneDNN is used on AMD's")
    if not ("avx512f" in cpu_flags() and onednn_allows("AVX512_CORE")):
        return Support(False, "F.linear: oneDNN's float32 products are chosen with AVX-512 only")
    return Support(True, f"oneDNN's float32 products on this {vendor} CPU with AVX-512")


def bf16_products() -> Support:
    """Are bf16 matrix products (several rows: a prefill, training under autocast) native on
    this CPU, not emulated through fp32? Decided from the CPU's features and oneDNN's ISA cap
    (AVX512-BF16, AMX or AVX-NE-CONVERT on x86-64; BF16 on Arm), never from a timing:
    `bf16_slowdown` measures what the answer means. One row (a decoding step) is not asked
    about: PyTorch's own kernel reads bf16 fast on any CPU. `kernels_as` can pin the answer."""
    pinned = _PINNED.get("native_bf16_products")
    if pinned is not None:
        return Support(pinned, "pinned by kernels_as (a resumed run keeps its kernels)")
    return _bf16_products_here()


@functools.cache
def _bf16_products_here() -> Support:
    flags = cpu_flags()
    native = [
        name
        for name, present, isa in (
            ("AVX512-BF16", "avx512_bf16" in flags, "AVX512_CORE_BF16"),
            ("AMX", "amx_tile" in flags, "AVX512_CORE_AMX"),
            ("AVX-NE-CONVERT", "avx_ne_convert" in flags, "AVX2_VNNI_2"),
        )
        if present and onednn_allows(isa)
    ]
    if "bf16" in flags and not cpu_vendor():  # Arm's BFMMLA/BFDOT (Features: ... bf16)
        native.append("Arm BF16")
    if not native:
        return Support(
            False,
            "bf16 matrix products are emulated through fp32 on this CPU "
            "(no AVX512-BF16, AMX or AVX-NE-CONVERT that oneDNN may use)",
        )
    return Support(True, f"bf16 matrix products run natively here ({', '.join(native)})")


def kernel_choices() -> dict[str, bool]:
    """The choices above that decide a result's bits, by name: a training checkpoint records
    them, and a run resumed from it computes with the same ones (`kernels_as`)."""
    return {
        "onednn_fp32_linears": bool(onednn_fp32_products()),
        "native_bf16_products": bool(bf16_products()),
    }


@contextlib.contextmanager
def kernels_as(choices: dict | None):
    """Within the block, `onednn_fp32_products` and `bf16_products` answer as `choices` says
    (a `kernel_choices()` dict; None or {} pins nothing), where this machine can compute so:
    a run resumed on another machine keeps the kernels of the one that wrote its checkpoint.
    A choice this machine cannot follow (oneDNN missing) is logged, and the run goes on."""
    choices = {name: bool(value) for name, value in (choices or {}).items() if name in _KERNELS}
    previous = dict(_PINNED)
    _PINNED.update(choices)
    try:
        wanted, got = choices, {name: kernel_choices()[name] for name in choices}
        if got != wanted:
            logging.getLogger("qkv").warning(
                "the kernels %s cannot be used on this machine (%s instead): results will differ "
                "from the run that chose them in the last bits", wanted, got,
            )  # fmt: skip
        yield
    finally:
        _PINNED.clear()
        _PINNED.update(previous)


_KERNELS = ("onednn_fp32_linears", "native_bf16_products")


def bf16_slowdown() -> float:
    """bf16 time over fp32 time of a (256, 256) x (256, 256) product, the slower of F.linear
    (a model's linears) and matmul (attention's products, which can take another path), each
    the best of ten, outside any autocast region: what `bf16_products` means here, for
    `describe` and benchmarks only."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=generator)
    b = torch.randn(256, 256, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        linear = best_seconds(lambda: F.linear(a16, b16)) / best_seconds(lambda: F.linear(a, b))
        matmul = best_seconds(lambda: a16 @ b16) / best_seconds(lambda: a @ b)
    return max(linear, matmul)


def best_seconds(product, repeats: int = 10, budget_s: float = 0.02) -> float:
    """The fastest of `repeats` calls, or of 3 once they took `budget_s`."""
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
    compiler: `CXX`, or g++, clang++ or c++ on the PATH."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
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
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return Support(False, "this CPU has no AVX2, which FlexAttention's CPU kernel needs")
    if sys.platform == "darwin":
        return Support(False, "FlexAttention's compiled CPU kernel does not build on macOS")
    build = compiler()
    if not build:
        return build
    return Support(True, "AVX2 vectors and a C++ compiler: FlexAttention compiles here")


def cpu_isa() -> dict[str, object]:
    """The CPU features that decide the kernels: the ISA PyTorch's kernels dispatch to (after
    ATEN_CPU_CAPABILITY), AVX2, AVX-512, AVX512-BF16, AMX (from /proc/cpuinfo's flags), and
    the oneDNN ISA cap if one is set."""
    flags = cpu_flags()
    return {
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_tile" in flags,
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
    slowdown = f"; measured now: {bf16_slowdown():.1f}x fp32's time"
    lines.append(f"fast bf16 products: {'yes' if answer else 'no'} ({answer.reason}{slowdown})")
    answer = compiler()
    lines.append(f"compiled decoding: {'yes' if answer else 'no'} ({answer.reason})")
    answer = flex_attention_cpu()
    lines.append(f"FlexAttention on the CPU: {'yes' if answer else 'no'} ({answer.reason})")
    return "\n".join(lines)
