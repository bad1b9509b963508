"""Benchmark: decoding speed as the context grows, qkv against llama.cpp on the same file.

    .venv/bin/python benchmarks/decode_context.py
    .venv/bin/python benchmarks/decode_context.py --rounds 1 --contexts 16 1024   # a smoke run

SmolLM2-135M-Instruct, the Q4_1 file as shipped, batch 1, greedy, 2 threads. A prompt of
CPython's documentation, cut to each context length, then 64 new tokens; the time of the 63
steps after the first new token (the prefill apart), as tokens/s:
    qkv        `load_chat_model("smollm2")` (as `qkv chat` holds it), the step compiled ahead of
               time (`decoding_steps(model, "aot")`), the fp32 KV cache
    qkv f16 KV the same with `kv_dtype=torch.float16` (`qkv chat --kv-dtype fp16`)
    llama.cpp  llama-cpp-python's `Llama.eval` one token at a time, its default f16 KV cache
They take turns over the rounds; the median of each, and the median of their paired ratios.
Each step reads the weights once and the whole KV cache once: past a few hundred tokens of
context the cache's bytes, not the weights', set the pace (qkv's fp32 cache holds twice
llama.cpp's f16 bytes per token). Written to results/decode_context.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch
from common import log, machine_info, write_json
from load_gguf import kv_values_per_position, smollm2_file

from qkv.acceleration import decoding_steps
from qkv.applications.chat import load_chat_model
from qkv.generation import decode_steps
from qkv.models.gguf import read_gguf

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 64


def qkv_rate(model, steps, prompt: list[int], kv_dtype=None) -> tuple[float, list[int]]:
    """(tokens/s of the steps after the first new token, the new tokens)."""
    decoding = decode_steps(model, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, steps=steps,
                            kv_dtype=kv_dtype)  # fmt: skip
    tokens = [int(next(decoding).tokens[0])]
    started = time.perf_counter()
    tokens += [int(step.tokens[0]) for step in decoding]
    return (NEW_TOKENS - 1) / (time.perf_counter() - started), tokens


class LlamaCpp:
    def __init__(self, path: Path, context: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=context, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)  # fmt: skip

    def rate(self, prompt: list[int]) -> tuple[float, list[int]]:
        self.llm.reset()
        self.llm.eval(prompt)
        tokens = [self._greedy()]
        started = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(self._greedy())
        return (NEW_TOKENS - 1) / (time.perf_counter() - started), tokens

    def _greedy(self) -> int:
        import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(pointer, shape=(self.llm.n_vocab(),)).argmax())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 512, 1024, 2048, 4096])
    parser.add_argument("--out", default=str(HERE / "results" / "decode_context.json"))
    args = parser.parse_args()
    import llama_cpp

    threads = torch.get_num_threads()
    path = smollm2_file()
    loaded = load_chat_model("smollm2")
    steps = decoding_steps(loaded.model, "aot")
    ids = loaded.tokenizer.encode(" ".join(topics.values())[:200_000]).ids
    kv_bytes = kv_values_per_position(read_gguf(path).metadata) * 4  # fp32 K and V, per token
    llama = LlamaCpp(path, max(args.contexts) + NEW_TOKENS, threads)
    qkv_rate(loaded.model, steps, ids[:16])  # compiles (or loads) each step once
    qkv_rate(loaded.model, steps, ids[:16], torch.float16)
    rows = []
    names = ("qkv", "qkv_f16_kv", "llama_cpp")
    for context in args.contexts:
        prompt = ids[:context]
        rates = {name: [] for name in names}
        same = 0
        for round_index in range(args.rounds):
            ours, theirs = None, None
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                if name == "llama_cpp":
                    rate, theirs = llama.rate(prompt)
                elif name == "qkv":
                    rate, ours = qkv_rate(loaded.model, steps, prompt)
                else:
                    rate, _ = qkv_rate(loaded.model, steps, prompt, torch.float16)
                rates[name].append(rate)
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                        NEW_TOKENS)  # fmt: skip
        ratios = [a / b for a, b in zip(rates["qkv"], rates["llama_cpp"], strict=True)]
        half = [a / b for a, b in zip(rates["qkv_f16_kv"], rates["llama_cpp"], strict=True)]
        rows.append({
            "context": context, "qkv_tok_s": statistics.median(rates["qkv"]),
            "qkv_f16_kv_tok_s": statistics.median(rates["qkv_f16_kv"]),
            "llama_cpp_tok_s": statistics.median(rates["llama_cpp"]),
            "qkv_vs_llama_cpp": statistics.median(ratios),
            "qkv_f16_kv_vs_llama_cpp": statistics.median(half),
            "kv_cache_mb": kv_bytes * (context + NEW_TOKENS) / 2**20,
            "same_tokens_before_parting": same, "samples": rates,
        })  # fmt: skip
        row = rows[-1]
        log(f"context {context}: qkv {row['qkv_tok_s']:.1f} tok/s, with an f16 KV cache "
            f"{row['qkv_f16_kv_tok_s']:.1f}, llama.cpp {row['llama_cpp_tok_s']:.1f} "
            f"({row['qkv_vs_llama_cpp']:.2f}x, {row['qkv_f16_kv_vs_llama_cpp']:.2f}x)")  # fmt: skip
    payload = {
        "machine": machine_info("cpu"), "model": path.name, "threads": threads,
        "rounds": args.rounds, "new_tokens": NEW_TOKENS, "loaded": loaded.weights,
        "llama_cpp": {"version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()},
        "rows": rows,
    }  # fmt: skip
    print(json.dumps([{k: v for k, v in r.items() if k != "samples"} for r in rows], indent=1))
    log(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
