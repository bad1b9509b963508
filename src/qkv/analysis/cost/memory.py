"""Measured memory: the peak bytes a piece of code allocates, on the CPU as on a GPU.

On CUDA, PyTorch's allocator keeps the peak (`max_memory_allocated`). On the CPU it keeps none,
so the PyTorch profiler records every allocation and free (its `[memory]` events), and the peak
is the largest running sum of those, in time order.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Peak bytes allocated while `fn()` runs, beyond what was allocated when it started."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    _quiet_kineto()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _quiet_kineto() -> None:
    """Kineto, the profiler's back end, writes "USDT: ... profiler_start" and "profiler_stop"
    to stderr around every profile. It reads its log level from KINETO_LOG_LEVEL once, when the
    profiler first starts; 6 is above its highest level (USDT, 5), so it writes nothing. A level
    set by the user is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
