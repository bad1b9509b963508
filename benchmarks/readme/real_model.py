"""The sections of benchmarks/README.md on the real model, SmolLM2-135M-Instruct's GGUF file:
parity with llama.cpp (results/parity_llama_cpp.json), load time (results/load_gguf.json) and
decoding speed against llama.cpp (results/decode_smollm2.json) and what quantization costs in
perplexity (results/perplexity_smollm2.json)."""

from __future__ import annotations

import textwrap

from readme.template import fill
from readme.values import machine_table


def parity(data: dict, stem: str = "parity_llama_cpp") -> str:
    rows = data.get("rows", [])
    written = data.get("written")
    note = (
        f'This file was written by qkv\'s GGUF writer (`save_gguf`, weight_type="{written}") '
        "from the shipped Q4_1 file's weights: a model quantized by qkv, run by llama.cpp."
    )
    return fill(
        "real_model", "parity", model=f"`{data.get('model', '?')}`", prompts=len(rows),
        on=f", {written} by qkv" if written else "",
        written=textwrap.fill(note, 100) if written else "",
        s=data.get("summary", {}), r=rows, machine=machine_table([(stem, data)]),
    )  # fmt: skip


def parity_written(data: dict) -> str:
    return parity(data, "parity_llama_cpp_q8_0")


def load(data: dict) -> str:
    rows = [{"name": name, **row} for name, row in data.get("rows", {}).items()]
    return fill(
        "real_model", "load", model=f"`{data.get('model', '?')}`",
        megabytes=data.get("model_bytes", 0) / 1e6, rounds=data.get("rounds", "?"), r=rows,
        machine=machine_table([("load_gguf", data)]),
    )  # fmt: skip


def decode(data: dict) -> str:
    rows = data.get("rows", [])
    kernels = [
        f"- {kind} file: {line.strip()}"
        for kind, text in data.get("kernels", {}).items()
        for line in text.splitlines()
        if line.startswith("  ")
    ]
    return fill(
        "real_model", "decode", model=f"`{data.get('model', '?')}`",
        prompt_tokens=data.get("prompt_tokens", "?"),
        prefill_tokens=data.get("prefill_tokens", "?"),
        new_tokens=rows[0]["new_tokens"] if rows else "?", threads=data.get("threads", "?"),
        rounds=data.get("rounds", "?"), r=rows, kernels="\n".join(kernels),
        machine=machine_table([("decode_smollm2", data)]),
    )  # fmt: skip


def perplexity(data: dict) -> str:
    return fill(
        "real_model", "perplexity", model=f"`{data.get('model', '?')}`",
        tokens=data.get("tokens", "?"), windows=data.get("windows", "?"),
        length=data.get("length", "?"), r=data.get("rows", []),
        machine=machine_table([("perplexity_smollm2", data)]),
    )  # fmt: skip
