"""The NumPy lab's timings (`qkv.studies.numpy_lab`): a NumPy forward against a PyTorch one,
each the median of repeated runs after a warm-up, both on one thread: `torch.set_num_threads(1)`,
and threadpoolctl's limit on NumPy's BLAS where threadpoolctl is installed. On a busy machine,
threads that wait for each other would otherwise swamp calls this small.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

__all__ = ["blas_limited", "median_times", "one_thread"]


def median_times(numpy_forward: Callable, torch_forward: Callable, repeats: int) -> list[float]:
    """Median milliseconds of each forward after one warm-up run, torch without autograd, both
    on one thread (`one_thread`)."""
    medians = []
    with one_thread(), torch.no_grad():
        for forward in (numpy_forward, torch_forward):
            forward()
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                forward()
                runs.append((time.perf_counter() - started) * 1e3)
            medians.append(statistics.median(runs))
    return medians


@contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch, and NumPy's BLAS, on one thread while inside; both restored on leaving."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _numpy_blas_threads(1):
            yield
    finally:
        torch.set_num_threads(threads)


def _numpy_blas_threads(limit: int):
    """threadpoolctl's limit on NumPy's BLAS threads, or, without threadpoolctl, a context that
    changes nothing (`numpy_blas_limited` in the result says which)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return nullcontext()
    return threadpool_limits(limits=limit, user_api="blas")


def blas_limited() -> bool:
    """Whether `one_thread` limits NumPy's BLAS too (threadpoolctl is installed)."""
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return False
    return True
