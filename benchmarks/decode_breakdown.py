"""Benchmark: where a compiled decoding step's time goes, beside llama.cpp's whole step.

    .venv/bin/python benchmarks/decode_breakdown.py            # fp32 and bf16 (2-4 min)
    .venv/bin/python benchmarks/decode_breakdown.py --dtype fp32 --repeats 4

The model, prompt and packed, compiled qkv call are those of benchmarks/decode.py (batch 1, a
32-token prompt, 128 new tokens, `generate(..., compile=True)` inside `packed_linears`). Each
qkv call is split, by timers around two calls, into

    kernels        inside inductor's compiled graph (`CompiledFxGraph.__call__`): the C++
                   kernels and the extern calls (SDPA) of the 127 decoding steps
    before graph   from `CompiledSteps.__call__` to the graph: gathering its inputs (from
                   the sixth step on by the plan of qkv.acceleration.flat_call, before that
                   by torch.compile's rewritten forward walking the module tree),
                   and AOTAutograd's runtime wrapper
    after graph    from the graph's return to the step's: the output object, side effects
    outside steps  the rest of the call: the prefill (eager, packed), and per step the
                   loop's own work (the finiteness check, the argmax, positions, tokens)

llama.cpp (llama-cpp-python, the GGUF of benchmarks/peers.py) is timed in the same rounds, so
"qkv / llama.cpp" compares whole calls on one machine state, and "kernels / llama.cpp" what
qkv's step would take with no Python around its graph. Fastest round of each. The timers read
torch's private `CompiledFxGraph` class: a torch that moves it stops this script, not qkv.
Results: benchmarks/results/decode_breakdown.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QKV_COMPILE_CACHE", "off")  # compile here: no graph stored elsewhere

import torch
from common import DTYPES, log, machine_info, write_json
from decode import LLAMA, build_models
from peers import LlamaCpp, missing, write_gguf
from torch._inductor.output_code import CompiledFxGraph

from qkv.acceleration import compiled, packed_linears
from qkv.generation import generate

RESULTS = Path(__file__).resolve().parent / "results"


class StepTimers:
    """Seconds spent in the compiled graph, before it and after it, summed over steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.kernels = self.before = self.after = 0.0
        self.steps = 0
        self._entered = self._returned = 0.0

    @contextlib.contextmanager
    def installed(self):
        step_call, graph_call = compiled.CompiledSteps.__call__, CompiledFxGraph.__call__

        def step(steps, *args, **kwargs):
            self._entered = time.perf_counter()
            output = step_call(steps, *args, **kwargs)
            self.after += time.perf_counter() - self._returned
            self.steps += 1
            return output

        def graph(graph_self, *args, **kwargs):
            started = time.perf_counter()
            self.before += started - self._entered
            output = graph_call(graph_self, *args, **kwargs)
            self._returned = time.perf_counter()
            self.kernels += self._returned - started
            return output

        compiled.CompiledSteps.__call__, CompiledFxGraph.__call__ = step, graph
        try:
            yield self
        finally:
            compiled.CompiledSteps.__call__, CompiledFxGraph.__call__ = step_call, graph_call


def breakdown(base, theirs, dtype: str, rounds: int, new_tokens: int) -> dict:
    """The fastest round's split of one qkv call, and llama.cpp's fastest call, in ms."""
    model = copy.deepcopy(base).to(DTYPES[dtype])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 32), generator=generator)
    block = contextlib.ExitStack()
    block.enter_context(packed_linears(model))
    log(f"{dtype}: compiling ...")
    generate(model, ids, max_new_tokens=new_tokens, compile=True)
    llama = None
    if missing() is None:
        folder = Path(tempfile.mkdtemp(prefix="qkv-breakdown-"))
        gguf = write_gguf(copy.deepcopy(theirs).to(DTYPES[dtype]), folder / "m.gguf", dtype)
        llama = LlamaCpp(gguf, context=32 + new_tokens, threads=torch.get_num_threads())
    best, llama_ms = None, None
    timers = StepTimers()
    log(f"{dtype}: timing {rounds} rounds ...")
    for _ in range(rounds):
        with timers.installed():
            timers.reset()
            started = time.perf_counter()
            generate(model, ids, max_new_tokens=new_tokens, compile=True)
            total = time.perf_counter() - started
        row = {"total": total, "kernels": timers.kernels, "before graph": timers.before,
               "after graph": timers.after}  # fmt: skip
        row["outside steps"] = total - timers.kernels - timers.before - timers.after
        if best is None or total < best["total"]:
            best = {name: seconds * 1e3 for name, seconds in row.items()}
            best["steps"] = timers.steps
        if llama is not None:
            started = time.perf_counter()
            llama.generate(ids, new_tokens)
            seconds = (time.perf_counter() - started) * 1e3
            llama_ms = seconds if llama_ms is None else min(llama_ms, seconds)
    block.close()
    return {"dtype": dtype, "new_tokens": new_tokens, "qkv_ms": best, "llama_cpp_ms": llama_ms}


def table(rows: list[dict]) -> str:
    lines = [
        "| dtype | part | ms per call | ms per step | share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        qkv, steps = row["qkv_ms"], row["qkv_ms"]["steps"]
        for part in ("kernels", "before graph", "after graph", "outside steps", "total"):
            lines.append(f"| {row['dtype']} | {part} | {qkv[part]:.1f} | "
                         f"{qkv[part] / steps:.3f} | {qkv[part] / qkv['total']:.1%} |")  # fmt: skip
        if row["llama_cpp_ms"] is not None:
            llama = row["llama_cpp_ms"]
            lines.append(f"| {row['dtype']} | llama.cpp, whole call | {llama:.1f} | "
                         f"{llama / row['new_tokens']:.3f} | qkv / llama.cpp "
                         f"{llama / qkv['total']:.2f}x, kernels alone "
                         f"{llama / qkv['kernels']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument(
        "--repeats", type=int, default=8, help="interleaved rounds; the fastest counts"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base, theirs = build_models("cpu")
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    rows = [breakdown(base, theirs, dtype, args.repeats, args.new_tokens) for dtype in dtypes]
    print(table(rows))
    payload = {"machine": machine_info("cpu"), "command": " ".join(sys.argv), "rows": rows}
    log(f"wrote {write_json(RESULTS / 'decode_breakdown.json', payload)}")


if __name__ == "__main__":
    main()
