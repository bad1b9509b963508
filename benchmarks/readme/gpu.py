"""The section of benchmarks/flash_gpu.py: the Triton kernels' throughput on a CUDA GPU.

Without `results/flash_gpu.json` the section says how to measure it; with it, each row gives
every candidate's forward and forward + backward TFLOP/s, the forward's share of the card's
dense bf16 peak and the ratio to SDPA's flash backend.
"""

from __future__ import annotations

from .format import NOT_RECORDED, get, md_table, num, pct, prose
from .machine import machine_table

GPU_TEXT = """\
`qkv.triton_attention` (backend "triton"): FlashAttention-2's forward and backward passes as
Triton kernels for CUDA GPUs, against SDPA's flash backend (and `flash_attn` where it is
installed), bf16, self-attention, with B * L = 16384 tokens and H * D = 2048. FLOPs follow the
FlashAttention-2 paper (section 4.1): forward 4 * B * H * L^2 * D, forward + backward 3.5x that,
half of each when causal; throughput in TFLOP/s and as a fraction of the card's dense bf16 peak.
Targets: forward + backward at least 0.9x SDPA flash's throughput at L >= 4096; forward at least
50% of the dense bf16 peak at L >= 4096 with D = 128."""


def gpu_section(data: dict | None) -> list[str]:
    lines = ["## Triton kernels on a GPU (`flash_gpu.py`)", "", *prose(GPU_TEXT), ""]
    if data is None:
        return lines + prose(
            "There is no `results/flash_gpu.json`: the kernels' GPU throughput is not measured. "
            "The tests check them on the CPU through Triton's interpreter. On a CUDA GPU, "
            "`python benchmarks/flash_gpu.py` writes the file; then run this generator."
        )
    lines += machine_table([("flash_gpu", data)]) + [""]
    peak = data.get("peak_tflops")
    lines += [
        *prose(
            f"Dense bf16 peak used: {num(peak, '.0f', missing=NOT_RECORDED)} TFLOP/s; measured "
            f"bf16 matmul: {num(data.get('matmul_tflops'), '.0f', missing=NOT_RECORDED)} "
            "TFLOP/s."
        ),
        "",
    ]
    header = ["L", "D", "causal", "candidate", "fwd TFLOP/s", "f+b TFLOP/s", "fwd % of peak"]
    header.append("f+b / sdpa_flash")
    body = []
    rows = sorted(data.get("rows", []), key=lambda r: (r["D"], bool(r["causal"]), r["L"]))
    for r in rows:
        sdpa = get(r, "by", "sdpa_flash", "fb_tflops")
        for name, c in sorted(r.get("by", {}).items()):
            relative = c["fb_tflops"] / sdpa if isinstance(sdpa, int | float) and sdpa else None
            body.append(
                [
                    r["L"],
                    r["D"],
                    "yes" if r["causal"] else "no",
                    name,
                    num(c.get("fwd_tflops"), ".0f"),
                    num(c.get("fb_tflops"), ".0f"),
                    pct(c.get("fwd_of_peak")),
                    num(relative, ".2f"),
                ]
            )
    return lines + md_table(header, body)
