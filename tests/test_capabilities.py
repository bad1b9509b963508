"""qkv.capabilities chooses kernels from what the CPU and the build are, never from a timing:
the answers follow the CPU's vendor, its features and oneDNN's ISA cap, the same in every
process however busy the machine, and `kernels_as` pins them for a resumed run."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from qkv import capabilities
from qkv.capabilities import Support


@pytest.fixture
def fresh_answers(monkeypatch):
    """Each answer computed anew under the facts a test sets, and cleared again after it."""
    cached = (capabilities._onednn_fp32_products_here, capabilities._bf16_products_here)
    for function in cached:
        function.cache_clear()
    monkeypatch.setattr(capabilities, "onednn_linear", lambda dtype: Support(True, "packs"))
    yield monkeypatch
    for function in cached:
        function.cache_clear()


def _cpu(monkeypatch, *, vendor="AuthenticAMD", avx512=True, bf16=False, amx=False, flags=()):
    """A CPU of these facts, as /proc/cpuinfo would list them."""
    named = {"avx512f": avx512, "avx512_bf16": bf16, "amx_tile": amx}
    listed = set(flags) | {flag for flag, present in named.items() if present}
    monkeypatch.setattr(capabilities, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(capabilities, "cpu_flags", lambda: frozenset(listed))


def _cap(monkeypatch, cap: str | None) -> None:
    """oneDNN capped at `cap` (ONEDNN_MAX_CPU_ISA), or not capped."""
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)


@pytest.mark.parametrize(
    ("vendor", "avx512", "cap", "chosen"),
    [
        ("AuthenticAMD", True, None, True),
        ("HygonGenuine", True, "ALL", True),
        ("AuthenticAMD", True, "AVX2", False),  # make test-masked: oneDNN capped below AVX-512
        ("AuthenticAMD", False, None, False),  # a Zen 3 EPYC: no gap without AVX-512
        ("GenuineIntel", True, None, False),  # MKL's own CPU
        ("", True, None, False),  # unknown (Arm, no /proc/cpuinfo)
    ],
)
def test_onednn_fp32_linears_follow_the_cpu(fresh_answers, vendor, avx512, cap, chosen):
    _cpu(fresh_answers, vendor=vendor, avx512=avx512)
    _cap(fresh_answers, cap)
    answer = capabilities.onednn_fp32_products()
    assert bool(answer) is chosen, answer.reason


@pytest.mark.parametrize(
    ("facts", "cap", "native"),
    [
        ({"bf16": True}, None, True),
        ({"amx": True}, None, True),
        ({"flags": ("avx2", "avx_ne_convert")}, None, True),
        ({"bf16": True}, "AVX512_CORE", False),  # masked below AVX512_CORE_BF16
        ({"bf16": True}, "AVX2", False),
        ({}, None, False),
        ({"vendor": "", "avx512": False, "flags": ("fp", "asimd", "bf16")}, None, True),  # Arm
    ],
)
def test_bf16_products_follow_the_cpu(fresh_answers, facts, cap, native):
    _cpu(fresh_answers, **facts)
    _cap(fresh_answers, cap)
    answer = capabilities.bf16_products()
    assert bool(answer) is native, answer.reason


def test_no_kernel_choice_reads_a_clock(fresh_answers):
    """The choices are made with the clock unavailable: no timing can decide them."""

    def no_clock():
        raise AssertionError("a kernel choice read the clock")

    fresh_answers.setattr(time, "perf_counter", no_clock)
    fresh_answers.setattr(time, "monotonic", no_clock)
    choices = capabilities.kernel_choices()
    assert set(choices) == {"onednn_fp32_linears", "native_bf16_products"}
    assert all(isinstance(value, bool) for value in choices.values())


def test_the_choices_on_this_machine_are_those_its_facts_give():
    """On the machine at hand (and under make test-masked's caps): the same rule, unmocked, and
    /proc/cpuinfo's flags say what PyTorch's own CPU probes say."""
    amd = capabilities.cpu_vendor() in capabilities.ONEDNN_FP32_VENDORS
    wide = torch.cpu._is_avx512_supported() and capabilities.onednn_allows("AVX512_CORE")
    onednn = bool(capabilities.onednn_linear(torch.float32))
    if capabilities.cpu_flags():  # Linux
        assert ("avx512f" in capabilities.cpu_flags()) is torch.cpu._is_avx512_supported()
        assert ("avx2" in capabilities.cpu_flags()) is torch.cpu._is_avx2_supported()
    assert capabilities.kernel_choices()["onednn_fp32_linears"] is (onednn and amd and wide)
    native = torch.cpu._is_avx512_bf16_supported() and capabilities.onednn_allows(
        "AVX512_CORE_BF16"
    )
    if native:
        assert capabilities.kernel_choices()["native_bf16_products"]
    if not capabilities.onednn_allows("AVX512_CORE"):
        assert not capabilities.kernel_choices()["native_bf16_products"]


def test_kernels_as_pins_the_choices_and_restores_them(fresh_answers):
    _cpu(fresh_answers, vendor="GenuineIntel")
    before = capabilities.kernel_choices()
    assert before == {"onednn_fp32_linears": False, "native_bf16_products": False}
    pinned = {"onednn_fp32_linears": True, "native_bf16_products": True, "unknown": 1}
    with capabilities.kernels_as(pinned):
        assert capabilities.kernel_choices() == {
            "onednn_fp32_linears": True, "native_bf16_products": True,
        }  # fmt: skip
        with capabilities.kernels_as(None):  # nothing pinned: the outer pins stay
            assert capabilities.onednn_fp32_products()
    assert capabilities.kernel_choices() == before


def test_a_choice_this_machine_cannot_follow_is_logged(fresh_answers, caplog):
    fresh_answers.setattr(capabilities, "onednn_linear", lambda dtype: Support(False, "no oneDNN"))
    pinned = {"onednn_fp32_linears": True}
    with caplog.at_level(logging.WARNING, logger="qkv"), capabilities.kernels_as(pinned):
        assert not capabilities.onednn_fp32_products()
    assert "cannot be used on this machine" in caplog.text


def test_onednn_allows_reads_the_cap(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert capabilities.onednn_allows("AVX2") and not capabilities.onednn_allows("AVX512_CORE")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    assert not capabilities.onednn_allows("AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert capabilities.onednn_allows("AVX512_CORE_AMX")
