"""Benchmark: what qkv's activation points cost in decoding, unused and used.

    .venv/bin/python benchmarks/inspect_overhead.py            # 64 new tokens, 9 rounds
    .venv/bin/python benchmarks/inspect_overhead.py --quick    # smoke run: 8 new tokens

`qkv.inspect`'s points are forward hooks that `run_with_cache` and `hooks` install and remove on
leaving (qkv.analysis.inspection.hooks): a model that is not being inspected runs its plain
forward. Measured on benchmarks/decode.py's Llama (qkv only, fp32, batch 1, a 32-token prompt),
greedy `qkv.generation.generate`, one call timed as a user sees it, the candidates interleaved:
    never inspected     the model as loaded
    after inspection    a copy of the same weights after `run_with_cache` of every point and a
                        generate call inside `hooks` (one head zeroed), both left
    read-only hooks     the copy inside `hooks` with a function that returns None on every
                        block's resid_post (the cost while inspecting)
tokens/s = new tokens / the median seconds per call; "paired" the median of per-round ratios to
"never inspected". The greedy tokens of the first two must be equal.
Written to results/inspect_overhead.json with the machine.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from common import format_table, log, machine_info, time_interleaved, write_json
from decode import LLAMA, build_models, paired_ratio

from qkv import inspect
from qkv.generation import generate

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (8 new tokens)")
    args = parser.parse_args(argv)
    new_tokens, rounds = (8, 2) if args.quick else (64, 9)
    torch.manual_seed(0)
    plain, _ = build_models("cpu")
    inspected = copy.deepcopy(plain)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))

    log("inspecting the copy: every point cached, then a head zeroed while generating")
    inspect.run_with_cache(inspected, ids)

    def zero_head(tensor, name):  # (B, L, H, D)
        tensor = tensor.clone()
        tensor[:, :, 0] = 0
        return tensor

    with inspect.hooks(inspected, {"blocks.0.attn.head_out": zero_head}):
        ablated = generate(inspected, ids, max_new_tokens=new_tokens)
    expected = generate(plain, ids, max_new_tokens=new_tokens)
    same = torch.equal(generate(inspected, ids, max_new_tokens=new_tokens), expected)

    def read_only():
        with inspect.hooks(inspected, {"blocks.*.resid_post": lambda tensor, name: None}):
            return generate(inspected, ids, max_new_tokens=new_tokens)

    candidates = {
        "never inspected": lambda: generate(plain, ids, max_new_tokens=new_tokens),
        "after inspection": lambda: generate(inspected, ids, max_new_tokens=new_tokens),
        "read-only hooks": read_only,
    }
    log(f"timing {len(candidates)} candidates, {rounds} rounds")
    timings = time_interleaved(candidates, device="cpu", warmup=1, repeats=rounds,
                               min_repeats=rounds)  # fmt: skip
    rows = [{
        "candidate": name, "tokens_per_s": new_tokens / timing.median,
        "paired_vs_never": paired_ratio(timings["never inspected"], timing), **timing.as_dict(),
    } for name, timing in timings.items()]  # fmt: skip
    print(format_table([[r["candidate"], f"{r['tokens_per_s']:.1f}", f"{r['paired_vs_never']:.3f}"]
                        for r in rows], ["candidate", "tokens/s", "paired vs never"]))  # fmt: skip
    print(f"same tokens after inspection: {same}; a zeroed head changed them: "
          f"{not torch.equal(ablated, expected)}")  # fmt: skip
    name = "inspect_overhead_quick.json" if args.quick else "inspect_overhead.json"
    write_json(RESULTS / name, {
        "machine": machine_info("cpu"), "new_tokens": new_tokens, "rounds": rounds, "rows": rows,
        "same_tokens_after_inspection": same,
        "ablation_changed_tokens": not torch.equal(ablated, expected),
    })  # fmt: skip


if __name__ == "__main__":
    main()
