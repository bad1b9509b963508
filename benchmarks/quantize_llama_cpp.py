"""Parity, not speed: qkv's Q8_0, Q4_1 and Q4_0 blocks against llama.cpp's own quantizer.

    .venv/bin/python benchmarks/quantize_llama_cpp.py   # needs llama-cpp-python: make bench-peers

SmolLM2-135M-Instruct's weights (the shipped Q4_1 file, dequantized) written by qkv's GGUF writer
in F32; llama.cpp quantizes that file (`llama_model_quantize`, the library behind llama-quantize,
with `pure` set, so that every matrix takes the type asked for rather than llama.cpp's choice of
a higher one for some); qkv writes the same float model in the same type (`save_gguf`, whose
blocks are `qkv.quantize`'s). Per type: how many of the files' tensors hold the same bytes, and
for any that do not, the largest difference of their dequantized values. Written to
results/quantize_llama_cpp.json with the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import numpy as np
from common import log, machine_info, write_json
from load_gguf import smollm2_file, write_again

from qkv.models.gguf import read_gguf
from qkv.models.gguf.quants import dequantize

HERE = Path(__file__).resolve().parent
FTYPES = {"Q8_0": 7, "Q4_1": 3, "Q4_0": 2}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def llama_cpp_quantized(source: Path, target: Path, kind: str) -> Path:
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = FTYPES[kind], True, 2
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(target).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status} for {kind}")
    return target


def compare(ours: Path, theirs: Path) -> dict:
    """Tensors with the same type and bytes in both files; the others, named, with the largest
    difference of their values."""
    a, b = read_gguf(ours).tensors, read_gguf(theirs).tensors
    differing = []
    for name, tensor in a.items():
        other = b.get(name)
        if other is None or other.kind != tensor.kind:
            differing.append({"tensor": name, "kinds": [tensor.kind, other and other.kind]})
        elif not np.array_equal(tensor.raw, other.raw):
            values = [dequantize(t.raw, t.kind, t.shape) for t in (tensor, other)]
            gap = float((values[0] - values[1]).abs().max())
            differing.append({"tensor": name, "max_abs_value_diff": gap})
    return {"tensors": len(a), "same_bytes": len(a) - len(differing), "differing": differing,
            "only_in_llama_cpp": sorted(set(b) - set(a))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "quantize_llama_cpp.json"))
    args = parser.parse_args()
    import llama_cpp

    shipped = smollm2_file()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qkv-quantize-") as folder:
        folder = Path(folder)
        f32 = write_again(shipped, folder, "F32")
        for kind in FTYPES:
            ours = write_again(shipped, folder, kind)
            theirs = llama_cpp_quantized(f32, folder / f"llama-cpp.{kind}.gguf", kind)
            blocks = sum(t.kind == kind for t in read_gguf(ours).tensors.values())
            rows.append({"kind": kind, "tensors_of_kind": blocks, **compare(ours, theirs)})
            log(f"{kind}: {rows[-1]['same_bytes']} of {rows[-1]['tensors']} tensors the same bytes")
    payload = {
        "machine": machine_info("cpu"), "model": shipped.name,
        "llama_cpp": {"version": llama_cpp.__version__}, "rows": rows,
    }  # fmt: skip
    log(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
