"""Timing helpers shared by the scripts in `benchmarks/`, and the record of the machine.

The rules these helpers enforce:
- candidates are timed in the same process, interleaved round by round (and in a rotating order
  within a round), so that machine noise and thermal drift hit all of them equally;
- every sample is bracketed by a device synchronize (CUDA kernels are asynchronous);
- warm-up calls are made and discarded first (allocator, kernel selection, lazy init);
- a sample repeats a fast call `number` times so that one sample is never shorter than
  `min_sample_s` (timer resolution and synchronize overhead stay negligible);
- the figure reported is the median over samples, with the min and interquartile range beside it;
- throughput is reported against a measured hardware proxy (the matmul rate of the same dtype),
  never against an absolute time, since the machines are shared;
- every result file records the machine and the command that produced it (`machine_info`):
  CPU model, the ISA flags that decide which kernels run, threads, torch and Python versions.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device: str | torch.device) -> None:
    """Wait for every queued kernel on `device` (a no-op on the CPU, which runs eagerly)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def log(message: str) -> None:
    """Progress notes go to stderr, so that stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


@dataclass
class Timing:
    """Seconds per call of one candidate: every sample, and the statistics reported from them."""

    samples: list[float]
    number: int  # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def iqr(self) -> float:
        """Interquartile range (0 with fewer than 4 samples): the noise to read a ratio against."""
        if len(self.samples) < 4:
            return 0.0
        lower, _, upper = statistics.quantiles(self.samples, n=4)
        return upper - lower

    def as_dict(self) -> dict:
        return {
            "median_ms": self.median * 1e3,
            "min_ms": self.min * 1e3,
            "iqr_ms": self.iqr * 1e3,
            "number": self.number,
            "samples_ms": [s * 1e3 for s in self.samples],
        }


def _time_once(fn: Callable[[], object], device: str, number: int) -> float:
    """Seconds per call of `fn`, averaged over `number` back-to-back calls."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / number


def time_interleaved(
    candidates: dict[str, Callable[[], object]],
    *,
    device: str,
    warmup: int = 2,
    repeats: int = 10,
    min_repeats: int = 3,
    budget_s: float | None = None,
    min_sample_s: float = 2e-3,
) -> dict[str, Timing]:
    """Time several candidates side by side; returns {name: Timing} in seconds per call.

    Each round calls every candidate once (one sample each), the order rotating from round to
    round. The number of rounds is `repeats`, lowered to fit `budget_s` seconds of timed rounds
    (estimated from the last warm-up call) but never below `min_repeats`.
    """
    names = list(candidates)
    estimate = dict.fromkeys(names, 0.0)
    for _ in range(max(1, warmup)):
        for name in names:
            estimate[name] = _time_once(candidates[name], device, 1)
    number = {n: max(1, math.ceil(min_sample_s / max(estimate[n], 1e-9))) for n in names}
    rounds = repeats
    if budget_s is not None:
        round_s = sum(estimate[n] * number[n] for n in names)
        rounds = min(repeats, int(budget_s / max(round_s, 1e-9)))
    rounds = max(min_repeats, rounds)
    samples: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing in one candidate's sample is noise, not its cost
    try:
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                samples[name].append(_time_once(candidates[name], device, number[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {n: Timing(samples[n], number[n]) for n in names}


def matmul_rate(dtype: torch.dtype, device: str, *, n: int = 2048, repeats: int = 10) -> dict:
    """Measured FLOP/s of an (n, n) @ (n, n) matmul (2 n^3 FLOPs per call).

    The practical ceiling for compute-bound kernels of this dtype on this machine: the faster of
    torch.mm and, on a CPU whose PyTorch has it, oneDNN's product (PyTorch's fp32 torch.mm is
    MKL's, which on some CPUs reaches half of what oneDNN does: an AMD EPYC with AVX-512).
    Returns {"peak": from the fastest sample (noise only ever slows a call, so the fastest sample
    is the best estimate of a limit), "median": from the median sample of the faster kernel},
    both in FLOP/s, and {"kernel": which one that was}.
    """
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    candidates = {"torch.mm": lambda: torch.mm(a, b)}
    if device == "cpu" and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        b_t = b.t().contiguous()  # (out, in), the layout of a linear weight
        candidates["oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(
            a, b_t, None, "none", [], ""
        )
    timings = time_interleaved(
        candidates, device=device, warmup=2, repeats=repeats, min_repeats=repeats
    )
    kernel = min(timings, key=lambda name: timings[name].min)
    flops = 2 * n**3
    return {
        "peak": flops / timings[kernel].min,
        "median": flops / timings[kernel].median,
        "kernel": kernel,
    }


# The CPU features that decide which kernels PyTorch runs (MKL, oneDNN, inductor's C++): x86
# names as in /proc/cpuinfo's "flags", ARM names as in its "Features" (asimd is NEON on aarch64).
ISA_FLAGS = (
    "fma",
    "f16c",
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "neon",
    "asimd",
    "asimdhp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)
# macOS on Apple silicon: sysctl names of the same features
_DARWIN_ARM_FLAGS = {
    "hw.optional.neon": "neon",
    "hw.optional.arm.FEAT_FP16": "asimdhp",
    "hw.optional.arm.FEAT_BF16": "bf16",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
}


def _cpuinfo() -> dict[str, str]:
    """The first value of each key of /proc/cpuinfo (Linux), keys lowercased; {} elsewhere."""
    found: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            found.setdefault(key.strip().lower(), value.strip())
    return found


def _sysctl(*names: str) -> str | None:
    """`sysctl -n NAME...` (macOS, BSD), or None where there is none or it fails."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", *names], capture_output=True, text=True, check=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def cpu_model() -> str:
    """The CPU's model name, as lscpu shows it ('model name' in /proc/cpuinfo on Linux; the
    brand string on macOS; else what the platform module knows)."""
    info = _cpuinfo()
    for key in ("model name", "hardware", "processor", "cpu model"):
        value = info.get(key, "")
        if value and not value.isdigit():  # "processor : 0" on x86 is a CPU index
            return value
    if platform.system() == "Darwin":
        brand = _sysctl("machdep.cpu.brand_string")
        if brand:
            return brand
    return platform.processor() or platform.machine() or "unknown"


def isa_flags() -> list[str] | None:
    """Those of ISA_FLAGS this CPU has, in ISA_FLAGS' order; None where they cannot be read
    (then a reader must not take a flag's absence for the CPU's lack of it)."""
    info = _cpuinfo()
    line = info.get("flags") or info.get("features")
    if line is not None:
        present = set(line.lower().split())
    elif platform.system() == "Darwin":
        if platform.machine() == "arm64":
            present = {
                flag
                for name, flag in _DARWIN_ARM_FLAGS.items()
                if (_sysctl(name) or "0").strip() == "1"
            }
        else:
            features = _sysctl("machdep.cpu.features", "machdep.cpu.leaf7_features")
            if features is None:
                return None
            present = set(features.lower().replace(".", "_").split())
    else:
        return None
    return [flag for flag in ISA_FLAGS if flag in present]


def torch_cpu_capability() -> str | None:
    """The CPU kernel level PyTorch dispatches to ("AVX2", "AVX512", "DEFAULT", ...)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: above ~0.5, something else competes for the CPU."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: str) -> dict:
    """Where the numbers came from: enough to tell whether two result files are comparable, and
    to run the same command again. Every benchmark script writes it as its JSON's "machine".

    The CPU is recorded by its model, the ISA flags that decide which kernels run (`isa_flags`,
    None where they cannot be read; `isa_flags_checked` lists the flags looked for, so that an
    absent one is absent from the CPU) and PyTorch's own dispatch level; the threads are
    torch.get_num_threads(); the command is the interpreter's name and sys.argv.
    """
    dev = torch.device(device)
    info = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "argv": list(sys.argv),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model(),
        "cpu_model": cpu_model(),
        "isa_flags": isa_flags(),
        "isa_flags_checked": list(ISA_FLAGS),
        "torch_cpu_capability": torch_cpu_capability(),
        "arch": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "load_average": load_average(),
    }
    if dev.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        info["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return info


def format_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """An aligned plain-text table: text columns left-aligned, numbers right-aligned."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [
        all(_looks_numeric(str(row[i])) for row in rows) if rows else False
        for i in range(len(header))
    ]

    def line(row: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(row, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _looks_numeric(text: str) -> bool:
    text = text.rstrip("%x!* ").strip()
    try:
        float(text)
    except ValueError:
        return text in ("", "-", "n/a")
    return True


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(obj: object) -> object:
    if isinstance(obj, Timing):
        return obj.as_dict()
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def try_import_pyplot():
    """matplotlib.pyplot (Agg backend), or None with a logged note: plots are optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("note: matplotlib is not installed; skipping the plot (pip install -e '.[bench]')")
        return None
    return plt
