"""Benchmark: where a decoding step's time goes, beside llama.cpp's whole step.

    .venv/bin/python benchmarks/decode_breakdown.py            # fp32 and bf16 (3-5 min)
    .venv/bin/python benchmarks/decode_breakdown.py --dtype fp32 --repeats 4

The model, prompt and packed qkv call are those of benchmarks/decode.py (batch 1, a 32-token
prompt, 128 new tokens, `generate(..., steps=qkv.acceleration.decoding_steps(model))` inside
`packed_linears`: the step compiled ahead of time by AOTInductor). Each qkv call is split, by
timers around two calls, into

    library        inside the AOTInductor library's `boxed_run`: its C++ wrapper, kernels,
                   allocations and extern calls (SDPA) for the 127 decoding steps
    into library   from `ExportedStep.run` (what the steps call for a step it serves) to the
                   library: which calls it serves, the list of its inputs
    after library  from the library's return to the step's: the cache's new length
    outside steps  the rest of the call: the prefill (eager, packed), and per step the
                   loop's own work (the finiteness check of the row maxima the library
                   returns, positions, tokens)

and the same library compiled for one thread is timed alone ("library, 1 thread"), so that
its ratio to the two-thread figure tells how much the second core buys: the kernels stream the
weights, and every parallel loop ends at a barrier.

llama.cpp (llama-cpp-python, the GGUF of benchmarks/peers.py) is timed in the same rounds, so
"qkv / llama.cpp" compares whole calls on one machine state, and "library / llama.cpp" what
qkv's step would take with no Python around it. Fastest round of each. The timers wrap the
loaded library's runner, which is torch's private AOTInductor class: a torch that changes it
stops this script, not qkv. Results: benchmarks/results/decode_breakdown.json.
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

os.environ.setdefault("QKV_COMPILE_CACHE", "off")  # compile here: no library stored elsewhere

import torch
from common import DTYPES, log, machine_info, write_json
from decode import LLAMA, build_models
from peers import LlamaCpp, missing, write_gguf

from qkv.acceleration import decoding_steps, exported, packed_linears
from qkv.generation import generate

RESULTS = Path(__file__).resolve().parent / "results"


class StepTimers:
    """Seconds spent in the library, before it and after it, summed over steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.library = self.before = self.after = 0.0
        self.steps = 0
        self._entered = self._returned = 0.0

    @contextlib.contextmanager
    def installed(self, model):
        """Timers around `ExportedStep.run`, and around the boxed_run of
        `model`'s loaded libraries (a stand-in object with the runner's other attributes)."""
        step_run = exported.ExportedStep.run
        runners = exported._RUNNERS.get(model, {}).values()
        served = [runner for runner in runners if not isinstance(runner, str)]  # str: a reason
        loaders = [runner.loader for runner in served]
        timers = self

        class TimedLoader:
            def __init__(self, loader) -> None:
                self.loader = loader

            def __getattr__(self, name):
                return getattr(self.loader, name)

            def boxed_run(self, inputs):
                started = time.perf_counter()
                timers.before += started - timers._entered
                output = self.loader.boxed_run(inputs)
                timers._returned = time.perf_counter()
                timers.library += timers._returned - started
                return output

        def timed(method):
            def step(steps, *args, **kwargs):
                self._entered = time.perf_counter()
                output = method(steps, *args, **kwargs)
                if output is not None:  # None: the library did not serve the step, nothing ran
                    self.after += time.perf_counter() - self._returned
                    self.steps += 1
                return output

            return step

        for runner, loader in zip(served, loaders, strict=True):
            runner.loader = TimedLoader(loader)
        exported.ExportedStep.run = timed(step_run)
        try:
            yield self
        finally:
            exported.ExportedStep.run = step_run
            for runner, loader in zip(served, loaders, strict=True):
                runner.loader = loader


def library_one_thread(base, dtype: str, ids, rounds: int, new_tokens: int) -> float:
    """ms per call in the library compiled for, and run on, one thread (fastest round)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = copy.deepcopy(base).to(DTYPES[dtype])
        with packed_linears(model):
            generate(model, ids, max_new_tokens=new_tokens, steps=decoding_steps(model))
            timers, best = StepTimers(), None
            for _ in range(rounds):
                with timers.installed(model):
                    timers.reset()
                    generate(model, ids, max_new_tokens=new_tokens, steps=decoding_steps(model))
                if not timers.steps:
                    raise RuntimeError(f"{dtype}, 1 thread: no step ran through the library")
                best = timers.library if best is None else min(best, timers.library)
        return best * 1e3
    finally:
        torch.set_num_threads(threads)


def breakdown(base, theirs, dtype: str, rounds: int, new_tokens: int) -> dict:
    """The fastest round's split of one qkv call, and llama.cpp's fastest call, in ms."""
    model = copy.deepcopy(base).to(DTYPES[dtype])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 32), generator=generator)
    block = contextlib.ExitStack()
    block.enter_context(packed_linears(model))
    log(f"{dtype}: compiling ...")
    generate(model, ids, max_new_tokens=new_tokens, steps=decoding_steps(model))
    llama = None
    if missing() is None:
        folder = Path(tempfile.mkdtemp(prefix="qkv-breakdown-"))
        gguf = write_gguf(copy.deepcopy(theirs).to(DTYPES[dtype]), folder / "m.gguf", dtype)
        llama = LlamaCpp(gguf, context=32 + new_tokens, threads=torch.get_num_threads())
    best, llama_ms = None, None
    timers = StepTimers()
    log(f"{dtype}: timing {rounds} rounds ...")
    for _ in range(rounds):
        with timers.installed(model):
            timers.reset()
            started = time.perf_counter()
            generate(model, ids, max_new_tokens=new_tokens, steps=decoding_steps(model))
            total = time.perf_counter() - started
        row = {"total": total, "library": timers.library, "into library": timers.before,
               "after library": timers.after}  # fmt: skip
        row["outside steps"] = total - timers.library - timers.before - timers.after
        if best is None or total < best["total"]:
            best = {name: seconds * 1e3 for name, seconds in row.items()}
            best["steps"] = timers.steps
        if llama is not None:
            started = time.perf_counter()
            llama.generate(ids, new_tokens)
            seconds = (time.perf_counter() - started) * 1e3
            llama_ms = seconds if llama_ms is None else min(llama_ms, seconds)
    block.close()
    if not best["steps"]:
        raise RuntimeError(f"{dtype}: no step ran through the exported library")
    log(f"{dtype}: the library for one thread ...")
    best["library, 1 thread"] = library_one_thread(base, dtype, ids, rounds, new_tokens)
    return {"dtype": dtype, "new_tokens": new_tokens, "qkv_ms": best, "llama_cpp_ms": llama_ms}


def table(rows: list[dict]) -> str:
    lines = [
        "| dtype | part | ms per call | ms per step | share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        qkv, steps = row["qkv_ms"], row["qkv_ms"]["steps"]
        for part in ("library", "into library", "after library", "outside steps", "total"):
            lines.append(f"| {row['dtype']} | {part} | {qkv[part]:.1f} | "
                         f"{qkv[part] / steps:.3f} | {qkv[part] / qkv['total']:.1%} |")  # fmt: skip
        if row["llama_cpp_ms"] is not None:
            llama = row["llama_cpp_ms"]
            lines.append(f"| {row['dtype']} | llama.cpp, whole call | {llama:.1f} | "
                         f"{llama / row['new_tokens']:.3f} | qkv / llama.cpp "
                         f"{llama / qkv['total']:.2f}x, library alone "
                         f"{llama / qkv['library']:.2f}x |")  # fmt: skip
        one = qkv["library, 1 thread"]
        lines.append(
            f"| {row['dtype']} | library, 1 thread | {one:.1f} | {one / steps:.3f} | "
            f"2 threads are {one / qkv['library']:.2f}x as fast |"
        )
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
