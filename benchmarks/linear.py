"""Benchmark: linear attention against softmax attention, the crossover length and decoding.

    .venv/bin/python benchmarks/linear.py            # L = 256 .. 16384, fp32
    .venv/bin/python benchmarks/linear.py --quick    # smoke run: L = 256, 1024

Causal self-attention on (B, H, L, D) = (1, 8, L, 64), forward, fp32. Candidates:
    softmax   qkv.attention(q, k, v, causal=True): `auto` (SDPA's fused kernel here)
    elu       linear_attention with elu(x) + 1 features (Katharopoulos et al. 2020), F = 64
    favor     linear_attention with FAVOR+ features (Choromanski et al. 2021), F = 256

Decoding (one new token with a context of L tokens): softmax reads a KV cache of L keys (SDPA,
one query, per step O(L)); linear attention updates its (F, D) state (`linear_attention_step`,
per step O(1)). Reported per step, and the ratio of the longest to the shortest context (flat
~1 for linear attention). The crossover is the shortest L at which each linear form's forward
is faster than softmax's (linear in L against quadratic: it exists for every feature count).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import format_table, log, machine_info, time_interleaved, write_json

import qkv
from qkv.attention import linear

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, HEADS, HEAD_DIM = 1, 8, 64
FAVOR_FEATURES = 256


def feature_maps() -> dict:
    generator = torch.Generator().manual_seed(0)
    projection = linear.orthogonal_random_features(FAVOR_FEATURES, HEAD_DIM, generator=generator)
    return {"elu": linear.elu_feature_map, "favor": linear.FavorFeatureMap(projection)}


def inputs(L: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(L)
    shape = (BATCH, HEADS, L, HEAD_DIM)
    return tuple(torch.randn(shape, generator=generator) / 2 for _ in "qkv")


def forward_row(L: int, maps: dict, repeats: int) -> dict:
    q, k, v = inputs(L)
    calls = {"softmax": lambda: qkv.attention(q, k, v, causal=True)}
    for name, feature_map in maps.items():
        calls[name] = lambda f=feature_map: linear.linear_attention(
            q, k, v, feature_map=f, causal=True
        )
    with torch.no_grad():
        timings = time_interleaved(calls, device="cpu", warmup=1, repeats=repeats)
    seconds = {name: t.median for name, t in timings.items()}
    speedup = {n: seconds["softmax"] / s for n, s in seconds.items()}
    return {"length": L, "seconds": seconds, "speedup_over_softmax": speedup}


def decode_row(L: int, maps: dict, repeats: int) -> dict:
    """Seconds per decoding step with a context of L tokens."""
    q, k, v = inputs(L + 1)
    new_q, new_k, new_v = (t[:, :, -1:] for t in (q, k, v))
    calls = {"softmax": lambda: qkv.attention(new_q, k, v, causal=True)}  # one query, L + 1 keys
    for name, feature_map in maps.items():
        state = linear.linear_attention_state(k[:, :, :L], v[:, :, :L], feature_map=feature_map)
        calls[name] = lambda s=state, f=feature_map: linear.linear_attention_step(
            s, new_q, new_k, new_v, feature_map=f
        )
    with torch.no_grad():
        timings = time_interleaved(calls, device="cpu", warmup=2, repeats=repeats)
    return {"context": L, "seconds_per_step": {n: t.median for n, t in timings.items()}}


def crossover(rows: list[dict], name: str) -> int | None:
    """The shortest measured L from which `name` stays faster than softmax."""
    faster = [r["seconds"][name] < r["seconds"]["softmax"] for r in rows]
    for i, r in enumerate(rows):
        if all(faster[i:]):
            return r["length"]
    return None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 256, 1024: a smoke run")
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[256, 512, 1024, 2048, 4096, 8192, 16384])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats = [256, 1024], 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    maps = feature_maps()
    forward, decode = [], []
    for L in args.lengths:
        log(f"L={L} ...")
        forward.append(forward_row(L, maps, args.repeats))
        decode.append(decode_row(L, maps, args.repeats))
    names = ("softmax", *maps)
    flatness = {n: decode[-1]["seconds_per_step"][n] / decode[0]["seconds_per_step"][n]
                for n in names}  # fmt: skip
    payload = {
        "machine": machine_info("cpu"),
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "fp32"},
        "features": {"elu": HEAD_DIM, "favor": FAVOR_FEATURES},
        "forward": forward,
        "decode": decode,
        "crossover_length": {n: crossover(forward, n) for n in maps},
        "decode_longest_over_shortest": flatness,
    }
    name = "linear_quick.json" if args.quick else "linear.json"
    write_json(RESULTS / name, payload)
    header = ["L", *(f"{n} ms" for n in names), *(f"{n} step us" for n in names)]
    body = [[f["length"], *(f"{f['seconds'][n] * 1e3:.2f}" for n in names),
             *(f"{d['seconds_per_step'][n] * 1e6:.1f}" for n in names)]
            for f, d in zip(forward, decode, strict=True)]  # fmt: skip
    print(format_table(body, header))
    print(f"crossover: {payload['crossover_length']}; decode longest/shortest: {flatness}")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
