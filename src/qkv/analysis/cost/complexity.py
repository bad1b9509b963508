"""Time and memory of attention against the sequence length L: the O(L^2) problem, measured.

The classic doubling benchmark times multi-head attention at L = 64 .. 2048, each L double the
last, and prints `seq_len, time (ms), mem (MB), ratio`: each doubling of the sequence length
multiplies the time by about 4, and the memory of the (L, L) attention matrix,
`seq_len * seq_len * n_heads * 4` bytes in fp32, grows the same way. Where such a table gives
that formula as its memory, here the peak is measured (`qkv.analysis.cost.memory.peak_bytes`) and
the formula is printed beside it. Three backends do the same work side by side:

    naive   `qkv.attention(backend="reference")`: eager math, materialises the (B, H, L, L) scores
    sdpa    `qkv.attention(backend="sdpa")`: PyTorch's fused `F.scaled_dot_product_attention`
    tiled   `qkv.attention(backend="tiled")`: `qkv.flash_attention`, online softmax, O(L) memory

A doubling of L multiplies an O(L^p) cost by 2^p (4x for p = 2). The exponent p is fitted as the
least-squares slope of log(cost) against log(L). Small L is dominated by fixed costs (Python and
dispatch overhead, tile-sized scratch buffers) that do not grow with L, so the fit uses only the
larger lengths (`fit_from`; by default the median length and above).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from qkv.analysis.cost.memory import peak_bytes
from qkv.attention import attention

logger = logging.getLogger(__name__)

# Our names for the benchmark's candidates -> the `qkv.attention` backend that runs each.
BACKENDS = {"naive": "reference", "sdpa": "sdpa", "tiled": "tiled"}
DEFAULT_LENGTHS = (256, 512, 1024, 2048)  # small enough for a CPU
DEFAULT_MAX_MEMORY = 4 * 2**30
# Live (B, H, L, L) score-sized tensors at the reference backend's peak, counted in fp32 (it
# computes scores and softmax in fp32 whatever the input dtype): scores, their masked copy (when
# anything masks) and the softmax output in forward; forward + backward keeps a few more (<= 4.7
# measured, in bf16).
NAIVE_SCORE_COPIES = {False: 3, True: 5}
_MIN_SAMPLE_S = 0.01  # a timed sample repeats a fast call until it lasts at least this long


@dataclass(frozen=True)
class ComplexityPoint:
    """One backend at one length: median seconds per call, peak bytes, ratios to the previous L.

    `skipped` says why a point was not measured (its predicted memory exceeds the budget); then
    `seconds` and `peak_bytes` are None. `score_bytes` is the textbook formula, B * H * L^2 * bytes.
    """

    backend: str
    length: int
    seconds: float | None
    peak_bytes: int | None
    score_bytes: int
    time_ratio: float | None = None
    memory_ratio: float | None = None
    skipped: str | None = None


@dataclass(frozen=True)
class ExponentFit:
    """Fitted p in cost ~ L^p for one backend, over the measured lengths >= `fit_from`."""

    backend: str
    time_exponent: float | None
    memory_exponent: float | None
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class ComplexitySettings:
    """What one run measures: self-attention on random (B, H, L, D) inputs, per backend and L."""

    batch: int
    heads: int
    head_dim: int
    causal: bool
    backward: bool
    dtype: str  # a torch dtype's name, e.g. "float32"
    device: str
    repeats: int
    max_memory: int  # bytes


@dataclass(frozen=True)
class ComplexityResult:
    """Every point of a run, in (backend, L) order, the fitted exponents, and the settings."""

    points: tuple[ComplexityPoint, ...]
    fits: tuple[ExponentFit, ...]
    backends: tuple[str, ...]
    lengths: tuple[int, ...]
    fit_from: int
    settings: ComplexitySettings

    def rows(self, backend: str) -> tuple[ComplexityPoint, ...]:
        """The points of one backend, by increasing L."""
        return tuple(p for p in self.points if p.backend == backend)

    def fit(self, backend: str) -> ExponentFit:
        return next(f for f in self.fits if f.backend == backend)

    def to_dict(self) -> dict:
        """Plain types only, ready for `json.dump`."""
        return asdict(self)


def fit_exponent(lengths: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of log(values) against log(lengths): p in value ~ c * L^p."""
    if len(lengths) != len(values) or len(lengths) < 2:
        raise ValueError(
            f"fit_exponent needs >= 2 (length, value) pairs of equal count, got "
            f"{len(lengths)} lengths and {len(values)} values"
        )
    if min(lengths) <= 0 or min(values) <= 0:
        raise ValueError(f"lengths and values must be > 0, got {list(lengths)}, {list(values)}")
    xs = [math.log(x) for x in lengths]
    ys = [math.log(y) for y in values]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError(f"lengths must not all be equal, got {list(lengths)}")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def score_bytes(*, batch: int, heads: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of one (B, H, L, L) score matrix: `seq_len * seq_len * n_heads * 4` in fp32."""
    return batch * heads * length * length * dtype.itemsize


def predicted_peak(
    backend: str,
    *,
    batch: int,
    heads: int,
    length: int,
    head_dim: int,
    dtype: torch.dtype,
    backward: bool,
) -> int | None:
    """Predicted peak bytes of a backend whose memory is O(L^2) (naive), None for O(L) ones.

    `NAIVE_SCORE_COPIES` fp32 (B, H, L, L) score matrices, plus four (B, H, L, D) tensors for
    the output and the gradients of q, k and v.
    """
    if backend != "naive":
        return None
    compute_dtype = torch.promote_types(dtype, torch.float32)
    scores = score_bytes(batch=batch, heads=heads, length=length, dtype=compute_dtype)
    rows = 4 * batch * heads * length * head_dim * compute_dtype.itemsize
    return NAIVE_SCORE_COPIES[backward] * scores + rows


def backend_function(backend: str, *, causal: bool) -> Callable[..., torch.Tensor]:
    """The call the benchmark times for `backend`: f(q, k, v) -> output (B, H, L, D)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    name = BACKENDS[backend]
    return lambda q, k, v: attention(q, k, v, causal=causal, backend=name)


def _make_call(fn: Callable[..., torch.Tensor], inputs: dict, backward: bool) -> Callable[[], None]:
    """One timed call: forward only (no autograd graph), or forward + backward."""
    q, k, v, grad_out = inputs["q"], inputs["k"], inputs["v"], inputs["grad_out"]
    if not backward:
        return lambda: fn(q, k, v)

    def forward_backward() -> None:
        fn(q, k, v).backward(grad_out)
        q.grad = k.grad = v.grad = None

    return forward_backward


def _sample(call: Callable[[], None], device: torch.device, number: int) -> float:
    """Seconds per call, averaged over `number` back-to-back calls, bracketed by synchronizes
    (CUDA kernels run asynchronously; the CPU runs eagerly)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        call()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / number


def _time_interleaved(
    calls: dict[str, Callable[[], None]], device: torch.device, repeats: int
) -> dict[str, float]:
    """Median seconds per call of each candidate, sampled round-robin so noise hits all alike.

    One warm-up call each (allocator, kernel selection) also sizes `number`, the calls per
    sample, so that a sample of a fast call is not lost in the timer's resolution.
    """
    numbers = {}
    for name, call in calls.items():
        warm_up = _sample(call, device, 1)
        numbers[name] = max(1, min(100, math.ceil(_MIN_SAMPLE_S / max(warm_up, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(_sample(call, device, numbers[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def _measure_length(
    length: int, backends: Sequence[str], settings: ComplexitySettings
) -> dict[str, tuple | str]:
    """(seconds, peak bytes) or a skip reason for each backend at one length."""
    B, H, D, backward = settings.batch, settings.heads, settings.head_dim, settings.backward
    device, dtype = torch.device(settings.device), getattr(torch, settings.dtype)
    inputs_bytes = 4 * B * H * length * D * dtype.itemsize  # q, k, v and grad_out
    if inputs_bytes > settings.max_memory:  # refused before they are allocated
        reason = (
            f"skipped: the inputs alone take {inputs_bytes / 1e6:.0f} MB > budget "
            f"{settings.max_memory / 1e6:.0f} MB (--max-memory)"
        )
        return dict.fromkeys(backends, reason)
    generator = torch.Generator(device=device).manual_seed(length)
    inputs = {
        name: torch.randn(B, H, length, D, generator=generator, device=device, dtype=dtype)
        for name in ("q", "k", "v", "grad_out")
    }
    for name in ("q", "k", "v"):
        inputs[name].requires_grad_(backward)
    calls, found = {}, {}
    for backend in backends:
        predicted = predicted_peak(
            backend, batch=B, heads=H, length=length, head_dim=D, dtype=dtype, backward=backward
        )
        if predicted is not None and predicted + inputs_bytes > settings.max_memory:
            found[backend] = (
                f"skipped: predicted peak {(predicted + inputs_bytes) / 1e6:.0f} MB (inputs "
                f"included) > budget {settings.max_memory / 1e6:.0f} MB (--max-memory)"
            )
            continue
        fn = backend_function(backend, causal=settings.causal)
        calls[backend] = _make_call(fn, inputs, backward)
    times = _time_interleaved(calls, device, settings.repeats)
    for backend, call in calls.items():
        found[backend] = (times[backend], peak_bytes(call, device))
    return found


def _points(
    backend: str, lengths: Sequence[int], measured: dict[int, dict], settings: ComplexitySettings
) -> list[ComplexityPoint]:
    """One backend's points by increasing L, each with its ratios to the previous measured L."""
    points, previous = [], None
    dtype = getattr(torch, settings.dtype)
    for length in lengths:
        formula = score_bytes(
            batch=settings.batch, heads=settings.heads, length=length, dtype=dtype
        )
        found = measured[length][backend]
        if isinstance(found, str):
            points.append(ComplexityPoint(backend, length, None, None, formula, skipped=found))
            previous = None
            continue
        seconds, peak = found
        time_ratio = seconds / previous[0] if previous else None
        memory_ratio = peak / previous[1] if previous and previous[1] > 0 else None
        points.append(
            ComplexityPoint(backend, length, seconds, peak, formula, time_ratio, memory_ratio)
        )
        previous = found
    return points


def _fit(backend: str, points: Sequence[ComplexityPoint], fit_from: int) -> ExponentFit:
    used = [p for p in points if p.skipped is None and p.length >= fit_from]
    lengths = [p.length for p in used]
    time_exponent = fit_exponent(lengths, [p.seconds for p in used]) if len(used) >= 2 else None
    positive = [p for p in used if p.peak_bytes > 0]
    memory_exponent = (
        fit_exponent([p.length for p in positive], [p.peak_bytes for p in positive])
        if len(positive) >= 2
        else None
    )
    return ExponentFit(backend, time_exponent, memory_exponent, tuple(lengths))


def _check_arguments(lengths, backends, batch, heads, head_dim, repeats, dtype) -> None:
    if not lengths or any(not isinstance(x, int) or x <= 0 for x in lengths):
        raise ValueError(f"lengths must be positive ints, got {list(lengths)}")
    for backend in backends:
        if backend not in BACKENDS:
            raise ValueError(f"backends must be among {sorted(BACKENDS)}, got {backend!r}")
    for name, value in (("batch", batch), ("heads", heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")


def measure_complexity(
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    backends: Sequence[str] = tuple(BACKENDS),
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    causal: bool = False,
    backward: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    max_memory: int = DEFAULT_MAX_MEMORY,
    fit_from: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ComplexityResult:
    """The doubling benchmark for naive, SDPA and tiled attention, with fitted exponents.

    Self-attention on random (B, H, L, D) inputs at each L; per backend and L, the median of
    `repeats` timed samples (after a warm-up) and the peak bytes allocated beyond the inputs.
    A backend whose predicted peak (`predicted_peak`, plus the inputs) exceeds `max_memory`
    bytes is skipped at that L, and the point says so; so is every backend at an L whose
    inputs alone exceed it, before they are allocated. `fit_from`: fit exponents over
    L >= fit_from only (default: the median length and above, since small L is dominated by
    fixed overhead).
    `progress(message)` is called after each length.
    """
    _check_arguments(lengths, backends, batch, heads, head_dim, repeats, dtype)
    lengths = tuple(sorted(set(lengths)))
    backends = tuple(dict.fromkeys(backends))
    dtype_name, device_name = str(dtype).removeprefix("torch."), str(torch.device(device))
    settings = ComplexitySettings(
        batch, heads, head_dim, causal, backward, dtype_name, device_name, repeats, max_memory
    )
    measured = {}
    for length in lengths:
        measured[length] = _measure_length(length, backends, settings)
        message = f"L={length}: " + ", ".join(
            f"{b} {v[0] * 1e3:.1f} ms" if isinstance(v, tuple) else f"{b} skipped"
            for b, v in measured[length].items()
        )
        logger.info(message)
        if progress is not None:
            progress(message)
    if fit_from is None:
        fit_from = lengths[(len(lengths) - 1) // 2] if len(lengths) > 2 else lengths[0]
    points = [p for b in backends for p in _points(b, lengths, measured, settings)]
    fits = tuple(_fit(b, [p for p in points if p.backend == b], fit_from) for b in backends)
    return ComplexityResult(tuple(points), fits, backends, lengths, fit_from, settings)
