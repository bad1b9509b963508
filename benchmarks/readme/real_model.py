"""The sections of benchmarks/README.md on the real model, SmolLM2-135M-Instruct's GGUF file:
parity with llama.cpp (results/parity_llama_cpp.json) and load time (results/load_gguf.json)."""

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
