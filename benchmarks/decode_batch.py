"""Benchmark: greedy decoding of several sequences at once, qkv against transformers and
llama.cpp's batched decoding.

    .venv/bin/python benchmarks/decode_batch.py            # B = 8, fp32 and bf16 (a few minutes)
    .venv/bin/python benchmarks/decode_batch.py --quick    # smoke run: 16 new tokens, 2 rounds
    .venv/bin/python benchmarks/decode_batch.py --padded   # prompts of different lengths

The model and weights of benchmarks/decode.py (the ~55M Llama, built by transformers and loaded
by both libraries; llama.cpp reads them written as GGUF by benchmarks/peers.py). B prompts of 32
random tokens each (equal lengths: no padding, no attention_mask; with --padded, row b keeps
the last 32 - 2b of its tokens and is left-padded, with an attention_mask), 128 new tokens per
sequence, one call timed as a user sees it (prefill included):
    qkv            qkv.generation.generate(model, ids, max_new_tokens=128)
    qkv compiled   a packed copy (`packed_linears`, the block open for the whole row) with
                   generate(..., steps=decoding_steps(model)), compiled before the timing: the
                   step compiled ahead of time by AOTInductor where it can be exported, else
                   torch.compile's forward (as for the packed products of several rows)
    torch.compile  the same packed copy with steps=torch.compile(model, dynamic=True), as a
                   user would compile it (the inductor options of the aot steps)
    transformers   model.generate(ids, do_sample=False, max_new_tokens=128, min_new_tokens=128)
    llama.cpp      `peers.LlamaCppBatched`: a context with B sequence slots, all prompts in one
                   llama_decode, then one llama_decode per step holding each sequence's token
                   (a padded row's real tokens only)
tokens/s = B * 128 / the median seconds per call; "paired" ratios are medians of per-round
ratios. Every candidate's tokens are compared with transformers' before timing; in fp32,
llama.cpp is timed only if its tokens agree, or part from them only at near-ties of
transformers' logits (top-2 margin < NEAR_TIE: its default K/V cache is fp16, so its fp32 runs
are not exactly fp32; the margins are recorded). bf16 flips near-ties in every library.

At batch B a step reads every weight once for B tokens, so it is less memory-bound than at
batch 1 (decode.py): the products are (B, E) x (E, out) matrix products.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import tempfile
from pathlib import Path

import torch
import transformers
from common import (
    DTYPES,
    default_device,
    format_table,
    log,
    machine_info,
    time_interleaved,
    write_json,
)
from decode import LLAMA, build_models, first_divergence, paired_ratio
from peers import LlamaCppBatched, missing, write_gguf

from qkv.acceleration import decoding_steps, packed_linears
from qkv.acceleration.exported import INDUCTOR_OPTIONS
from qkv.generation import generate

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 1.0  # qkv's fastest path over llama.cpp, tokens/s
# A top-2 logit margin below this (logits of magnitude ~2 here) is a near-tie that another
# order of fp32 sums, or llama.cpp's fp16 K/V cache (its default), may flip.
NEAR_TIE = 1e-3


def padding_mask(batch: int, prompt: int) -> torch.Tensor:
    """(batch, prompt) bool, True on real tokens: row b keeps its last prompt - 2b tokens (at
    least half of them)."""
    lengths = torch.tensor([max(prompt - 2 * b, prompt // 2) for b in range(batch)])
    return torch.arange(prompt) >= (prompt - lengths)[:, None]


PAD = 0  # the id the padded positions hold


def tie_margins(theirs, ids, mask, reference: torch.Tensor, output: torch.Tensor) -> list[float]:
    """For each row where `output`'s new tokens part from transformers' (`reference`), the top-2
    margin of transformers' logits on the common prefix (the row's real tokens): how near a tie
    the parting was."""
    margins = []
    L = ids.shape[1]
    for b in range(len(reference)):
        step = first_divergence(output[b, L:], reference[b])
        if step is None:
            continue
        real = ids[b] if mask is None else ids[b][mask[b]]
        prefix = torch.cat([real, reference[b, :step]])[None]  # (1, length + step)
        with torch.no_grad():
            logits = theirs(input_ids=prefix).logits[0, -1].float()
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
    return margins


def bench_dtype(base_ours, base_theirs, dtype: str, args) -> dict:
    """One row: tokens/s of each candidate at batch args.batch, and the tokens check."""
    ours = copy.deepcopy(base_ours).to(DTYPES[dtype])
    theirs = copy.deepcopy(base_theirs).to(DTYPES[dtype])
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch, args.prompt)
    ids = torch.randint(0, LLAMA["vocab_size"], shape, generator=generator).to(args.device)
    mask = padding_mask(args.batch, args.prompt).to(args.device) if args.padded else None
    ids = ids if mask is None else ids.masked_fill(~mask, PAD)
    hf_mask = {} if mask is None else {"attention_mask": mask.long(), "pad_token_id": PAD}
    n = args.new_tokens
    packed_model = copy.deepcopy(ours)
    stack = contextlib.ExitStack()
    stack.enter_context(packed_linears(packed_model, batch_hint=args.batch))
    steps = decoding_steps(packed_model)
    user_compiled = torch.compile(packed_model, dynamic=True, options=INDUCTOR_OPTIONS)

    def qkv_call(model, steps=None):
        return lambda: generate(model, ids, attention_mask=mask, max_new_tokens=n, steps=steps)

    calls = {
        "qkv": qkv_call(ours),
        "qkv_compiled": qkv_call(packed_model, steps),
        "torch_compile": qkv_call(packed_model, user_compiled),
        "transformers": lambda: theirs.generate(
            ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, **hf_mask
        ),
    }
    info: dict = {}
    absent = missing()
    if absent is None:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="qkv-batch-"))
        path = write_gguf(theirs, Path(directory) / f"model-{dtype}.gguf", dtype)
        llama = LlamaCppBatched(
            path, sequences=args.batch, context=args.prompt + n, threads=torch.get_num_threads()
        )
        stack.callback(llama.close)
        calls["llama_cpp"] = lambda: llama.generate(ids, n, mask)
        info["llama_cpp"] = {"version": llama.version, "gguf_bytes": path.stat().st_size}
    else:
        log(absent)
        info["llama_cpp"] = absent
    log(f"{dtype}: compiling, checking tokens ...")
    reference = calls["transformers"]()[:, args.prompt :]
    divergence = {}
    for name, call in calls.items():
        new = call()[:, args.prompt :]  # (B, n); the compiled call compiles here
        steps = [first_divergence(new[b], reference[b]) for b in range(args.batch)]
        divergence[name] = {"rows_equal": sum(s is None for s in steps), "first_steps": steps}
    info["tokens_vs_transformers"] = divergence
    if "llama_cpp" in calls and dtype == "fp32":
        margins = tie_margins(theirs, ids, mask, reference, calls["llama_cpp"]())
        info["llama_cpp_margins_at_divergence"] = margins
        if any(margin >= NEAR_TIE for margin in margins):
            log("llama.cpp's fp32 tokens differ from transformers' past a near-tie: not timed")
            del calls["llama_cpp"]
    log(f"{dtype}: timing ...")
    timings = time_interleaved(
        calls,
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        min_repeats=min(args.repeats, 3),
        budget_s=args.budget,
    )
    stack.close()
    tokens = args.batch * n
    speed = {name: tokens / t.median for name, t in timings.items()}
    fastest = max(("qkv", "qkv_compiled"), key=lambda name: speed[name])
    row = {
        "dtype": dtype,
        "batch": args.batch,
        "prompt": args.prompt,
        "prompt_lengths": [args.prompt] * args.batch if mask is None else mask.sum(1).tolist(),
        "new_tokens": n,
        "tokens_per_s": speed,
        "qkv_fastest": fastest,
        # qkv's faster path over each other candidate, paired (above 1: qkv is faster)
        "paired_ratios": {
            name: paired_ratio(timings[name], timings[fastest])
            for name in ("transformers", "llama_cpp")
            if name in timings
        },
        # qkv's compiled steps over the user's own torch.compile, both on the packed model
        "compiled_over_torch_compile": paired_ratio(
            timings["torch_compile"], timings["qkv_compiled"]
        ),
        "peers": info,
        "timings": {name: t.as_dict() for name, t in timings.items()},
    }
    calls.clear()  # the models go with the closures
    gc.collect()
    return row


def table(rows: list[dict]) -> str:
    names = ("qkv", "qkv_compiled", "torch_compile", "transformers", "llama_cpp")
    header = ["dtype", "B", *(f"{n} tok/s" for n in names), "qkv/hf", "qkv/llama.cpp"]
    header += ["compiled/torch.compile"]
    body = []
    for r in rows:
        ratios = r["paired_ratios"]
        body.append(
            [
                r["dtype"],
                str(r["batch"]),
                *(f"{r['tokens_per_s'][n]:.1f}" if n in r["tokens_per_s"] else "-" for n in names),
                f"{ratios['transformers']:.3f}",
                f"{ratios['llama_cpp']:.3f}" if "llama_cpp" in ratios else "-",
                f"{r['compiled_over_torch_compile']:.3f}",
            ]
        )
    return format_table(body, header)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens, 2 rounds: a smoke run")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded at once")
    parser.add_argument("--padded", action="store_true",
                        help="prompts of different lengths, left-padded")  # fmt: skip
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per dtype (at most)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of timing per dtype")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_batch.json")
    args = parser.parse_args(argv)
    if args.padded:
        args.out = args.out.with_name(args.out.stem + "_padded.json")
    if args.quick:
        args.new_tokens, args.repeats, args.budget = 16, 2, 5.0
        args.out = args.out.with_name(args.out.stem + "_quick.json")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    log("building the models ...")
    ours, theirs = build_models(args.device)
    rows = [bench_dtype(ours, theirs, dtype, args) for dtype in args.dtypes]
    info = machine_info(args.device)
    print(f"# {info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}")
    print(table(rows))
    payload = {"machine": info, "transformers": transformers.__version__, "rows": rows}
    payload["targets"] = {"qkv_over_llama_cpp": TARGET_RATIO}
    write_json(args.out, payload)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
