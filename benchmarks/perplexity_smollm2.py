"""Quality, not speed: what quantization costs SmolLM2-135M-Instruct, as perplexity on real text.

    .venv/bin/python benchmarks/perplexity_smollm2.py
    .venv/bin/python benchmarks/perplexity_smollm2.py --windows=1     # a smoke run

The text is CPython's own documentation (`pydoc_data.topics`, shipped with Python): the topics
in sorted order, joined and tokenized by the model's tokenizer, cut into `--windows` windows of
`--length` tokens; perplexity is exp of the mean next-token loss over every window's positions.
The shipped file stores the linears in Q4_1 (the embedding and tied output layer in Q8_0); no
float original is in it, so "fp32" is that file dequantized, and the other formats are quantized
again from those fp32 weights by `qkv.quantize` (the same blocks as the gguf package's
quantizers): they measure what each format costs on top of the shipped weights.
    fp32 (Q4_1 file)     `qkv.models.from_gguf`: the file's values, exactly, fp32 compute
    Q4_1 file, kernels   `qkv.acceleration.quantized_from_gguf`: the same blocks, through the
                         kernels that serve them here (int4pack rounds activations and block
                         scales to bf16): the kernels' own cost
    Q8_0, Q4_1, Q4_0     `qkv.quantize(fp32 model, kind, head_kind="Q8_0")`, through the kernels
    llama.cpp (Q4_1 file)  llama-cpp-python's logits on the same windows, where installed
Written to results/perplexity_smollm2.json with the machine and the kernels.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch
import torch.nn.functional as F
from common import format_table, log, machine_info, write_json
from load_gguf import smollm2_file

from qkv.acceleration import explain_quantized, quantize, quantized_from_gguf
from qkv.data import tokenizer_from_metadata
from qkv.models.gguf import read_gguf
from qkv.models.gguf.model import model_from_file

HERE = Path(__file__).resolve().parent


def windows_of_text(tokenizer, count: int, length: int) -> torch.Tensor:
    """(count, length) token ids: the pydoc topics in sorted order, joined, cut in windows."""
    ids = tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics))).ids
    if len(ids) < count * length:
        raise SystemExit(f"--windows x --length: the text has {len(ids)} tokens")
    return torch.tensor(ids[: count * length]).view(count, length)


def perplexity_of_logits(logits: torch.Tensor, windows: torch.Tensor) -> float:
    """exp(mean next-token loss) of (W, L, V) logits on (W, L) ids."""
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), windows[:, 1:].flatten())
    return math.exp(loss.item())


def qkv_perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = torch.cat([model(row[None]).logits for row in windows])  # (W, L, V)
    return perplexity_of_logits(logits, windows)


def llama_cpp_perplexity(path: Path, windows: torch.Tensor) -> float | None:
    if importlib.util.find_spec("llama_cpp") is None:
        log("llama-cpp-python is not installed (make bench-peers): its row is left out")
        return None
    from llama_cpp import Llama

    length = windows.shape[1]
    llm = Llama(model_path=str(path), n_ctx=length, n_batch=length, logits_all=True,
                verbose=False)  # fmt: skip
    logits = []
    for row in windows.tolist():
        llm.reset()
        llm.eval(row)
        logits.append(torch.from_numpy(np.array(llm.scores[:length], dtype=np.float32)))
    return perplexity_of_logits(torch.stack(logits), windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--out", default=str(HERE / "results" / "perplexity_smollm2.json"))
    args = parser.parse_args()
    path = smollm2_file()
    file = read_gguf(path)
    windows = windows_of_text(tokenizer_from_metadata(file.metadata), args.windows, args.length)
    fp32 = model_from_file(file).eval()
    rows, kernels = [], {}

    def measure(name: str, model: torch.nn.Module) -> None:
        value = qkv_perplexity(model, windows)
        rows.append({"model": name, "perplexity": value})
        log(f"{name}: perplexity {value:.3f}")

    measure("fp32 (Q4_1 file dequantized)", fp32)
    shipped = quantized_from_gguf(file)
    kernels["Q4_1 file"] = explain_quantized(shipped)
    measure("Q4_1 file, through the kernels", shipped)
    del shipped
    for kind in ("Q8_0", "Q4_1", "Q4_0"):
        model = quantize(copy.deepcopy(fp32), kind, head_kind="Q8_0")
        kernels[kind] = explain_quantized(model)
        measure(f"{kind} (quantized again from fp32)", model)
        del model
    theirs = llama_cpp_perplexity(path, windows)
    if theirs is not None:
        rows.append({"model": "llama.cpp (Q4_1 file)", "perplexity": theirs})
        log(f"llama.cpp: perplexity {theirs:.3f}")
    reference = rows[0]["perplexity"]
    for row in rows:
        row["vs_fp32"] = row["perplexity"] / reference
    print(format_table([[r["model"], f"{r['perplexity']:.3f}", f"{r['vs_fp32']:.4f}"]
                        for r in rows], ["model", "perplexity", "vs fp32"]))  # fmt: skip
    payload = {
        "machine": machine_info("cpu"), "model": path.name, "windows": args.windows,
        "length": args.length, "tokens": args.windows * args.length, "kernels": kernels,
        "rows": rows,
    }  # fmt: skip
    log(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
