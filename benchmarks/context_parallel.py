"""Sequence-parallel training: memory, time and bytes per process against 1, 2 and 4 processes.

    python benchmarks/context_parallel.py [--length 4096] [--processes 1 2 4] [--out FILE]

A GPT (Llama-style, GQA) takes one training step (forward, backward) on one sequence of
`--length` tokens, on 1 process (plain attention) and on P processes sharing the sequence
(gloo, zigzag shards, every attention layer a ring: `qkv.distributed.use_ring_attention`;
gradients all-reduced by DDP). For each P it reports, per process:

- activations: the bytes autograd saves for the backward (counted by a saved-tensors hook,
  each storage once, the weights left out), against `qkv cost`'s estimate; target ~1/P;
- ring K/V bytes sent (counted at batch_isend_irecv) and the gradient all-reduce payload
  (counted by a DDP communication hook), against `qkv.analysis.cost.parallel`'s plan;
- seconds per step (median of --steps after one warm-up) and peak resident memory (VmHWM).

The P processes share this machine's cores (each runs 1 thread): the times show the overhead
of the ring on shared cores, not the speed-up of P machines.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import log, machine_info, write_json

from qkv.analysis.cost.parallel import parallel_training_cost
from qkv.distributed import RingAttention, shard_lm_batch, use_ring_attention
from qkv.models import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {"vocab_size": 4000, "embed_dim": 256, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 2, "ffn_dim": 688}  # fmt: skip


def _config(length: int) -> GPTConfig:
    return GPTConfig.from_name("tiny-llama", max_positions=length, **SIZES)


class _SendCounter:
    def __init__(self) -> None:
        self.bytes, self.wrapped = 0, dist.batch_isend_irecv

    def __call__(self, ops):
        self.bytes += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return self.wrapped(ops)


def _saved_bytes(step, weights: set[int]) -> tuple[int, object]:
    """Bytes of the distinct storages autograd saves while `step()` runs its forward, but the
    weights (`weights`: their storages' addresses), which every process holds whole."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = step()
    return sum(storages.values()), result


def _measure(rank: int, processes: int, length: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = GPT(_config(length))
    ids = torch.randint(0, SIZES["vocab_size"], (1, length))
    payloads: list[int] = []
    if processes > 1:
        group = dist.new_group(ranks=list(range(processes)))
        use_ring_attention(model, RingAttention(group=group, length=length))
        model = torch.nn.parallel.DistributedDataParallel(model)
        model.register_comm_hook(payloads, _counting_hook)
    batch = shard_lm_batch(ids, rank, processes)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def forward():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                               ignore_index=-100, reduction="sum")  # fmt: skip

    counter = _SendCounter()
    dist.batch_isend_irecv = counter
    seconds, saved = [], 0
    for step in range(steps + 1):
        counter.bytes, payloads[:] = 0, []
        started = time.perf_counter()
        saved, loss = _saved_bytes(forward, weights)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step:  # the first is a warm-up
            seconds.append(time.perf_counter() - started)
    dist.batch_isend_irecv = counter.wrapped
    return {"saved_bytes": saved, "ring_bytes": counter.bytes, "payload_bytes": sum(payloads),
            "seconds": statistics.median(seconds),
            "max_rss_bytes": _high_water_bytes()}  # fmt: skip


def _high_water_bytes() -> int:
    """This process's own peak resident set (VmHWM). ru_maxrss starts at the launcher's RSS
    when torchrun forked this worker (Linux keeps the pre-exec copy's mark), a floor of its
    own that is no cost of the step."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _counting_hook(sizes, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    sizes.append(bucket.buffer().nbytes)
    return default_hooks.allreduce_hook(None, bucket)


def _worker(rank: int, processes: int, port: int, length: int, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(processes))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = _measure(rank, processes, length, steps)
    gathered = [None] * processes
    dist.all_gather_object(gathered, result)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def _run(processes: int, length: int, steps: int) -> list[dict]:
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_worker, args=(processes, port, length, steps, queue), nprocs=processes,
                       start_method="spawn")  # fmt: skip
    return queue.get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="tokens of the sequence")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--out", type=Path, default=RESULTS / "context_parallel.json")
    args = parser.parse_args(argv)
    rows = []
    for processes in args.processes:
        log(f"{processes} process(es), {args.length} tokens")
        ranks = _run(processes, args.length, args.steps)
        plan = parallel_training_cost(_config(args.length), context_parallel=processes,
                                      context=args.length, batch=1, dtype="fp32")  # fmt: skip
        rows.append({
            "processes": processes,
            "saved_bytes": max(r["saved_bytes"] for r in ranks),
            "planned_activation_bytes": plan.activations_bytes,
            "ring_bytes": max(r["ring_bytes"] for r in ranks),
            "planned_ring_bytes": plan.ring_bytes_per_step,
            "payload_bytes": max(r["payload_bytes"] for r in ranks),
            "planned_payload_bytes": plan.all_reduce_payload_bytes,
            "seconds": max(r["seconds"] for r in ranks),
            "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
        })  # fmt: skip
    payload = {"length": args.length, "model": SIZES, "rows": rows, "machine": machine_info("cpu")}
    write_json(args.out, payload)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
