"""Benchmark: quantized linears (qkv.acceleration.QuantizedLinear) against dense products.

    .venv/bin/python benchmarks/quantized_linear.py              # SmolLM2's shapes, 1 and 8 rows
    .venv/bin/python benchmarks/quantized_linear.py --quick      # smoke run: fewer repeats

SmolLM2-135M's linear shapes (out, in): the FFN's (1536, 576) and (576, 1536), and the output
layer (49152, 576), at 1 row (a decoding step) and 8 rows, CPU, interleaved in one process.
Candidates, on a Q4_1 weight (the file's layers) and a Q8_0 weight (its output layer):
    qkv              QuantizedLinear: the kernel qkv chooses on this machine
    int4pack fp32    PyTorch's int4pack product with fp32 activations and scales (Q4_1)
    dense fp32       F.linear on the dequantized weight, fp32
    dense bf16       F.linear on the dequantized weight and the input, both bf16
    per call         the blocks dequantized at every call (qkv's dequantize), then F.linear
    two int4 planes  Q8_0 as two int4pack products, high and low nibble of q + 128 (bf16)
Decoding reads each weight from memory once per step: by default every candidate cycles through
enough copies of its weights to overflow the CPU's caches (--warm: one copy, cache-resident).
The error column is max |y - exact| / max |exact|, exact = the float64 product of the bit-exact
dequantized weight.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from common import format_table, log, machine_info, time_interleaved, write_json

from qkv.acceleration import QuantizedLinear, explain_quantized, quantize_blocks
from qkv.models.gguf.quants import dequantize

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(1536, 576), (576, 1536), (49152, 576)]
COLD_BYTES = 64 << 20  # more than a CPU's last-level cache: fp32 bytes per set of copies


def int4pack_fp32(blocks: torch.Tensor, out_features: int, in_features: int):
    """Q4_1 blocks as PyTorch's int4pack with fp32 scales: (N, in) fp32 -> (N, out) fp32."""
    fields = blocks.view(out_features, in_features // 32, 20)
    d = fields[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # (out, groups)
    m = fields[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    codes = fields[..., 4:]
    q = torch.cat((codes & 15, codes >> 4), dim=-1).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales = torch.stack((d, m + 8 * d), dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales)


def two_planes(blocks: torch.Tensor, out_features: int, in_features: int):
    """Q8_0 as two int4pack products in bf16: q + 128 = 16 h + l, so d q = 16 d (h - 8) + 8 d
    + d (l - 8)."""
    fields = blocks.view(out_features, in_features // 32, 34)
    d = fields[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    u = fields[..., 2:].view(torch.int8).to(torch.int32).reshape(out_features, in_features) + 128
    high = torch.ops.aten._convert_weight_to_int4pack_for_cpu((u >> 4).contiguous(), 1)
    low = torch.ops.aten._convert_weight_to_int4pack_for_cpu((u & 15).contiguous(), 1)
    s_high = torch.stack((16 * d, 8 * d), -1).transpose(0, 1).contiguous().bfloat16()
    s_low = torch.stack((d, torch.zeros_like(d)), -1).transpose(0, 1).contiguous().bfloat16()
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    return lambda x: (mm(x.bfloat16(), high, 32, s_high) + mm(x.bfloat16(), low, 32, s_low)).float()


def candidates(
    kind: str, out_features: int, in_features: int, seed: int
) -> tuple[dict, torch.Tensor]:
    """{name: callable (N, in) fp32 -> (N, out)} on one random weight quantized to `kind`."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    blocks = quantize_blocks(weight, kind)
    dense = dequantize(blocks, kind, (out_features, in_features))  # (out, in)
    dense_bf16 = dense.bfloat16()
    layer = QuantizedLinear(blocks, kind)
    calls = {
        f"qkv ({layer.kernel})": layer,
        "dense fp32": lambda x: F.linear(x, dense),
        "dense bf16": lambda x: F.linear(x.bfloat16(), dense_bf16),
        "per call": lambda x: F.linear(x, dequantize(blocks, kind, dense.shape)),
    }
    if kind == "Q4_1":
        calls["int4pack fp32"] = int4pack_fp32(blocks, out_features, in_features)
    else:
        calls["two int4 planes"] = two_planes(blocks, out_features, in_features)
    return calls, dense


def errors(calls: dict, dense: torch.Tensor, rows: int) -> dict[str, float]:
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(1))
    exact = F.linear(x.double(), dense.double())
    scale = exact.abs().max().item()
    return {
        name: (call(x).double() - exact).abs().max().item() / scale for name, call in calls.items()
    }


def measure(kind: str, shape: tuple[int, int], rows: int, args) -> dict:
    out_features, in_features = shape
    copies = 1 if args.warm else max(1, -(-COLD_BYTES // (4 * out_features * in_features)))
    sets = [candidates(kind, out_features, in_features, seed) for seed in range(copies)]
    names = list(sets[0][0])
    error = errors(sets[0][0], sets[0][1], rows)
    x = torch.randn(rows, in_features)
    calls = {}
    for name in names:
        cycle = itertools.cycle([calls_of_set[name] for calls_of_set, _ in sets])
        calls[name] = lambda cycle=cycle: next(cycle)(x)
    with torch.no_grad():
        timings = time_interleaved(calls, device="cpu", warmup=max(2, copies),
                                   repeats=args.repeats, budget_s=args.budget)  # fmt: skip
    seconds = {name: t.median for name, t in timings.items()}
    return {"kind": kind, "shape": shape, "rows": rows, "copies": copies, "seconds": seconds,
            "timings": timings, "relative_error": error}  # fmt: skip


def table(records: list[dict]) -> str:
    rows = []
    for record in records:
        seconds = record["seconds"]
        ours = next(name for name in seconds if name.startswith("qkv"))
        for name, value in seconds.items():
            rows.append([
                record["kind"], "x".join(map(str, record["shape"])), record["rows"], name,
                f"{value * 1e3:.3f}", f"{value / seconds['dense fp32']:.2f}x",
                f"{seconds[ours] / value:.2f}x" if name != ours else "-",
                f"{record['relative_error'][name]:.1e}",
            ])  # fmt: skip
    header = ["kind", "out x in", "rows", "candidate", "ms", "vs dense fp32", "qkv vs it", "error"]
    return format_table(rows, header)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 repeats, 1 s each")
    parser.add_argument("--warm", action="store_true", help="one copy of each weight (cached)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timed rounds per row")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.budget = 3, 1.0
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    for kind in ("Q4_1", "Q8_0"):
        for shape in SHAPES:
            for rows in (1, 8):
                log(f"{kind} {shape} x {rows} rows")
                records.append(measure(kind, shape, rows, args))
    print(table(records))
    layer = torch.nn.Sequential(
        QuantizedLinear(quantize_blocks(torch.zeros(16, 32), "Q4_1"), "Q4_1")
    )
    print(explain_quantized(layer))
    name = "quantized_linear_quick.json" if args.quick else "quantized_linear.json"
    payload = {"machine": machine_info("cpu"), "warm": args.warm, "records": records}
    log(f"wrote {write_json(RESULTS / name, payload)}")


if __name__ == "__main__":
    main()
