"""The Triton kernels' self-check: `auto` routes a device's tensors to them only once they have
computed, on that device, what PyTorch's SDPA computes.

A kernel compiled for a GPU it was never run on can fail in ways no test elsewhere shows: a
launch the device refuses, a precision path (bf16) the interpreter never takes, wrong results.
So before `auto` picks the `triton` backend on a device, a few small calls run there (fp16,
bf16 and fp32; plain, causal with GQA, windowed with ragged lengths), forward and backward,
each compared with SDPA on the same inputs in float32: the error may be at most twice SDPA's
own at the same precision plus a floor (the tolerance rule of qkv's tests). The verdict is
kept per device for the process, and `qkv.explain` says it. Until then, and wherever it fails,
`auto` takes SDPA or FlexAttention; `backend="triton"` still runs the kernels when asked.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from qkv.attention.triton import function

__all__ = ["CASES", "self_check", "verdicts"]

logger = logging.getLogger(__name__)

# (dtype, options, (B, H, H_kv, L_q, L_k, D)): small, but across the kernels' branches; the
# lengths leave every query row a key inside its window (SDPA gives NaN for an empty row)
CASES = (
    (torch.float16, {}, (1, 2, 2, 37, 37, 32)),
    (torch.bfloat16, {"causal": True}, (2, 4, 2, 64, 80, 64)),
    (torch.float32, {"window": 9, "lengths": (70, 66)}, (2, 2, 1, 70, 70, 16)),
)
_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}

_VERDICTS: dict[str, str | None] = {}  # device -> None (passed) or why it failed


def verdicts() -> dict[str, str | None]:
    """The self-checks run so far in this process: device -> None (passed) or the failure."""
    return dict(_VERDICTS)


def self_check(device: torch.device) -> str | None:
    """None when the kernels computed what SDPA computes on `device`, else why not; run once
    per device and remembered. Under torch.compile (no kernel may be launched while tracing)
    a device not yet checked counts as failed for that trace."""
    key = str(device)
    if key not in _VERDICTS:
        if torch.compiler.is_compiling():  # no kernel may be launched while a graph is traced
            return "not self-checked on this device yet (no check runs under torch.compile)"
        _VERDICTS[key] = _run_cases(torch.device(device))
        if _VERDICTS[key] is None:
            logger.info("the Triton attention kernels passed their self-check on %s", key)
        else:
            logger.warning("the Triton attention kernels are not used on %s: %s", key,
                           _VERDICTS[key])  # fmt: skip
    return _VERDICTS[key]


def _run_cases(device: torch.device) -> str | None:
    generator = torch.Generator().manual_seed(0)
    for dtype, options, shape in CASES:
        where = f"{str(dtype).removeprefix('torch.')} {options or 'plain'}"
        try:
            inputs = _inputs(shape, generator)
            ours = _output_and_grads(function.triton_attention, inputs, dtype, device, options)
            theirs = _output_and_grads(_sdpa, inputs, dtype, device, options)
            exact = _output_and_grads(_sdpa, inputs, torch.float64, "cpu", options)
        except Exception as error:  # noqa: BLE001 - any failure means: not on this device
            first_line = (str(error).strip().splitlines() or [""])[0]
            return f"the self-check ({where}) raised {type(error).__name__}: {first_line}"
        for name, got, pytorch, truth in zip(("output", "dq", "dk", "dv"), ours, theirs, exact,
                                             strict=True):  # fmt: skip
            error = (got.double().cpu() - truth).abs().max().item()
            allowed = 2 * (pytorch.double().cpu() - truth).abs().max().item() + _FLOOR[dtype]
            if not error <= allowed:  # NaN fails too
                return (
                    f"the self-check ({where}) gave {name} off by {error:.3g}, more than twice "
                    f"SDPA's error plus {_FLOOR[dtype]:g} ({allowed:.3g})"
                )
    return None


def _inputs(shape: tuple, generator: torch.Generator) -> list[torch.Tensor]:
    B, H, H_kv, L_q, L_k, D = shape
    q = torch.randn(B, H, L_q, D, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, L_k, D, generator=generator, dtype=torch.float64) for _ in "kv")
    grad = torch.randn(B, H, L_q, D, generator=generator, dtype=torch.float64)
    return [q, k, v, grad]


def _output_and_grads(attend, inputs, dtype, device, options) -> list[torch.Tensor]:
    q, k, v, grad = (t.to(device=device, dtype=dtype) for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if "lengths" in options:
        options = {**options, "lengths": torch.tensor(options["lengths"], device=device)}
    output = attend(q, k, v, **options)
    return [output.detach(), *torch.autograd.grad(output, (q, k, v), grad)]


def _sdpa(q, k, v, *, causal=False, window=None, lengths=None) -> torch.Tensor:
    """PyTorch's SDPA with the same visibility, from a boolean mask (True: may attend)."""
    L_q, L_k = q.shape[-2], k.shape[-2]
    query = torch.arange(L_q, device=q.device)[:, None] + (L_k - L_q)  # aligned bottom-right
    key = torch.arange(L_k, device=q.device)[None, :]
    visible = torch.ones(L_q, L_k, dtype=torch.bool, device=q.device)
    if causal or window is not None:
        visible &= key <= query
    if window is not None:
        visible &= key > query - window
    mask = visible.expand(q.shape[0], 1, L_q, L_k)
    if lengths is not None:
        mask = mask & (key < lengths[:, None, None, None])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
