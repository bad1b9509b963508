"""`qkv bench complexity`'s outputs: the doubling table (L, time, ratio, memory) and the log-log
plot of time and memory against L, from a `ComplexityResult` (`qkv.analysis.cost.complexity`)."""

from __future__ import annotations

from qkv.analysis.cost.complexity import ComplexityResult, ComplexitySettings

__all__ = ["format_table", "plot_complexity"]


def _describe(settings: ComplexitySettings) -> str:
    mode = "forward + backward" if settings.backward else "forward"
    return (
        f"(B, H, L, D) = ({settings.batch}, {settings.heads}, L, {settings.head_dim}), "
        f"{settings.dtype}, {'causal' if settings.causal else 'non-causal'}, {mode}, "
        f"{settings.device}, median of {settings.repeats}"
    )


def _ratio(value: float | None) -> str:
    return f"{value:.1f}x" if value is not None else ""


def format_table(result: ComplexityResult) -> str:
    """The doubling table (L, time, ratio, memory) per backend, plus memory's ratio, the L x L
    score formula beside the measured peak, and the fitted exponents."""
    lines = [_describe(result.settings)]
    header = (
        f"{'backend':>8} {'seq_len':>8} {'time (ms)':>10} {'ratio':>7} "
        f"{'mem (MB)':>10} {'ratio':>7} {'L*L (MB)':>10}"
    )
    lines.append(header)
    for backend in result.backends:
        for p in result.rows(backend):
            start = f"{backend:>8} {p.length:>8} "
            formula = f"{p.score_bytes / 1e6:>10.2f}"
            if p.skipped is not None:
                lines.append(start + f"{p.skipped}  (L*L {p.score_bytes / 1e6:.0f} MB)")
                continue
            lines.append(
                start + f"{p.seconds * 1e3:>10.2f} {_ratio(p.time_ratio):>7} "
                f"{p.peak_bytes / 1e6:>10.2f} {_ratio(p.memory_ratio):>7} {formula}"
            )
    lines.append("mem: measured peak beyond the inputs; L*L: the formula B*H*L*L*bytes")
    lines.append(
        f"fitted cost ~ L^p over L >= {result.fit_from} (smaller L is dominated by fixed "
        f"overhead; each doubling multiplies the cost by 2^p):"
    )
    for fit in result.fits:
        lines.append(
            f"{fit.backend:>8}  time L^{_exponent(fit.time_exponent)}  "
            f"memory L^{_exponent(fit.memory_exponent)}"
        )
    return "\n".join(lines)


def _exponent(value: float | None, missing: str = "? (fewer than 2 points)") -> str:
    return f"{value:.2f}" if value is not None else missing


def plot_complexity(result: ComplexityResult):
    """A matplotlib Figure: time and peak memory against L, log-log, one line per backend, the
    fitted exponent in each legend entry. Needs matplotlib (`pip install 'qkv[bench]'`)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullLocator
    except ImportError as error:
        raise ImportError(
            "plot_complexity needs matplotlib: pip install matplotlib (or pip install 'qkv[bench]')"
        ) from error
    figure = Figure(figsize=(10, 4), layout="constrained")
    panels = (
        ("seconds", 1e3, "time", "time per call (ms)"),
        ("peak_bytes", 1e-6, "memory", "peak memory (MB)"),
    )
    for axes, (field, unit, fitted, ylabel) in zip(figure.subplots(1, 2), panels, strict=True):
        for backend in result.backends:
            measured = [p for p in result.rows(backend) if p.skipped is None]
            exponent = getattr(result.fit(backend), f"{fitted}_exponent")
            axes.plot(
                [p.length for p in measured],
                [getattr(p, field) * unit for p in measured],
                marker="o",
                label=f"{backend} (L^{_exponent(exponent, missing='?')})",
            )
        axes.set_xscale("log", base=2)
        axes.set_xticks(result.lengths, labels=[str(length) for length in result.lengths])
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_yscale("log")
        axes.set_xlabel("sequence length L")
        axes.set_ylabel(ylabel)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(title=f"fit over L >= {result.fit_from}")
    figure.suptitle(_describe(result.settings), fontsize="small")
    return figure
