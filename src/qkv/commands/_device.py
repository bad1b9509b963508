"""The --device flag, checked before any work: a device this PyTorch cannot use fails at once
with a message that says why, not with an assertion deep in torch after minutes of set-up."""

from __future__ import annotations

DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_device(device: str, allowed: tuple[str, ...] = DEVICE_TYPES) -> str:
    """`device` if this PyTorch can run on it, else ValueError("--device X: why; what to do")."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message lists every device type it knows
        raise ValueError(f"--device {device}: expected {_expected(allowed)}") from None
    if parsed.type not in allowed:
        raise ValueError(f"--device {device}: expected {_expected(allowed)}")
    if parsed.type == "cuda":
        _check_cuda(device, parsed.index)
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        reason = (
            "this PyTorch was built without MPS"
            if not torch.backends.mps.is_built()
            else "MPS needs macOS 12.3+ on Apple silicon"
        )
        raise ValueError(f"--device {device}: MPS is not available ({reason}); use --device cpu")
    return device


def _check_cuda(device: str, index: int | None) -> None:
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        raise ValueError(
            f"--device {device}: this PyTorch ({torch.__version__}) was built without CUDA; "
            "use --device cpu, or install a CUDA build of PyTorch"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: no CUDA GPU is visible to PyTorch {torch.__version__} "
            "(torch.cuda.is_available() is False: no GPU, its driver, or CUDA_VISIBLE_DEVICES); "
            "use --device cpu"
        )
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(
            f"--device {device}: expected a GPU index below {count} ({count} GPU(s) visible)"
        )


def _expected(allowed: tuple[str, ...]) -> str:
    names = [name for kind in allowed for name in ((kind, "cuda:N") if kind == "cuda" else (kind,))]
    return ", ".join(names[:-1]) + " or " + names[-1]
