"""`auto` sends a device's tensors to the Triton kernels only after they pass their self-check
there (qkv.attention.triton.selfcheck): small calls compared with SDPA, once per device.

The kernels run on the GPU where there is one, else in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1), on smaller cases than the real check's; a kernel
that raises or computes wrong values fails the check by name, and a CUDA device the kernels
cannot run on (cuda:99, which no machine has) is passed over by `auto`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from qkv.attention.triton import backend, function, selfcheck

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
SMALL_CASES = (
    (torch.float16, {}, (1, 2, 2, 9, 9, 16)),
    (torch.bfloat16, {"causal": True}, (1, 2, 1, 7, 12, 16)),
    (torch.float32, {"window": 4, "lengths": (12, 10)}, (2, 2, 1, 12, 12, 16)),
)


@pytest.fixture
def fresh(monkeypatch):
    """No verdict yet, and the small cases."""
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    monkeypatch.setattr(selfcheck, "CASES", SMALL_CASES)
    return monkeypatch


def _cuda_request(plain=False):
    """What `why_not_auto` reads of a call on the tensors of CUDA device 99 (none has it): by
    default one with something for the kernels to skip or fuse (a window, say)."""
    return SimpleNamespace(q=SimpleNamespace(device=torch.device("cuda", 99)), plain=plain)


def test_the_kernels_pass_their_self_check_and_the_verdict_is_kept(fresh):
    calls = []
    real = function.triton_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    fresh.setattr(function, "triton_attention", counted)
    assert selfcheck.self_check(DEVICE) is None
    assert len(calls) == len(SMALL_CASES)
    assert selfcheck.self_check(DEVICE) is None
    assert len(calls) == len(SMALL_CASES)  # once per device
    assert selfcheck.verdicts() == {str(DEVICE): None}


def test_wrong_values_fail_the_check_by_name(fresh):
    real = function.triton_attention

    def off(*args, **kwargs):
        return real(*args, **kwargs) * 1.01

    fresh.setattr(function, "triton_attention", off)
    failed = selfcheck.self_check(DEVICE)
    assert failed.startswith("the self-check (float16 plain) gave output off by")


def test_a_kernel_that_raises_fails_the_check_by_name(fresh):
    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory\nmore")

    fresh.setattr(function, "triton_attention", broken)
    failed = selfcheck.self_check(DEVICE)
    assert failed == (
        "the self-check (float16 plain) raised RuntimeError: out of resources: shared memory"
    )


def test_auto_passes_over_the_kernels_on_a_device_where_the_check_fails(fresh):
    reason = backend.why_not_auto(_cuda_request())
    assert reason.startswith("its self-check against SDPA on cuda:99 did not pass")
    assert "cuda:99" in selfcheck.verdicts()


def test_auto_takes_the_kernels_on_a_device_where_the_check_passed(fresh):
    fresh.setitem(selfcheck._VERDICTS, "cuda:99", None)
    assert backend.why_not_auto(_cuda_request()) is None
    # a plain call stays with PyTorch's fused kernels, checked or not
    assert backend.why_not_auto(_cuda_request(plain=True)).startswith("a plain call")
