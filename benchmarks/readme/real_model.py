"""The sections of benchmarks/README.md on the real model, SmolLM2-135M-Instruct's GGUF file:
parity with llama.cpp (results/parity_llama_cpp.json), load time (results/load_gguf.json) and
decoding speed against llama.cpp (results/decode_smollm2.json)."""

from __future__ import annotations

from readme.template import fill
from readme.values import machine_table


def parity(data: dict) -> str:
    rows = data.get("rows", [])
    return fill(
        "real_model", "parity", model=f"`{data.get('model', '?')}`", prompts=len(rows),
        s=data.get("summary", {}), r=rows, machine=machine_table([("parity_llama_cpp", data)]),
    )  # fmt: skip


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
