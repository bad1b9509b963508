"""Training past one process, on paper: memory per process and bytes sent per step.

`parallel_training_cost(model, context_parallel=C, fsdp=F)` plans a run of C x F processes:
each sequence of `context` tokens is split over C processes (ring attention, Liu et al. 2023),
and the global batch over F groups of them whose parameters, gradients and optimizer state are
sharded F ways (FSDP, Zhao et al. 2023; ZeRO-3, Rajbhandari et al. 2020). F = 1 replicates
them (DDP). Per process, for one optimizer step without gradient accumulation:

- FSDP's units are those `qkv.training.sharded` makes: each block, and the root (token and
  position embeddings, final norm, an untied head). Every parameter is cut along its first
  dimension, padded to a multiple of F rows, so a process holds ceil(rows / F) rows of each
  (the first process the most; the figures are its).
- weights, gradients: that shard x bytes; AdamW's two moments: the shard x 8 (fp32). With F > 1,
  the gathered weights: the root's, which stay gathered from its forward to the end of the
  backward, and one block's while it computes (in the backward the block's full gradients
  before their reduce-scatter, and the next block's weights fetched ahead, come on top).
- activations: Korthikanti et al. 2022 (s4, eq. 1 with a fused attention kernel, which keeps
  no L x L scores): 34 s b h bytes per layer at 2-byte activations, so 17 elements per token
  and width unit, for the s = context / C tokens and b = batch / F sequences a process holds.
- ring K/V blocks in flight (C > 1): the block a rank attends to and the one arriving, K and V,
  and in the backward the travelling dK, dV accumulators in fp32.
- bytes sent: ring attention per layer (`qkv.distributed.ring_attention_traffic`, forward and
  backward). With F = 1, an all-reduce of every gradient over the C processes (the payload; a
  ring all-reduce sends 2 (n - 1) / n of it). With F > 1 (Zhao et al. 2023, s3), all-gathers
  of the weights over the F processes: the root's once, each block's before its forward and
  again before its backward; and one reduce-scatter of each unit's gradients. Each sends
  F - 1 shards of its unit from every process. With C > 1 as well, each reduced gradient shard
  is all-reduced over the C processes that hold it.

qkv's own runs check these counts: tests/distributed count the ring's sends, the gradient
bytes handed to DDP's all-reduce, and every all-gather and reduce-scatter FSDP issues in 2- and
4-process training steps, and the shards it keeps. A plan with C and F both above 1 is checked
through its parts only: `qkv train` runs no such layout (given both flags, its FSDP shards over
the same processes that share each sequence). The gradient norm's one-number all-reduce is
left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.analysis.cost.format import format_bytes, text_table
from qkv.analysis.cost.layout import ModelLayout, layout_of
from qkv.analysis.cost.sources import resolve_model
from qkv.distributed.traffic import ring_attention_traffic
from qkv.models.gpt_config import GPTConfig
from qkv.validation import check_positive_int

__all__ = ["ParallelTrainingCost", "format_parallel", "parallel_training_cost"]

ADAM_BYTES = 8  # two fp32 moments per parameter
ACTIVATION_ELEMENTS = 17  # Korthikanti et al. 2022: 34 s b h bytes per layer at 2 bytes each
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Shape = tuple[int, int]  # (rows, elements per row): FSDP cuts a parameter along its rows


@dataclass(frozen=True)
class ParallelTrainingCost:
    """One process's share of a training step (bytes), see the module docstring."""

    name: str
    context_parallel: int
    fsdp: int
    processes: int
    context: int
    batch: int
    dtype: str
    parameters: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    gathered_bytes: int  # FSDP: the root's full weights and one block's
    activations_bytes: int
    kv_blocks_bytes: int
    ring_bytes_per_step: int
    all_gather_bytes: int  # FSDP: sent by the all-gathers of the weights
    reduce_scatter_bytes: int  # FSDP: sent by the reduce-scatters of the gradients
    all_reduce_payload_bytes: int  # handed to the all-reduce (F = 1: every gradient)
    all_reduce_bytes: int  # sent by it, by the ring all-reduce formula

    @property
    def memory_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.gathered_bytes + self.activations_bytes + self.kv_blocks_bytes)  # fmt: skip

    @property
    def gradient_sent_bytes(self) -> int:
        """What keeping the weights in step sends: all-gathers, reduce-scatters, all-reduce."""
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes

    @property
    def sent_bytes_per_step(self) -> int:
        return self.ring_bytes_per_step + self.gradient_sent_bytes


def parallel_training_cost(
    model: object,
    *,
    context_parallel: int = 1,
    fsdp: int = 1,
    context: int | None = None,
    batch: int = 1,
    dtype: str = "fp32",
) -> ParallelTrainingCost:
    """The plan of a decoder-only model (a preset, config or checkpoint, as `qkv cost` takes)
    trained on context_parallel x fsdp processes; batch: sequences per step over all of them."""
    name, config = resolve_model(model)
    layout = layout_of(config)
    if layout.encoder is not None or layout.decoder is None:
        raise ValueError(f"model: {name} is not decoder-only; ring attention shards one sequence")
    C = check_positive_int("context_parallel", context_parallel)
    F = check_positive_int("fsdp", fsdp)
    batch = check_positive_int("batch", batch)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    torch_dtype, width = _DTYPES[dtype], _DTYPES[dtype].itemsize
    context = layout.max_positions if context is None else check_positive_int("context", context)
    if batch % F:
        raise ValueError(f"batch: expected a multiple of fsdp = {F} (whole sequences per group)")
    local_batch, local_tokens = batch // F, -(-context // (2 * C)) * 2  # zigzag: padded to 2C
    attention, stack = layout.attention, layout.decoder
    root, block = _fsdp_units(config, layout)
    root_shard, block_shard = _shard(root, F), _shard(block, F)
    shard = root_shard + stack.num_blocks * block_shard  # F = 1: every parameter
    ring = _ring_bytes(attention, stack.num_layers, local_batch, local_tokens, C, torch_dtype)
    exchange = _exchange(root_shard, block_shard, stack.num_blocks, C, F, width)
    block_kv = local_batch * attention.num_kv_heads * local_tokens * 2 * attention.head_dim
    return ParallelTrainingCost(
        name=name, context_parallel=C, fsdp=F, processes=C * F, context=context, batch=batch,
        dtype=dtype, parameters=layout.parameters(), weights_bytes=shard * width,
        gradients_bytes=shard * width, optimizer_bytes=shard * ADAM_BYTES,
        gathered_bytes=F * (root_shard + block_shard) * width if F > 1 else 0,
        activations_bytes=(ACTIVATION_ELEMENTS * local_tokens * local_batch * layout.embed_dim
                           * width * stack.num_layers),
        kv_blocks_bytes=2 * block_kv * (width + 4) if C > 1 else 0,
        ring_bytes_per_step=ring, **exchange,
    )  # fmt: skip


def _fsdp_units(config: GPTConfig, layout: ModelLayout) -> tuple[list[Shape], list[Shape]]:
    """The parameters of FSDP's units as `qkv.training.sharded` makes them, as (rows, elements
    per row): the root's (token and position tables, final norm, an untied head), one block's."""
    E, stack = layout.embed_dim, layout.decoder
    attention, ffn = stack.self_attention, stack.ffn
    positions = {"learned": [(config.max_positions, E)],
                 "t5": [(config.relative_buckets, config.num_heads)]}  # fmt: skip
    root = [(layout.vocab_size, E), *positions.get(config.position, [])]
    root += [(E, 1)] * (stack.final_norm_parameters // E)  # gain, and a shift with a bias
    root += [(layout.head_vocab_size, E)] if layout.head_parameters else []
    D = attention.head_dim
    queries, keys = attention.num_heads * D, attention.num_kv_heads * D  # q_proj, k_proj rows
    up = [(ffn.hidden_dim, E)] * (ffn.num_matrices - 1)  # up (and SwiGLU's gate)
    block = [(queries, E), (keys, E), (keys, E), (E, queries), *up, (E, ffn.hidden_dim)]
    block += [(E, 1)] * (stack.norm_parameters // E)
    if attention.bias:
        block += [(queries, 1), (keys, 1), (keys, 1), (E, 1)]
    if ffn.bias:
        block += [(ffn.hidden_dim, 1)] * (ffn.num_matrices - 1) + [(E, 1)]
    counted = _shard(root, 1) + stack.num_blocks * _shard(block, 1)
    assert counted == layout.parameters(), (counted, layout.parameters())
    return root, block


def _shard(shapes: list[Shape], F: int) -> int:
    """Elements one process holds of these parameters: ceil(rows / F) rows of each (FSDP pads
    the rows to a multiple of F and gives each process 1/F of them)."""
    return sum(-(-rows // F) * row for rows, row in shapes)


def _exchange(root: int, block: int, num_blocks: int, C: int, F: int, width: int) -> dict:
    """Bytes a process sends per step (and hands to the all-reduce) to keep the weights in
    step, from the shards (elements) of the root and of one block; see the module docstring."""
    shard = (root + num_blocks * block) * width  # F = 1: every parameter
    gathered = (F - 1) * (root + 2 * num_blocks * block) * width  # F - 1 shards of each unit
    payload = shard if C > 1 else 0
    return {
        "all_gather_bytes": gathered,
        "reduce_scatter_bytes": (F - 1) * shard,
        "all_reduce_payload_bytes": payload,
        "all_reduce_bytes": 2 * (C - 1) * payload // C,
    }


def _ring_bytes(attention, num_layers: int, batch: int, local: int, C: int, dtype) -> int:
    """Bytes one rank's rings send in a step: every layer, forward and backward."""
    if C == 1:
        return 0
    traffic = ring_attention_traffic(
        batch_size=batch, num_kv_heads=attention.num_kv_heads, local_length=local,
        head_dim=attention.head_dim, world_size=C, dtype=dtype,
    )  # fmt: skip
    return num_layers * traffic.total_bytes


def format_parallel(plans: list[ParallelTrainingCost]) -> str:
    """One column per model: memory per process and bytes sent per step."""
    rows = [
        (
            "processes (context x fsdp)",
            lambda p: f"{p.processes} ({p.context_parallel} x {p.fsdp})",
        ),
        ("context x batch", lambda p: f"{p.context} x {p.batch}"),
        ("weights / process", lambda p: format_bytes(p.weights_bytes)),
        ("gradients / process", lambda p: format_bytes(p.gradients_bytes)),
        ("AdamW state / process", lambda p: format_bytes(p.optimizer_bytes)),
        ("gathered root + block (FSDP)", lambda p: format_bytes(p.gathered_bytes)),
        ("activations / process", lambda p: format_bytes(p.activations_bytes)),
        ("ring K/V blocks", lambda p: format_bytes(p.kv_blocks_bytes)),
        ("memory / process", lambda p: format_bytes(p.memory_bytes)),
        ("ring sends / step", lambda p: format_bytes(p.ring_bytes_per_step)),
        ("all-gather sends / step (FSDP)", lambda p: format_bytes(p.all_gather_bytes)),
        ("reduce-scatter sends / step (FSDP)", lambda p: format_bytes(p.reduce_scatter_bytes)),
        ("all-reduce sends / step", lambda p: format_bytes(p.all_reduce_bytes)),
        ("sent / process / step", lambda p: format_bytes(p.sent_bytes_per_step)),
    ]
    header = ["", *(plan.name for plan in plans)]
    body = [[label, *(cell(plan) for plan in plans)] for label, cell in rows]
    notes = (
        f"Training in {plans[0].dtype} with AdamW, one step, per process (the first, which "
        "holds the largest shards). Activations: 34 s b h bytes per layer at 2-byte "
        "activations (Korthikanti et al. 2022), fused attention."
    )
    return text_table([header, *body]) + "\n" + notes
