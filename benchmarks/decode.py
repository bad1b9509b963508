"""Benchmark: greedy decoding, qkv.generation.generate against transformers and llama.cpp.

    .venv/bin/python benchmarks/decode.py            # fp32 and bf16, 128 new tokens (1-4 min)
    .venv/bin/python benchmarks/decode.py --quick    # smoke run: 16 new tokens, 2 rounds

The model: a ~55M-parameter Llama (E = 512, 8 layers, 8 query heads over 2 K/V heads, SwiGLU
FFN of 1408, vocabulary 32000, separate lm_head), built by transformers' LlamaForCausalLM under
torch.manual_seed(0), saved with save_pretrained, and loaded from that directory by both
qkv.models.GPT.from_pretrained and LlamaForCausalLM.from_pretrained(attn_implementation="sdpa"),
so both hold the same weights. Each dtype casts both models with .to(dtype).

One call, timed as a user sees it (prefill included), batch 1, a 32-token prompt (no padding,
no attention_mask for either), 128 new tokens:
    qkv            qkv.generation.generate(model, ids, max_new_tokens=128)
                   (greedy, eager: the model's own forward at every step)
    qkv packed     the same on a copy inside `with qkv.acceleration.packed_linears(model):`
                   (oneDNN-packed weights, fused where they read one input, what `qkv
                   generate` does on the CPU); the block stays open for the whole row, so
                   the weights are packed once, by the warm-up call, as in a program that
                   loads a model and generates many times; the time spent packing is
                   reported beside ("pack ms")
    qkv compiled   the same packed copy with generate(..., steps=qkv.acceleration.decoding_steps(
                   model, "compiled")): every step after the
                   prefill runs the model's forward compiled by torch.compile (inductor, C++
                   kernels for everything around the packed products); compiled once per
                   dtype before the timing, with torch.compile's on-disk caches empty (a
                   directory of this run's own) so that the compile time reported beside
                   ("compile s", the first call's wall time) is what a first run pays, and
                   a new process then pays its first call with what that compile left
                   (torch.compile's caches, qkv's compile store): "next process"; once
                   two steps passed a graph's guards, later steps call it without them
    qkv aot        the same packed copy with generate(..., steps=decoding_steps(model)): the
                   step exported
                   once and compiled ahead of time by AOTInductor into a library whose C++
                   wrapper calls the same kernels, no Python between them
                   (qkv.acceleration.exported); compiled after torch.compile's, its first call
                   timed the same way ("aot compile s", "next process")
    transformers   model.generate(ids, do_sample=False, max_new_tokens=128,
                                  min_new_tokens=128, eos_token_id=None)
The peers a CPU user would run instead (benchmarks/peers.py), timed in the same rounds:
    transformers compiled   the same generate on a copy with a static cache and its forward
                   compiled by torch.compile(fullgraph=True) (compiled before the timing,
                   "hf compile s")
    llama.cpp      llama-cpp-python on the same weights written as GGUF (fp32 or bf16
                   matrices), greedy by argmax; its fp32 tokens must equal transformers' or it
                   is not timed; absent (with how to install it) without `make bench-peers`
The config has no eos token, so neither stops early and min_new_tokens masks nothing: both
produce exactly 128 tokens, which are compared (the first divergent step is reported, with each
model's top-2 logit margin and ties there: bf16 may flip near-ties). tokens/s = 128 / the
median seconds per call; "paired" is the median of the per-round ratios (rounds interleave the
candidates, so pairing cancels the drift of a shared machine).

The physical limit. At batch 1 every decoding step reads every weight once (of the token
embedding table only the looked-up row) and the K/V cache up to that step; the arithmetic is
~1 FLOP per byte, so the step is memory-bound:
    bytes per token = weight bytes + mean over the 128 forward passes of the K/V bytes read
    limit (tokens/s) = measured read bandwidth / bytes per token
The read bandwidth is measured here: the fastest of the .sum() calls over a 1 GiB fp32 tensor,
timed before the models and again inside every timing round (interleaved with the decoding, so
limit and figures come from the same machine state); a copy_ of it, read + write, is reported
beside it. The fastest probe of the whole run gives the limit of the strict "%lim" figure. On a
shared machine the read bandwidth can swing between states within seconds (on an AMD EPYC with
2 threads, a 256 MB .sum() reads ~31 or ~50 GB/s, alternating every 10-20 s, the same tensor or
a fresh one), so a single fast probe can set the limit for decoding calls that ran in the slow
state; "%lim paired" divides each round's tokens/s by the limit from that round's own probe
instead, and takes the median over rounds (as the "paired" ratio to transformers does). Also
reported, as diagnostics: the "matvec floor", tokens/s if a step did nothing but the model's
own matrix-vector products (F.linear over every projection and the lm_head, one token) with
PyTorch's kernels here, the "packed matvec floor", the same for the packed (and fused)
products a packed step calls, and the "compiled matvec floor", the same for the products of a
compiled step: at one row these are inductor's own streaming reductions over the plain weights
(qkv.acceleration.packing), all in one compiled graph. The second bounds what eager decoding
built on oneDNN's kernels can reach; the third bounds the compiled and aot steps, whose
steps add the norms, RoPE and attention to those products. Last,
the "weights .sum() floor": one .sum() per weight tensor a step reads, nothing else, i.e. how
fast this machine reads these tensors one call at a time (the 1 GiB probe streams one large
tensor). Each floor's timed call does 8 tokens' worth of its work, one after another, as a
decoding call's steps follow one another.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from common import (
    DTYPES,
    Timing,
    default_device,
    format_table,
    log,
    machine_info,
    time_interleaved,
    write_json,
)
from peers import peer_calls
from torch import nn
from torch._dynamo.utils import counters

from qkv.acceleration import (
    PackedLinear,
    SharedInputMember,
    decoding_steps,
    exported,
    packed_linears,
)
from qkv.acceleration.compiled import INDUCTOR_OPTIONS
from qkv.generation import generate
from qkv.models import GPT

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 1.5  # qkv tokens/s over transformers tokens/s
TARGET_FRACTION = 0.8  # qkv tokens/s over the memory-bandwidth limit
transformers.logging.set_verbosity_error()

LLAMA = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,  # no eos: both libraries generate exactly max_new_tokens
    "pad_token_id": None,
}


def build_models(device: str, **overrides) -> tuple[nn.Module, nn.Module]:
    """(qkv GPT, transformers LlamaForCausalLM), fp32, eval mode, the same weights; `overrides`
    change LLAMA's fields (benchmarks/kv_heads.py: the K/V heads)."""
    config = transformers.LlamaConfig(**{**LLAMA, **overrides})
    torch.manual_seed(0)
    built = transformers.LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as directory:
        built.save_pretrained(directory)
        ours = GPT.from_pretrained(directory)
        theirs = transformers.LlamaForCausalLM.from_pretrained(
            directory, attn_implementation="sdpa", dtype=torch.float32
        )
    del built
    return ours.to(device).eval(), theirs.to(device).eval()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def weight_bytes_read(model: GPT) -> int:
    """Bytes of parameters one decoding step reads: all of them, except that the token
    embedding table (V, E) gives only the one row looked up (E values)."""
    embedding = model.token_embedding.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embedding.numel() * embedding.element_size() + embedding[0].nbytes


def kv_bytes_read(model: GPT, prompt: int, new_tokens: int, element_size: int) -> float:
    """K/V cache bytes read per forward pass, averaged over the `new_tokens` passes of one
    generate call: pass j (0 = prefill) attends over prompt + j keys and values per layer."""
    c = model.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * element_size
    mean_keys = prompt + (new_tokens - 1) / 2
    return per_token * mean_keys


class Bandwidth:
    """Read bandwidth from .sum() over a `gib` GiB fp32 tensor, read + write bandwidth from
    copy_ into a second one. The read probe is also timed inside every round of the decoding
    benchmarks (`probe`), so that the limit comes from the same noisy machine as the figures it
    divides; the peak (fastest sample: noise only ever slows a call) is the limit."""

    def __init__(self, device: str, gib: float = 1.0) -> None:
        self.device = device
        self.x = torch.ones(int(gib * 2**30) // 4, device=device)
        self.read_samples: list[float] = []  # seconds per .sum()
        self.copy_samples: list[float] = []  # seconds per copy_

    def probe(self) -> torch.Tensor:
        return self.x.sum()

    def measure(self, repeats: int) -> None:
        y = torch.empty_like(self.x)
        timings = time_interleaved(
            {"sum": self.probe, "copy": lambda: y.copy_(self.x)},
            device=self.device,
            warmup=1,
            repeats=repeats,
            min_repeats=repeats,
        )
        self.read_samples += timings["sum"].samples
        self.copy_samples += timings["copy"].samples

    @property
    def read_peak(self) -> float:
        return self.x.nbytes / min(self.read_samples)

    def summary(self) -> dict:
        nbytes = self.x.nbytes
        return {
            "bytes": nbytes,
            "read_peak": self.read_peak,
            "read_median": nbytes / statistics.median(self.read_samples),
            "copy_peak": 2 * nbytes / min(self.copy_samples),
            "copy_median": 2 * nbytes / statistics.median(self.copy_samples),
            "read_samples_ms": [t * 1e3 for t in self.read_samples],
        }


def matvec_floor(model: GPT, device: str) -> Callable[[], None]:
    """One token through every nn.Linear of the model with F.linear, nothing else."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    dtype = linears[0].weight.dtype
    inputs = {m.in_features: torch.randn(1, 1, m.in_features, device=device, dtype=dtype)
              for m in linears}  # fmt: skip

    def run():
        with torch.no_grad():
            for m in linears:
                F.linear(inputs[m.in_features], m.weight, m.bias)

    return run


def read_floor(model: GPT) -> Callable[[], None]:
    """A .sum() over every weight tensor a step reads (the embedding table's one row), one call
    per tensor and nothing else: how fast PyTorch reads these tensors, with no arithmetic to
    speak of. Where it stays below the 1 GiB read peak, per-tensor calls on tensors of 0.5-65
    MB cannot stream at that peak, whatever the kernel."""
    embedding = model.token_embedding.weight
    tensors = [p for p in model.parameters() if p is not embedding] + [embedding[0]]

    def run():
        for tensor in tensors:
            tensor.sum()

    return run


def packed_matvec_floor(model: GPT, ids: torch.Tensor) -> Callable[[], None]:
    """One token through exactly the packed products a packed decoding step calls (q|k|v and
    gate|up fused once the first call has shown they read one input, out_proj, down_proj,
    lm_head), nothing else; packing happens here, outside the timing. The fastest this
    machine's kernels can make a step."""
    called: list[PackedLinear] = []

    def record(module, inputs, output):
        if inputs[0].numel() == module.in_features and module not in called:  # one row
            called.append(module)

    with packed_linears(model):
        generate(model, ids, max_new_tokens=2)  # the products learn which inputs they share
        groups = {m.group for m in model.modules() if isinstance(m, SharedInputMember)}
        fused = [product for group in groups for product in group.fused.values()]
        modules = [m for m in model.modules() if isinstance(m, PackedLinear)] + fused
        hooks = [m.register_forward_hook(record) for m in modules]
        generate(model, ids, max_new_tokens=2)  # the prefill, then one decoding step
        for hook in hooks:
            hook.remove()
    dtype = next(model.parameters()).dtype
    inputs = {m.in_features: torch.randn(1, 1, m.in_features, dtype=dtype) for m in called}

    def run():
        for m in called:
            m(inputs[m.in_features])

    return run


def compiled_matvec_floor(model: GPT) -> Callable[[], None]:
    """One token through every nn.Linear of the model as a compiled decoding step computes it
    (PackedLinear's one-row product: the streaming reduction inductor generates from it, with
    the step's inductor options), nothing else, compiled by AOTInductor as the aot steps
    compile a step (no Python between the kernels); compiled here, outside the timing. The
    fastest the products of the compiled and aot steps can make a step: what their
    fractions of the limit are to be read against."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    dtype = linears[0].weight.dtype
    widths = sorted({m.in_features for m in linears})

    class Products(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.products = [PackedLinear(linear) for linear in linears]  # hold no tensors
            self.linears = nn.ModuleList(linears)  # their weights: the library's constants

        def forward(self, *rows: torch.Tensor) -> torch.Tensor:  # one (1, 1, E) row a width
            by_width = dict(zip(widths, rows, strict=True))
            outputs = [p._matvec(by_width[p.in_features]) for p in self.products]
            return torch.cat(outputs, dim=-1)  # (1, 1, sum of out_features): one buffer

    rows = tuple(torch.randn(1, 1, width, dtype=dtype) for width in widths)
    module = Products()
    # as the step's library: its constants are the model's own tensors, not copies in the
    # library's file (whose pages the kernels would then read instead)
    configs = {**INDUCTOR_OPTIONS, "aot_inductor.package_constants_in_so": False}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        program = torch.export.export(module, rows, strict=False)
        path = Path(folder) / "products.pt2"
        exported._package(program, path, configs)
        runner = exported._Runner(torch._inductor.aoti_load_package(str(path)).loader)
    runner.use(dict(module.named_parameters(remove_duplicate=False)))
    inputs = list(rows)

    def run():
        runner.loader.boxed_run(list(inputs))  # as the aot steps call their library

    return run


FLOOR_TOKENS = 8  # the tokens' worth of work a floor's timed call does


def repeated(run: Callable[[], None]) -> Callable[[], None]:
    """A floor's one token, FLOOR_TOKENS times in one timed call: as a decoding call's steps
    follow one another, so that waking the threads and the caches is not counted as if each
    step paid it."""

    def run_tokens():
        for _ in range(FLOOR_TOKENS):
            run()

    return run_tokens


def packing_ms(model: GPT, ids: torch.Tensor) -> float:
    """Milliseconds spent packing the weights a packed generate call uses (packed at their
    first call: PackedLinear.packing_seconds, the fused products' included), in a fresh
    packed_linears block."""
    with packed_linears(model):
        generate(model, ids, max_new_tokens=2)
        groups = {m.group for m in model.modules() if isinstance(m, SharedInputMember)}
        fused = [product for group in groups for product in group.fused.values()]
        modules = [m for m in model.modules() if isinstance(m, PackedLinear)] + fused
        return 1e3 * sum(m.packing_seconds for m in modules)


def second_process_first_call(dtype: str, args) -> dict:
    """`first_call` run by a new process (this script with --first-call), which inherits this
    one's TORCHINDUCTOR_CACHE_DIR and QKV_COMPILE_CACHE: what a later run on this machine pays."""
    command = [sys.executable, __file__, "--first-call", dtype, "--prompt", str(args.prompt)]
    command += ["--new-tokens", str(args.new_tokens), "--device", args.device]
    command += ["--threads", str(torch.get_num_threads())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_call(dtype: str, args) -> dict:
    """A process's first call with torch.compile's steps on the packed model of this dtype: its
    seconds, the graphs torch.compile built, the same call again, and whether its tokens equal
    eager decoding's; then the same for the aot steps ("aot_": their compilations, 0 when the
    compile store served them)."""
    ours, _ = build_models(args.device)
    ours = ours.to(DTYPES[dtype])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, args.prompt), generator=generator)
    ids = ids.to(args.device)
    aot_compilations = []
    real_aot = exported._compile
    exported._compile = lambda *a: aot_compilations.append(1) or real_aot(*a)
    graphs = counters["stats"]["unique_graphs"]
    result = {}
    with packed_linears(ours):
        eager = generate(ours, ids, max_new_tokens=args.new_tokens)
        for prefix, mode in (("", "compiled"), ("aot_", "aot")):
            steps = decoding_steps(ours, mode)
            start = time.perf_counter()
            output = generate(ours, ids, max_new_tokens=args.new_tokens, steps=steps)
            result[f"{prefix}first_call_s"] = time.perf_counter() - start
            start = time.perf_counter()
            generate(ours, ids, max_new_tokens=args.new_tokens, steps=steps)
            result[f"{prefix}second_call_s"] = time.perf_counter() - start
            result[f"{prefix}equals_eager"] = bool(torch.equal(output, eager))
    compilations = counters["stats"]["unique_graphs"] - graphs
    return {**result, "compilations": compilations, "aot_compilations": len(aot_compilations)}


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing element of two 1-D token tensors, or None."""
    differ = (a != b).nonzero()
    return None if differ.numel() == 0 else int(differ[0, 0])


def near_tie(logits: torch.Tensor, chosen: dict[str, int]) -> dict:
    """How close a call was: the top-2 logits, how many tokens tie at the maximum, and the
    logit of each library's choice (all from one model's logits on the common prefix)."""
    logits = logits.float()
    values, indices = logits.topk(2)
    return {
        "top1": int(indices[0]),
        "top2": int(indices[1]),
        "margin": float(values[0] - values[1]),
        "tied_at_max": int((logits == values[0]).sum()),
        "logit_of_choice": {name: float(logits[token]) for name, token in chosen.items()},
    }


def check_tokens(ours, theirs, ids, new_tokens, calls) -> dict:
    """Run each once; compare the new tokens; at a divergence, each model's top-2 margin on
    the common prefix (a full forward pass without cache)."""
    out_ours, out_theirs = calls["qkv"](), calls["transformers"]()
    L = ids.shape[1]
    new_ours, new_theirs = out_ours[0, L:], out_theirs[0, L:]
    step = first_divergence(new_ours, new_theirs)
    result = {
        "new_tokens": {"qkv": new_ours.numel(), "transformers": new_theirs.numel()},
        "equal": step is None and new_ours.numel() == new_theirs.numel() == new_tokens,
        "first_divergence_step": step,
        "matching_steps": new_tokens if step is None else step,
    }
    if step is not None:
        prefix = out_ours[:, : L + step]
        chosen = {"qkv": int(new_ours[step]), "transformers": int(new_theirs[step])}
        with torch.no_grad():
            result["at_divergence"] = {
                "chosen": chosen,
                "qkv_logits": near_tie(ours(prefix).logits[0, -1], chosen),
                "transformers_logits": near_tie(theirs(input_ids=prefix).logits[0, -1], chosen),
            }
    return result


def bench_dtype(base_ours, base_theirs, dtype: str, bandwidth: Bandwidth, args) -> dict:
    """One row: tokens/s of each library, the tokens check, the bytes a token reads. The
    fields that need the bandwidth (known only after every row has probed it) come later,
    from `add_limits`."""
    ours = copy.deepcopy(base_ours).to(DTYPES[dtype])
    theirs = copy.deepcopy(base_theirs).to(DTYPES[dtype])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, args.prompt), generator=generator)
    ids = ids.to(args.device)
    n = args.new_tokens

    # The packed model: a copy whose packed_linears block stays open for the whole row, so
    # that its weights are packed once (by the first call, in the warm-up), as a program that
    # loads a model once and generates many times has them; `packing_ms` reports what packing
    # costs that first call.
    packed_model = copy.deepcopy(ours)
    packed_block = contextlib.ExitStack()
    packed_block.enter_context(packed_linears(packed_model))
    compiled, aot = decoding_steps(packed_model, "compiled"), decoding_steps(packed_model)
    calls = {
        "qkv": lambda: generate(ours, ids, max_new_tokens=n),
        "qkv_packed": lambda: generate(packed_model, ids, max_new_tokens=n),
        "qkv_compiled": lambda: generate(packed_model, ids, max_new_tokens=n, steps=compiled),
        "qkv_aot": lambda: generate(packed_model, ids, max_new_tokens=n, steps=aot),
        "transformers": lambda: theirs.generate(
            ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None
        ),
    }
    peer_dir = tempfile.TemporaryDirectory(prefix="qkv-decode-peers-")
    log(f"{dtype}: preparing the peers (transformers compiled, llama.cpp's GGUF) ...")
    peers, peer_info = peer_calls(theirs, dtype, ids, n, Path(peer_dir.name))
    if isinstance(peer_info.get("llama_cpp"), str):
        log(peer_info["llama_cpp"])
    calls.update(peers)
    log(f"{dtype}: checking tokens ...")
    check = check_tokens(ours, theirs, ids, n, calls)
    reference = calls["transformers"]()[0, args.prompt :]
    peer_info["first_divergence_from_transformers"] = {
        name: first_divergence(calls[name]()[0, args.prompt :], reference) for name in peers
    }  # None: the same n tokens
    llama_step = peer_info["first_divergence_from_transformers"].get("llama_cpp")
    if dtype == "fp32" and llama_step is not None:  # fp32 must agree before anything is timed
        log(f"llama.cpp's fp32 tokens differ from transformers' from step {llama_step}: not timed")
        del calls["llama_cpp"]
    if not check["equal"]:
        log(f"NOTE: {dtype}: greedy tokens differ from step {check['first_divergence_step']}")
    check["packed_equals_qkv"] = bool(torch.equal(calls["qkv_packed"](), calls["qkv"]()))
    log(f"{dtype}: compiling ...")
    start = time.perf_counter()
    compiled_output = calls["qkv_compiled"]()  # the first call compiles
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    aot_output = calls["qkv_aot"]()  # the first call exports and compiles the step
    aot_compile_s = time.perf_counter() - start
    check["aot_equals_compiled"] = bool(torch.equal(aot_output, compiled_output))
    log(f"{dtype}: a second process's first compiled call ...")
    warm = second_process_first_call(dtype, args)
    check["compiled_equals_qkv"] = bool(torch.equal(compiled_output, calls["qkv"]()))
    compiled_new = compiled_output[0, args.prompt :]
    check["compiled_first_divergence"] = {
        name: first_divergence(compiled_new, calls[name]()[0, args.prompt :])
        for name in ("qkv", "transformers")
    }  # None: the same 128 tokens
    log(f"{dtype}: timing ...")
    candidates = {
        **calls,
        "matvec_floor": repeated(matvec_floor(ours, args.device)),
        "packed_matvec_floor": repeated(packed_matvec_floor(ours, ids)),
        "compiled_matvec_floor": repeated(compiled_matvec_floor(ours)),
        "read_floor": repeated(read_floor(ours)),
        "bandwidth_probe": bandwidth.probe,
    }
    timings = time_interleaved(
        candidates,
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        min_repeats=min(args.repeats, 3),
        budget_s=args.budget,
    )
    packed_block.close()
    peer_dir.cleanup()
    probe = timings.pop("bandwidth_probe")
    bandwidth.read_samples += probe.samples
    element = next(ours.parameters()).element_size()
    weights = weight_bytes_read(ours)
    kv = kv_bytes_read(ours, args.prompt, n, element)
    speed = {name: n / timings[name].median for name in calls}
    floors = ("matvec_floor", "packed_matvec_floor", "compiled_matvec_floor", "read_floor")
    speed.update({name: FLOOR_TOKENS / timings[name].median for name in floors})
    best = {name: n / timings[name].min for name in calls}
    best.update({name: FLOOR_TOKENS / timings[name].min for name in floors})
    row = {
        "dtype": dtype,
        "batch": 1,
        "prompt": args.prompt,
        "new_tokens": n,
        "tokens_per_s": speed,
        "tokens_per_s_best": best,
        "ratio": speed["qkv"] / speed["transformers"],
        "paired_ratio": paired_ratio(timings["transformers"], timings["qkv"]),
        "packed_ratio": speed["qkv_packed"] / speed["transformers"],
        "packed_paired_ratio": paired_ratio(timings["transformers"], timings["qkv_packed"]),
        "compiled_ratio": speed["qkv_compiled"] / speed["transformers"],
        "compiled_paired_ratio": paired_ratio(timings["transformers"], timings["qkv_compiled"]),
        # the peers: qkv's fastest path over llama.cpp and over transformers compiled (paired)
        "peers": peer_info,
        "peer_paired_ratios": {
            name: paired_ratio(timings[name], timings["qkv_compiled"])
            for name in ("llama_cpp", "transformers_compiled")
            if name in timings
        },
        "aot_peer_paired_ratios": {
            name: paired_ratio(timings[name], timings["qkv_aot"])
            for name in ("llama_cpp", "transformers_compiled")
            if name in timings
        },
        # what the AOTInductor library buys over torch.compile's Python wrapper (paired)
        "aot_over_compiled_paired": paired_ratio(timings["qkv_compiled"], timings["qkv_aot"]),
        "aot_compile_s": aot_compile_s,
        "packing_ms": packing_ms(ours, ids),
        "compile_s": compile_s,
        # a new process, the same architecture, torch.compile's caches and qkv's compile store
        # as the first compile left them: its first call (loading, not compiling)
        "warm_compile": warm,
        "bytes_per_token": {"weights": weights, "kv_cache_mean": kv, "total": weights + kv},
        "bandwidth_probe_ms": [t * 1e3 for t in probe.samples],
        "tokens": check,
        "timings": {name: t.as_dict() for name, t in timings.items()},
    }
    gc.collect()
    return row


def add_limits(row: dict, read_bandwidth: float, probe_bytes: int) -> None:
    """The memory-bandwidth limit of a row, and each candidate's fraction of it: of the limit
    from the fastest probe of the whole run (the strict figure), and, per round, of the limit
    from that round's own probe (the median over rounds: "paired", as the ratios are)."""
    total = row["bytes_per_token"]["total"]
    limit = read_bandwidth / total
    row["bandwidth_limit_tokens_per_s"] = limit
    row["fraction_of_limit"] = {n: s / limit for n, s in row["tokens_per_s"].items()}
    row["fraction_of_limit_best"] = {n: s / limit for n, s in row["tokens_per_s_best"].items()}
    round_limits = [probe_bytes / (ms / 1e3) / total for ms in row["bandwidth_probe_ms"]]
    row["fraction_of_round_limit"] = {
        name: statistics.median(
            row["new_tokens"] / (ms / 1e3) / limit_r
            for ms, limit_r in zip(row["timings"][name]["samples_ms"], round_limits, strict=True)
        )
        for name in row["tokens_per_s"]
        if name in row["timings"] and not name.endswith("_floor")
    }


def paired_ratio(slow: Timing, fast: Timing) -> float:
    """Median over rounds of slow/fast: rounds are interleaved, so pairing cancels drift."""
    return statistics.median(a / b for a, b in zip(slow.samples, fast.samples, strict=True))


def table(rows: list[dict]) -> str:
    header = ["dtype", "qkv tok/s", "packed tok/s", "compiled tok/s", "hf tok/s", "qkv/hf"]
    header += ["packed/hf", "compiled/hf", "compiled/hf paired", "MB/token", "limit tok/s"]
    header += ["compiled %lim", "compiled %lim paired", "hf %lim", "packed matvec %lim"]
    header += ["compiled matvec %lim"]
    header += ["weights .sum() %lim"]
    header += ["pack ms", "compile s: cold / next process", "tokens equal"]
    body = []
    for r in rows:
        s, f, t = r["tokens_per_s"], r["fraction_of_limit"], r["tokens"]
        same = "yes" if t["equal"] else f"no: from step {t['first_divergence_step']}"
        same += "" if t["packed_equals_qkv"] else " (packed differs)"
        if not t["compiled_equals_qkv"]:
            steps = t["compiled_first_divergence"]
            qkv_step, hf_step = steps["qkv"], steps["transformers"]
            same += f" (compiled: from step {qkv_step} of qkv's, {hf_step} of hf's)"
        best_ratio = max(r["ratio"], r["packed_ratio"], r["compiled_ratio"])
        best_fraction = max(f["qkv"], f["qkv_packed"], f["qkv_compiled"])
        body.append(
            [
                r["dtype"],
                f"{s['qkv']:.1f}",
                f"{s['qkv_packed']:.1f}",
                f"{s['qkv_compiled']:.1f}",
                f"{s['transformers']:.1f}",
                f"{r['ratio']:.3f}",
                f"{r['packed_ratio']:.3f}",
                f"{r['compiled_ratio']:.3f}" + ("!" if best_ratio < TARGET_RATIO else " "),
                f"{r['compiled_paired_ratio']:.3f}",
                f"{r['bytes_per_token']['total'] / 1e6:.1f}",
                f"{r['bandwidth_limit_tokens_per_s']:.0f}",
                f"{100 * f['qkv_compiled']:.1f}%"
                + ("!" if best_fraction < TARGET_FRACTION else " "),
                f"{100 * r['fraction_of_round_limit']['qkv_compiled']:.1f}%",
                f"{100 * f['transformers']:.1f}%",
                f"{100 * f['packed_matvec_floor']:.1f}%",
                f"{100 * f['compiled_matvec_floor']:.1f}%",
                f"{100 * f['read_floor']:.1f}%",
                f"{r['packing_ms']:.0f}",
                f"{r['compile_s']:.1f} / {warm_compile(r)}",
                same,
            ]
        )
    return format_table(body, header)


def warm_compile(row: dict) -> str:
    """The next process's first compiled call, in seconds, or why there is none."""
    warm = row.get("warm_compile", {})
    if "first_call_s" not in warm:
        return "failed" if "error" in warm else "-"
    loaded = "" if warm["compilations"] == 0 else f" ({warm['compilations']} compiled)"
    return f"{warm['first_call_s']:.1f}{loaded}"


def peers_table(rows: list[dict]) -> str:
    """qkv's fastest path beside what a user would run instead, in the same rounds."""
    header = ["dtype", "qkv compiled tok/s", "qkv aot tok/s", "llama.cpp tok/s"]
    header += ["hf compiled tok/s", "compiled/llama.cpp paired", "aot/llama.cpp paired"]
    header += ["compiled/hf compiled paired", "aot %lim paired", "llama.cpp %lim"]
    header += ["hf compile s", "tokens vs hf (llama.cpp, hf compiled)"]
    body = []
    for r in rows:
        s, ratios, info = r["tokens_per_s"], r["peer_paired_ratios"], r["peers"]
        aot = r["aot_peer_paired_ratios"]
        steps = info["first_divergence_from_transformers"]
        same = {
            name: "equal" if steps.get(name, "-") is None else f"from step {steps.get(name, '-')}"
            for name in ("llama_cpp", "transformers_compiled")
        }

        body.append(
            [
                r["dtype"],
                f"{s['qkv_compiled']:.1f}",
                f"{s['qkv_aot']:.1f}",
                f"{s['llama_cpp']:.1f}" if "llama_cpp" in s else "-",
                f"{s['transformers_compiled']:.1f}",
                f"{ratios['llama_cpp']:.3f}" if "llama_cpp" in ratios else "-",
                f"{aot['llama_cpp']:.3f}" if "llama_cpp" in aot else "-",
                f"{ratios['transformers_compiled']:.3f}",
                f"{100 * r['fraction_of_round_limit']['qkv_aot']:.1f}%",
                f"{100 * r['fraction_of_round_limit']['llama_cpp']:.1f}%"
                if "llama_cpp" in s
                else "-",
                f"{info['hf_compile_s']:.1f}",
                f"{same['llama_cpp']}, {same['transformers_compiled']}",
            ]
        )
    return format_table(body, header)


def divergence_notes(rows: list[dict]) -> list[str]:
    notes = []
    for r in rows:
        d = r["tokens"].get("at_divergence")
        if d is None:
            continue
        c = d["chosen"]
        parts = []
        for name in ("qkv", "transformers"):
            z = d[f"{name}_logits"]
            parts.append(
                f"{name}'s top-2 margin {z['margin']:.3g} ({z['tied_at_max']} tokens tied at "
                f"the max), logits of the two choices {z['logit_of_choice']['qkv']:.4g} vs "
                f"{z['logit_of_choice']['transformers']:.4g}"
            )
        notes.append(
            f"{r['dtype']}: from step {r['tokens']['first_divergence_step']} of "
            f"{r['new_tokens']}: qkv chose {c['qkv']}, transformers {c['transformers']}; on the "
            f"common prefix (no cache): " + "; ".join(parts)
        )
    return notes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens, 2 rounds: a smoke run")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per dtype (at most)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=35.0, help="seconds of timing per dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode.json")
    parser.add_argument("--first-call", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats, args.budget = 16, 2, 5.0
        args.out = args.out.with_name(args.out.stem + "_quick.json")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.first_call:  # the second process of `second_process_first_call`
        print(json.dumps(first_call(args.first_call, args)))
        return
    # A cold compile, as a first run pays it: torch.compile's caches (inductor's kernels and
    # graphs, AOTAutograd's) and qkv's compile store start empty, in directories of this run's
    # own.
    cache_dir = tempfile.TemporaryDirectory(prefix="qkv-decode-compile-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir.name, "inductor")
    os.environ["QKV_COMPILE_CACHE"] = os.path.join(cache_dir.name, "qkv")
    log("measuring the memory bandwidth (1 GiB fp32 .sum() and copy_) ...")
    bandwidth = Bandwidth(args.device)
    bandwidth.measure(repeats=3 if args.quick else 10)
    log("building the models ...")
    ours, theirs = build_models(args.device)
    parameters = count_parameters(ours)
    if parameters != count_parameters(theirs):
        log(f"WARNING: parameter counts differ: {parameters} vs {count_parameters(theirs)}")
    rows = [bench_dtype(ours, theirs, dtype, bandwidth, args) for dtype in args.dtypes]
    for row in rows:
        add_limits(row, bandwidth.read_peak, bandwidth.x.nbytes)
    summary = bandwidth.summary()
    info = machine_info(args.device)
    print(
        f"# {info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}, "
        f"transformers {transformers.__version__}, load average {info['load_average']}"
    )
    print(
        f"# Llama {parameters / 1e6:.1f}M parameters, batch 1, {args.prompt}-token prompt, "
        f"{args.new_tokens} new tokens (greedy; prefill included in the time)"
    )
    print(
        f"# memory bandwidth: read (1 GiB fp32 sum) {summary['read_peak'] / 1e9:.1f} GB/s peak, "
        f"{summary['read_median'] / 1e9:.1f} median over {len(bandwidth.read_samples)} probes; "
        f"copy (read + write) {summary['copy_peak'] / 1e9:.1f} GB/s peak"
    )
    print(table(rows))
    print(peers_table(rows))
    print(
        f"# limit = read peak / (weights + mean K/V bytes per token); targets: qkv/hf >= "
        f"{TARGET_RATIO}, qkv >= {TARGET_FRACTION:.0%} of the limit ('!' = missed by qkv's "
        f"fastest path); %lim paired = median over rounds of tokens/s over the limit from that "
        f"round's probe (for machines whose read bandwidth swings within seconds); packed "
        f"matvec = the packed products of a packed step alone (the "
        f"fastest an eager packed step could be; compiled steps use other kernels); weights "
        f".sum() = one .sum() per weight tensor a step reads, nothing else"
    )
    for line in divergence_notes(rows):
        print(f"# tokens differ: {line}")
    write_json(
        args.out,
        {
            "machine": info,
            "transformers": transformers.__version__,
            "model": {"config": LLAMA, "parameters": parameters},
            "bandwidth": summary,
            "targets": {"ratio": TARGET_RATIO, "fraction_of_limit": TARGET_FRACTION},
            "rows": rows,
        },
    )
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
