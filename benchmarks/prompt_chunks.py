"""Benchmark: long prompts in chunks over the KV cache, against the whole prompt at once.

    .venv/bin/python benchmarks/prompt_chunks.py
    .venv/bin/python benchmarks/prompt_chunks.py --rounds 1 --lengths 1024   # a smoke run

`qkv.generate` sends a prompt longer than `qkv.generation.steps.PROMPT_CHUNK` tokens through the
model a chunk at a time, each chunk's queries attending over the keys the earlier chunks left in
the KV cache: a long prompt's activations are then one chunk's. Two parts:

Attention, one chunk of L_q queries over L_k cached keys (SmolLM2's heads: 9 query heads, 3
key/value heads, D = 64), causal aligned bottom-right, fp32, batch 1:
    qkv        qkv.attention(q, k, v, causal=True)       (backend "auto": SDPA with qkv's rules)
    sdpa mask  F.scaled_dot_product_attention(q, k, v, attn_mask=the bottom-right causal mask,
               enable_gqa=True): the call a user writes (the mask built outside the timed call)
the median of rounds that call each once, in turn.

SmolLM2-135M-Instruct (the Q4_1 file as shipped, and Q8_0 as qkv's GGUF writer writes it),
`qkv.acceleration.quantized_from_gguf`: a prompt of CPython's documentation through
`generate(..., max_new_tokens=1)`, in chunks (as qkv does) and whole (PROMPT_CHUNK set past the
prompt), the two taking turns over the rounds: prefill tokens/s (median) and their paired ratio;
then, each in a fresh process after one short warm-up generation, how far the prompt raised the
process's peak resident memory (VmHWM, reset before the call) and the KV cache within it.
Written to results/prompt_chunks.json with the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from common import log, machine_info, write_json
from load_gguf import kv_values_per_position, smollm2_file, write_again

import qkv
import qkv.generation.steps as steps
from qkv.acceleration import quantized_from_gguf
from qkv.data import tokenizer_from_metadata
from qkv.generation import generate
from qkv.models.gguf import read_gguf

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
CHUNKS = [(256, 2048), (512, 2048), (512, 4096)]  # (L_q, L_k)
QKV_CHUNK = steps.PROMPT_CHUNK  # what qkv.generate takes

_CHILD = r"""
import sys, torch
import qkv.generation.steps as steps
from qkv.acceleration import quantized_from_gguf
from qkv.generation import generate
from qkv.models.gguf import read_gguf
def status(key):
    with open("/proc/self/status") as lines:
        return next(int(l.split()[1]) for l in lines if l.startswith(key)) / 1024
path, length, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = [int(i) for i in open(sys.argv[4]).read().split()][:length]
model = quantized_from_gguf(read_gguf(path))
steps.PROMPT_CHUNK = chunk
with torch.inference_mode():
    generate(model, torch.tensor([ids[:64]]), max_new_tokens=2)  # the kernels' code paged in
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")  # the peak (VmHWM) starts again from here
    generate(model, torch.tensor([ids]), max_new_tokens=1)
print(status("VmHWM") - base)
"""


def attention_rows(rounds: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for L_q, L_k in CHUNKS:
        q = torch.randn(1, HEADS, L_q, HEAD_DIM, generator=generator)
        k, v = (torch.randn(1, KV_HEADS, L_k, HEAD_DIM, generator=generator) for _ in "kv")
        mask = torch.ones(L_q, L_k, dtype=torch.bool).tril(L_k - L_q)  # bottom-right causal
        calls = {
            "qkv": functools.partial(qkv.attention, q, k, v, causal=True),
            "sdpa_mask": functools.partial(
                F.scaled_dot_product_attention, q, k, v, attn_mask=mask, enable_gqa=True
            ),
        }
        outputs = {name: call() for name, call in calls.items()}  # and a warm-up
        timings = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                started = time.perf_counter()
                call()
                timings[name].append((time.perf_counter() - started) * 1e3)
        row = {"L_q": L_q, "L_k": L_k}
        row["max_abs_diff"] = (outputs["qkv"] - outputs["sdpa_mask"]).abs().max().item()
        row.update({f"{name}_ms": statistics.median(t) for name, t in timings.items()})
        row["qkv_over_sdpa"] = row["qkv_ms"] / row["sdpa_mask_ms"]
        rows.append(row)
        log(f"attention {L_q} over {L_k}: qkv {row['qkv_ms']:.2f} ms, "
            f"SDPA with the mask {row['sdpa_mask_ms']:.2f} ms")  # fmt: skip
    return rows


def prefill_rows(files: dict, ids: list[int], lengths: list[int], rounds: int) -> list[dict]:
    rows = []
    for kind, path in files.items():
        file = read_gguf(path)
        model = quantized_from_gguf(file)
        per_token_mb = kv_values_per_position(file.metadata) * 4 / 2**20  # fp32 K and V
        for length in lengths:
            prompt = torch.tensor([ids[:length]])
            rates = {"chunks": [], "whole": []}
            chunk = {"chunks": QKV_CHUNK, "whole": length}
            for round_index in range(rounds):
                order = ["chunks", "whole"][:: 1 if round_index % 2 == 0 else -1]
                for mode in order:
                    steps.PROMPT_CHUNK = chunk[mode]
                    with torch.inference_mode():
                        started = time.perf_counter()
                        generate(model, prompt, max_new_tokens=1)
                        rates[mode].append(length / (time.perf_counter() - started))
            steps.PROMPT_CHUNK = QKV_CHUNK
            for mode in ("chunks", "whole"):
                rows.append({
                    "file": kind, "tokens": length, "mode": mode,
                    "prefill_tok_s": statistics.median(rates[mode]),
                    "vs_whole": statistics.median(
                        a / b for a, b in zip(rates[mode], rates["whole"], strict=True)),
                    "peak_rise_mb": peak_rise(path, ids, length, chunk[mode]),
                    "kv_cache_mb": per_token_mb * (length + 1),
                    "samples": rates[mode],
                })  # fmt: skip
                log(f"{kind}, {length} tokens, {mode}: {rows[-1]['prefill_tok_s']:.0f} tok/s, "
                    f"peak rise {rows[-1]['peak_rise_mb']:.0f} MB")  # fmt: skip
    return rows


def peak_rise(path: Path, ids: list[int], length: int, chunk: int) -> float:
    """MiB by which a prompt of `length` tokens raised the peak RSS of a fresh process."""
    with tempfile.NamedTemporaryFile("w", suffix=".ids") as listing:
        listing.write(" ".join(map(str, ids)))
        listing.flush()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), str(length), str(chunk), listing.name],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--out", default=str(HERE / "results" / "prompt_chunks.json"))
    args = parser.parse_args()
    shipped = smollm2_file()
    tokenizer = tokenizer_from_metadata(read_gguf(shipped).metadata)
    ids = tokenizer.encode(" ".join(topics.values())[:400_000]).ids
    attention = attention_rows(args.rounds * 5)
    with tempfile.TemporaryDirectory(prefix="qkv-chunks-") as folder:
        files = {"Q4_1": shipped, "Q8_0": write_again(shipped, Path(folder), "Q8_0")}
        prefill = prefill_rows(files, ids, args.lengths, args.rounds)
    payload = {
        "machine": machine_info("cpu"), "model": shipped.name, "chunk": QKV_CHUNK,
        "threads": torch.get_num_threads(), "rounds": args.rounds,
        "heads": [HEADS, KV_HEADS, HEAD_DIM], "attention_rows": attention, "rows": prefill,
    }  # fmt: skip
    print(json.dumps({"attention": attention, "prefill": [
        {k: v for k, v in r.items() if k != "samples"} for r in prefill]}, indent=1))  # fmt: skip
    log(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
