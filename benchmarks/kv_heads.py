"""Benchmark: decoding with multi-head, grouped-query and multi-query attention at one width.

    .venv/bin/python benchmarks/kv_heads.py            # 3 settings, 5 rounds (~10 min)
    .venv/bin/python benchmarks/kv_heads.py --quick    # smoke run: short contexts, 1 round

The models: benchmarks/decode.py's Llama (E = 512, 8 layers, 8 query heads of 64, SwiGLU FFN of
1408, vocabulary 32000) with 8 K/V heads (MHA, Vaswani et al. 2017), 2 (GQA, Ainslie et al.
2023) and 1 (MQA, Shazeer 2019); everything else equal. Each is built by transformers'
LlamaForCausalLM under torch.manual_seed(0) and loaded by qkv from its save_pretrained folder,
so both libraries hold the same weights (fp32); the context is 4096 (decode.py's: 2048).

What is timed: one decoding step after a prompt of `context` tokens, batch `batch`, the prompt
in the cache (the prefill is run, not timed): the seconds between consecutive steps of
`qkv.generation.decode_steps` (greedy, eager), and of transformers' own forward with its
DynamicCache, one token per row per step, greedy by argmax (the loop `generate` runs). Steps
per call: `--new-tokens`; tokens/s = batch / the median step time; the rounds interleave the
models and libraries. Both libraries' greedy tokens are compared.

What a step should cost. At these sizes a step is memory-bound: it reads every weight once (of
the embedding table only the rows looked up) and the K/V cache of every row,
    bytes per step = weight bytes + batch x context x layers x 2 x kv_heads x head_dim x 4,
so the speed-up of fewer K/V heads over MHA should approach MHA's bytes over theirs: nothing at
a short context and batch 1 (the weights dominate), up to ~kv-heads-fold where the cache does.
"predicted" is that ratio; "measured" the paired ratio of step times (median over rounds).
Written to results/kv_heads.json with the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import format_table, log, machine_info, write_json
from decode import LLAMA, build_models, kv_bytes_read, weight_bytes_read

from qkv.generation import decode_steps

RESULTS = Path(__file__).resolve().parent / "results"
KV_HEADS = {"MHA": 8, "GQA": 2, "MQA": 1}
SETTINGS = [(1, 128), (1, 2048), (8, 1024)]  # (batch, context)
QUICK_SETTINGS = [(1, 32), (2, 64)]


def qkv_step_seconds(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[float], list]:
    """(seconds of each step after the prefill, the greedy tokens (B,) of every step)."""
    times, tokens, last = [], [], None
    with torch.inference_mode():
        for step in decode_steps(model, ids, max_new_tokens=new_tokens):
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            tokens.append(step.tokens.tolist())
            last = time.perf_counter()
    return times, tokens


def transformers_step_seconds(model, ids: torch.Tensor, new_tokens: int):
    """The same for transformers: its forward with the cache it returns, one token per row."""
    times, tokens = [], []
    with torch.inference_mode():
        output = model(ids, use_cache=True)
        token = output.logits[:, -1].argmax(-1)  # (B,)
        tokens.append(token.tolist())
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            output = model(token[:, None], cache=output.cache, use_cache=True)
            token = output.logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - start)
            tokens.append(token.tolist())
    return times, tokens


def cache_bytes(model, batch: int, context: int) -> float:
    """fp32 K/V bytes of `batch` rows of `context` tokens (decode.py's count for one row)."""
    return batch * kv_bytes_read(model, context, new_tokens=1, element_size=4)


def bench(settings, rounds: int, new_tokens: int) -> list[dict]:
    models = {}
    for name, heads in KV_HEADS.items():
        log(f"building {name} ({heads} K/V heads)")
        models[name] = build_models("cpu", num_key_value_heads=heads, max_position_embeddings=4096)
    rows = []
    for batch, context in settings:
        ids = torch.randint(0, LLAMA["vocab_size"], (batch, context),
                            generator=torch.Generator().manual_seed(batch * context))  # fmt: skip
        steps = {(name, lib): [] for name in models for lib in ("qkv", "transformers")}
        agree = {}
        for r in range(rounds):
            log(f"batch {batch}, context {context}: round {r + 1}/{rounds}")
            order = list(steps)[r % len(steps) :] + list(steps)[: r % len(steps)]
            for name, lib in order:
                ours, theirs = models[name]
                run = qkv_step_seconds if lib == "qkv" else transformers_step_seconds
                times, tokens = run(ours if lib == "qkv" else theirs, ids, new_tokens)
                steps[name, lib].append(statistics.median(times))
                agree.setdefault(name, {})[lib] = tokens
        mha = models["MHA"][0]
        for name, (ours, _) in models.items():
            row = {
                "attention": name, "kv_heads": ours.config.num_kv_heads, "batch": batch,
                "context": context,
                "parameters": sum(p.numel() for p in ours.parameters()),
                "cache_mib": cache_bytes(ours, batch, context) / 2**20,
                "predicted_speedup_vs_mha": (
                    (weight_bytes_read(mha) + cache_bytes(mha, batch, context))
                    / (weight_bytes_read(ours) + cache_bytes(ours, batch, context))
                ),
                "same_tokens": agree[name]["qkv"] == agree[name]["transformers"],
            }  # fmt: skip
            for lib in ("qkv", "transformers"):
                seconds = steps[name, lib]
                row[f"{lib}_step_ms"] = 1e3 * statistics.median(seconds)
                row[f"{lib}_tokens_per_s"] = batch / statistics.median(seconds)
                row[f"{lib}_speedup_vs_mha"] = statistics.median(
                    m / s for m, s in zip(steps["MHA", lib], seconds, strict=True)
                )
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    header = ["attention", "batch", "context", "cache MiB", "qkv tokens/s", "transformers",
              "predicted vs MHA", "qkv vs MHA", "transformers vs MHA", "same tokens"]  # fmt: skip
    return format_table([
        [r["attention"], r["batch"], r["context"], f"{r['cache_mib']:.1f}",
         f"{r['qkv_tokens_per_s']:.1f}", f"{r['transformers_tokens_per_s']:.1f}",
         f"{r['predicted_speedup_vs_mha']:.2f}x", f"{r['qkv_speedup_vs_mha']:.2f}x",
         f"{r['transformers_speedup_vs_mha']:.2f}x", "yes" if r["same_tokens"] else "no"]
        for r in rows
    ], header)  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (short contexts)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=17, help="steps per call, prefill's too")
    args = parser.parse_args(argv)
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    rounds = 1 if args.quick else args.rounds
    torch.manual_seed(0)
    rows = bench(settings, rounds, args.new_tokens)
    print(table(rows))
    name = "kv_heads_quick.json" if args.quick else "kv_heads.json"
    write_json(RESULTS / name, {"machine": machine_info("cpu"), "rows": rows,
                                "rounds": rounds, "new_tokens": args.new_tokens})  # fmt: skip


if __name__ == "__main__":
    main()
