"""The sections on the real model, SmolLM2-135M-Instruct's GGUF file (templates/real_model.md):
parity with llama.cpp (parity_llama_cpp*.json), load time (load_gguf.json), decoding speed
against llama.cpp (decode_smollm2.json) and what quantization costs in perplexity
(perplexity_smollm2.json). Each function gives the fields of its part but the machine table;
`d` is the result file, whose figures the template names."""

from __future__ import annotations

from .template import fill


def parity(data: dict) -> dict:
    """Token-for-token agreement; for a file written by qkv's GGUF writer, a note saying so."""
    rows, written = data.get("rows", []), data.get("written")
    return dict(
        d=data, prompts=len(rows), s=data.get("summary", {}), r=rows,
        on=f", {written} by qkv" if written else "",
        written=fill("real_model", "written", written=written) if written else "",
    )  # fmt: skip


def load(data: dict) -> dict:
    """Load time and peak memory of each loader."""
    rows = [{"name": name, **row} for name, row in data.get("rows", {}).items()]
    return dict(d=data, megabytes=data.get("model_bytes", 0) / 1e6, r=rows)


def decode(data: dict) -> dict:
    """Decoding speed against llama.cpp, and the kernels behind qkv's quantized linears."""
    rows = data.get("rows", [])
    kernels = [f"- {kind} file: {line.strip()}" for kind, text in data.get("kernels", {}).items()
               for line in text.splitlines() if line.startswith("  ")]  # fmt: skip
    new = rows[0]["new_tokens"] if rows else "?"
    return dict(d=data, new_tokens=new, r=rows, b=data.get("batch_rows", []),
                kernels="\n".join(kernels))  # fmt: skip


def perplexity(data: dict) -> dict:
    """Perplexity of each format against fp32."""
    return dict(d=data, r=data.get("rows", []))
