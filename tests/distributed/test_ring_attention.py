"""Ring attention on 2 and 4 gloo processes against one process's plain attention in float64.

The outside reference is the formula, written here: softmax(Q K^T / sqrt(D) + mask) V over the
whole sequence, with the mask from index arithmetic and GQA by repeating K/V. Every process
builds the same full tensors from one seed, runs `ring_attention` on its shards, and compares
its output, log-sum-exp and gradients (dq, dk, dv of a random upstream gradient) with the
reference's: causal or not, contiguous or zigzag, windows, GQA, lengths the ranks do not divide.
It also counts the bytes the ring sends (wrapping `torch.distributed.batch_isend_irecv`) against
`ring_attention_traffic`, and those of DDP and FSDP training steps against `qkv cost`'s plan
(fsdp_step.py). All cases of one world size run in one start of the processes, forked from a
server that has imported torch, torch._dynamo (which AdamW imports) and these modules once:
importing them is most of the time.

PyTorch's own `torch.distributed.tensor.experimental.context_parallel` is no second reference
here: in torch 2.13 it serves only the CUDA attention kernels (flash, memory-efficient, cuDNN).
On the CPU, SDPA dispatches to `_scaled_dot_product_flash_attention_for_cpu`, which has no
DTensor sharding strategy (NotImplementedError), and the math fallback fails mixing plain
tensors with DTensors.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import socket
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qkv.distributed import (
    gather_sequence,
    padded_length,
    ring_attention,
    ring_attention_traffic,
    shard_sequence,
)
from qkv.distributed.blocks import Masking
from qkv.distributed.layout import segments
from qkv.training.distributed import setup_distributed
from tests.distributed.fsdp_step import check_fsdp_step_bytes


@dataclass(frozen=True)
class Case:
    name: str
    length: int
    causal: bool = False
    window: int | tuple[int, int] | None = None
    layout: str = "zigzag"
    heads: int = 4
    kv_heads: int = 4
    backend: str = "auto"


CASES = (
    Case("non-causal", 16),
    Case("causal contiguous", 16, causal=True, layout="contiguous"),
    Case("causal zigzag", 16, causal=True),
    Case("causal zigzag, tiled blocks", 16, causal=True, backend="tiled"),
    Case("window 5 (causal)", 16, window=5),
    Case("window (3, 2) contiguous", 16, window=(3, 2), layout="contiguous"),
    Case("GQA 4:2 causal zigzag", 16, causal=True, kv_heads=2),
    Case("MQA 4:1 non-causal contiguous", 16, kv_heads=1, layout="contiguous"),
    Case("length 13 causal zigzag (padded)", 13, causal=True),
    Case("length 13 non-causal contiguous (padded)", 13, layout="contiguous", kv_heads=2),
    Case("length 11 window 4 zigzag (padded), tiled", 11, window=4, backend="tiled"),
)
BATCH, HEAD_DIM = 2, 8
DEADLINE_S = 900  # a hung collective fails the test instead of waiting for gloo's 30 min
# imported once by the fork server (when this module starts it), not by every process
PRELOAD = ["torch._dynamo", __name__, "tests.distributed.fsdp_step"]


def reference(q, k, v, case: Case):
    """softmax(Q K^T / sqrt(D) + mask) V and the log-sum-exp, on the full sequence."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    i = torch.arange(case.length).unsqueeze(1)  # query positions
    j = torch.arange(case.length).unsqueeze(0)  # key positions
    visible = torch.ones(case.length, case.length, dtype=torch.bool)
    if case.causal:
        visible &= j <= i
    if isinstance(case.window, int):
        visible &= (j <= i) & (i - j < case.window)
    elif case.window is not None:
        visible &= (j >= i - case.window[0]) & (j <= i + case.window[1])
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _inputs(case: Case, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, case.heads, case.length, HEAD_DIM)
    kv_shape = (BATCH, case.kv_heads, case.length, HEAD_DIM)

    def randn(shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    return randn(shape), randn(kv_shape), randn(kv_shape), randn(shape)  # q, k, v, d_out


def _check_case(case: Case, rank: int, world_size: int) -> None:
    q, k, v, d_out = _inputs(case)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = reference(*full, case)
    expected_grads = torch.autograd.grad(expected, full, d_out)

    def shard(x):
        return shard_sequence(x, rank, world_size, dim=2, layout=case.layout)

    # every collective first, the comparisons after: a failed one must not leave a rank
    # out of a collective the others are in
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    output, lse = ring_attention(
        *local, causal=case.causal, window=case.window, layout=case.layout,
        length=case.length, backend=case.backend, return_lse=True,
    )  # fmt: skip
    output.backward(shard(d_out))
    gathered = gather_sequence(output.detach(), 2, layout=case.layout, length=case.length)
    gathered_lse = gather_sequence(lse, 2, layout=case.layout, length=case.length)

    def check(name, got, want):
        torch.testing.assert_close(
            got, want, rtol=1e-10, atol=1e-10, msg=lambda message: f"{name}: {message}"
        )

    # padding positions: output and gradients 0, as the zero-padded reference shards are
    check("output", output, shard(expected.detach()))
    for name, got, want in zip("qkv", local, expected_grads, strict=True):
        check(f"d{name}", got.grad, shard(want))
    check("gathered output", gathered, expected.detach())
    check("lse", gathered_lse, expected_lse.detach())


class SendCounter:
    """Wraps torch.distributed.batch_isend_irecv: the bytes of every isend posted through it."""

    def __init__(self):
        self.bytes = 0
        self.wrapped = dist.batch_isend_irecv

    def __call__(self, ops):
        self.bytes += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return self.wrapped(ops)


def _check_traffic(rank: int, world_size: int, dtype: torch.dtype, kv_heads: int) -> None:
    counter = SendCounter()
    dist.batch_isend_irecv = counter
    try:
        local_length = 6
        q = torch.randn(BATCH, 4, local_length, HEAD_DIM, dtype=dtype, requires_grad=True)
        k = torch.randn(BATCH, kv_heads, local_length, HEAD_DIM, dtype=dtype, requires_grad=True)
        v = torch.randn(BATCH, kv_heads, local_length, 5, dtype=dtype, requires_grad=True)
        output = ring_attention(q, k, v, causal=True)
        forward_bytes, counter.bytes = counter.bytes, 0
        output.sum().backward()
        backward_bytes = counter.bytes
    finally:
        dist.batch_isend_irecv = counter.wrapped
    predicted = ring_attention_traffic(
        batch_size=BATCH, num_kv_heads=kv_heads, local_length=local_length,
        head_dim=HEAD_DIM, value_dim=5, world_size=world_size, dtype=dtype,
    )  # fmt: skip
    block_bytes = BATCH * kv_heads * local_length * (HEAD_DIM + 5) * dtype.itemsize
    assert forward_bytes == predicted.forward_bytes == (world_size - 1) * block_bytes
    assert backward_bytes == predicted.backward_bytes, (backward_bytes, predicted)


def _check_training_step_bytes(rank: int, world_size: int) -> None:
    """One DDP training step of a sequence-parallel GPT sends what `qkv cost` plans: the ring's
    bytes (counted at batch_isend_irecv) and the gradient bytes handed to the all-reduce
    (counted by a DDP communication hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from qkv.analysis.cost.parallel import parallel_training_cost
    from qkv.distributed import RingAttention, shard_lm_batch, use_ring_attention
    from qkv.models import GPT, GPTConfig

    torch.manual_seed(0)
    sizes = {"vocab_size": 40, "embed_dim": 16, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "ffn_dim": 32, "max_positions": 32}  # fmt: skip
    config = GPTConfig.from_name("tiny-llama", **sizes)
    length, batch = 13, 2  # padded to a multiple of 2P
    group = dist.new_group(ranks=list(range(world_size)))
    model = use_ring_attention(GPT(config), RingAttention(group=group, length=length))
    payloads = []

    def counting_hook(sizes, bucket):
        sizes.append(bucket.buffer().nbytes)
        return default_hooks.allreduce_hook(None, bucket)

    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    wrapped.register_comm_hook(payloads, counting_hook)
    shard = shard_lm_batch(torch.randint(0, 40, (batch, length)), rank, world_size)
    counter = SendCounter()
    dist.batch_isend_irecv = counter
    try:
        logits = wrapped(shard["input_ids"], position_ids=shard["position_ids"]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard["targets"].flatten(),
                                          ignore_index=-100).backward()  # fmt: skip
    finally:
        dist.batch_isend_irecv = counter.wrapped
    plan = parallel_training_cost(config, context_parallel=world_size, context=length,
                                  batch=batch, dtype="fp32")  # fmt: skip
    assert counter.bytes == plan.ring_bytes_per_step, (counter.bytes, plan)
    assert sum(payloads) == plan.all_reduce_payload_bytes, (sum(payloads), plan)


def _worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    context = setup_distributed("cpu")  # gloo
    assert (context.rank, context.world_size) == (rank, world_size)
    failures = []  # every rank runs every collective, whatever fails: none is left waiting
    checks = [(case.name, _check_case, (case, rank, world_size)) for case in CASES]
    checks += [
        ("traffic float64 GQA", _check_traffic, (rank, world_size, torch.float64, 2)),
        ("traffic bfloat16", _check_traffic, (rank, world_size, torch.bfloat16, 4)),
        ("training step bytes", _check_training_step_bytes, (rank, world_size)),
        ("FSDP step bytes", check_fsdp_step_bytes, (rank, world_size)),
    ]
    for name, check, args in checks:
        try:
            check(*args)
        except AssertionError as error:
            failures.append(f"rank {rank}, {name}: {error}")
    dist.destroy_process_group()
    assert not failures, "\n".join(failures)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_matches_full_attention(world_size):
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    processes = mp.start_processes(
        _worker, args=(world_size, _free_port()), nprocs=world_size, join=False,
        start_method="forkserver",
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    while not processes.join(timeout=1):  # raises, with its traceback, if a process fails
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the {world_size} processes did not finish in {DEADLINE_S} s")


# One process, no process group: the layout and the argument checks.


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("length", [8, 13])
def test_shards_cover_every_position_once(layout, length):
    world_size = 2
    padded = padded_length(length, world_size, layout)
    assert padded % (world_size if layout == "contiguous" else 2 * world_size) == 0
    assert 0 <= padded - length < 2 * world_size
    held = [
        p for r in range(world_size) for s in segments(r, world_size, padded, layout) for p in s
    ]
    assert sorted(held) == list(range(padded))
    x = torch.arange(length).view(1, length, 1).float()
    shard = shard_sequence(x, 1, world_size, dim=1, layout=layout)
    expected = [p if p < length else 0 for s in segments(1, world_size, padded, layout) for p in s]
    assert shard.flatten().tolist() == expected


def test_zigzag_balances_causal_work():
    """Visible (query, key) pairs per rank under causal attention: zigzag evens them out."""
    world_size, length = 4, 64

    def work(layout):
        counts = []
        for rank in range(world_size):
            positions = [p for s in segments(rank, world_size, length, layout) for p in s]
            counts.append(sum(p + 1 for p in positions))
        return counts

    assert len(set(work("zigzag"))) == 1
    contiguous = work("contiguous")
    assert contiguous[-1] > 6 * contiguous[0]


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_gradcheck_in_one_process(backend):
    """gradcheck needs one process: with several, every rank's backward adds the others'
    shares to its dk, dv, so a rank's Jacobian is not its own function's (the 2- and 4-process
    gradients are compared with the reference's autograd instead)."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(1, 2, 6, 3), (1, 1, 6, 3), (1, 1, 6, 3)]  # GQA; zigzag: two chunks of 3
    inputs = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]

    def function(q, k, v):  # causal, a window, and the last position padding
        return ring_attention(q, k, v, causal=True, window=4, length=5, backend=backend)

    assert torch.autograd.gradcheck(function, [t.requires_grad_() for t in inputs])


def test_hidden_block_pairs_are_skipped_and_visible_ones_unmasked():
    """Causal, 4 ranks: the pairs each rank computes with the block of each source rank."""
    world_size, padded = 4, 32
    masking = Masking(length=padded, causal=True, window=None)

    def pairs(layout, rank, source):
        mine = segments(rank, world_size, padded, layout)
        theirs = segments(source, world_size, padded, layout)
        found = masking.pairs(mine, theirs, torch.device("cpu"))
        return ["partial" if p.visible is not None else "visible" for p in found]

    for rank in range(world_size):
        for source in range(world_size):
            # zigzag: own block, two diagonal chunks and one unmasked pair; any other block,
            # half of the chunk pairs, unmasked: the same work on every rank at every step
            expected = ["partial", "visible", "partial"] if source == rank else ["visible"] * 2
            assert pairs("zigzag", rank, source) == expected, (rank, source)
            # contiguous: later ranks' blocks are skipped altogether
            expected = {True: ["partial"], False: ["visible"] if source < rank else []}
            assert pairs("contiguous", rank, source) == expected[source == rank]


def test_one_process_without_a_group_is_plain_attention():
    case = Case("one process", 10, causal=True, kv_heads=2)
    q, k, v, _ = _inputs(case)
    output, lse = ring_attention(q, k, v, causal=True, return_lse=True)
    expected, expected_lse = reference(q, k, v, case)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"layout": "striped"}, ValueError, "layout: expected one of"),
        ({"length": 5}, ValueError, "length: 5 positions pad to 6"),
        ({"length": 0}, ValueError, "length: expected an int >= 1"),
        ({"backend": "sdpa"}, ValueError, "backend: expected one of"),
        ({"window": 0}, ValueError, "window"),
        ({"group": "world"}, TypeError, "group: expected a ProcessGroup"),
    ],
)
def test_bad_arguments_name_themselves(arguments, error, words):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(error, match=words):
        ring_attention(q, q, q, **arguments)


def test_queries_and_keys_of_different_lengths_are_refused():
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="q, k: a rank holds the queries and keys"):
        ring_attention(q, k, k)


def test_odd_zigzag_shards_are_refused():
    q = torch.randn(1, 2, 7, 4)  # a zigzag shard holds two chunks of equal length
    with pytest.raises(ValueError, match="q: 7 positions pad to 8 under layout 'zigzag'"):
        ring_attention(q, q, q)
    ring_attention(q, q, q, layout="contiguous")


def test_traffic_counts_every_hop():
    traffic = ring_attention_traffic(
        batch_size=2, num_kv_heads=2, local_length=1024, head_dim=64, world_size=4,
        dtype=torch.bfloat16,
    )  # fmt: skip
    block = 2 * 2 * 1024 * 128 * 2  # K and V, bf16
    assert traffic.forward_bytes == 3 * block
    assert traffic.backward_bytes == 3 * block + 3 * 2 * block  # fp32 gradient accumulators
    with pytest.raises(ValueError, match="world_size: expected a positive int"):
        ring_attention_traffic(
            batch_size=1, num_kv_heads=1, local_length=1, head_dim=1, world_size=0
        )
