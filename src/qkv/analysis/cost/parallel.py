"""Training past one process, on paper: memory per process and bytes sent per step.

`parallel_training_cost(model, context_parallel=C, fsdp=F)` plans a run of C x F processes:
each sequence of `context` tokens is split over C processes (ring attention, Liu et al. 2023),
and the global batch over F groups of them whose parameters, gradients and optimizer state are
sharded F ways (FSDP, Zhao et al. 2023; ZeRO-3, Rajbhandari et al. 2020). F = 1 replicates
them (DDP). Per process, for one optimizer step without gradient accumulation:

- weights, gradients: parameters x bytes / F; AdamW's two moments: parameters x 8 / F (fp32).
  FSDP also holds one block's full weights while it computes (`gathered_block_bytes`).
- activations: Korthikanti et al. 2022 (s4, eq. 1 with a fused attention kernel, which keeps
  no L x L scores): 34 s b h bytes per layer at 2-byte activations, so 17 elements per token
  and width unit, for the s = context / C tokens and b = batch / F sequences a process holds.
- ring K/V blocks in flight (C > 1): the block a rank attends to and the one arriving, K and V,
  and in the backward the travelling dK, dV accumulators in fp32.
- bytes sent: ring attention per layer (`qkv.distributed.ring_attention_traffic`, forward and
  backward); the gradient exchange: with F = 1 an all-reduce of every gradient over the C
  processes (the payload, and a ring all-reduce sends 2 (n - 1) / n of it); with F > 1 FSDP's
  all-gather of the weights in forward and again in backward plus the reduce-scatter of the
  gradients, each (n - 1) / n of the full size, n = F (Zhao et al. 2023, s3), and with C > 1
  an all-reduce of each gradient shard over the C processes that share it.

qkv's own runs check these counts: tests/distributed count the ring's sends and the gradient
bytes handed to the all-reduce in 2- and 4-process training steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.analysis.cost.format import format_bytes, text_table
from qkv.analysis.cost.layout import layout_of
from qkv.analysis.cost.sources import resolve_model
from qkv.distributed.traffic import ring_attention_traffic
from qkv.validation import check_positive_int

__all__ = ["ParallelTrainingCost", "format_parallel", "parallel_training_cost"]

ADAM_BYTES = 8  # two fp32 moments per parameter
ACTIVATION_ELEMENTS = 17  # Korthikanti et al. 2022: 34 s b h bytes per layer at 2 bytes each
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    gathered_block_bytes: int
    activations_bytes: int
    kv_blocks_bytes: int
    ring_bytes_per_step: int
    gradient_payload_bytes: int  # what the gradient exchange is handed (F = 1: the all-reduce)
    gradient_sent_bytes: int  # what it sends, by the ring all-reduce / FSDP formulas

    @property
    def memory_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.gathered_block_bytes + self.activations_bytes
                + self.kv_blocks_bytes)  # fmt: skip

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
    parameters = layout.parameters()
    ring = _ring_bytes(attention, stack.num_layers, local_batch, local_tokens, C, torch_dtype)
    payload, sent = _gradient_exchange(parameters * width, C, F)
    block_kv = local_batch * attention.num_kv_heads * local_tokens * 2 * attention.head_dim
    return ParallelTrainingCost(
        name=name, context_parallel=C, fsdp=F, processes=C * F, context=context, batch=batch,
        dtype=dtype, parameters=parameters, weights_bytes=-(-parameters * width // F),
        gradients_bytes=-(-parameters * width // F),
        optimizer_bytes=-(-parameters * ADAM_BYTES // F),
        gathered_block_bytes=stack.block_parameters() * width if F > 1 else 0,
        activations_bytes=(ACTIVATION_ELEMENTS * local_tokens * local_batch * layout.embed_dim
                           * width * stack.num_layers),
        kv_blocks_bytes=2 * block_kv * (width + 4) if C > 1 else 0,
        ring_bytes_per_step=ring, gradient_payload_bytes=payload, gradient_sent_bytes=sent,
    )  # fmt: skip


def _ring_bytes(attention, num_layers: int, batch: int, local: int, C: int, dtype) -> int:
    """Bytes one rank's rings send in a step: every layer, forward and backward."""
    if C == 1:
        return 0
    traffic = ring_attention_traffic(
        batch_size=batch, num_kv_heads=attention.num_kv_heads, local_length=local,
        head_dim=attention.head_dim, world_size=C, dtype=dtype,
    )  # fmt: skip
    return num_layers * traffic.total_bytes


def _gradient_exchange(model_bytes: int, C: int, F: int) -> tuple[int, int]:
    """(payload, sent) per process: DDP's all-reduce over the C ranks that hold the same
    weights (F = 1); or FSDP's two all-gathers and one reduce-scatter over F ranks, then, with
    C > 1, an all-reduce of each gradient shard over the C ranks that share it."""
    if F == 1:
        return (model_bytes, 2 * (C - 1) * model_bytes // C) if C > 1 else (0, 0)
    shard = -(-model_bytes // F)
    payload, sent = 3 * model_bytes, 3 * (F - 1) * model_bytes // F
    if C > 1:
        payload, sent = payload + shard, sent + 2 * (C - 1) * shard // C
    return payload, sent


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
        ("gathered block (FSDP)", lambda p: format_bytes(p.gathered_block_bytes)),
        ("activations / process", lambda p: format_bytes(p.activations_bytes)),
        ("ring K/V blocks", lambda p: format_bytes(p.kv_blocks_bytes)),
        ("memory / process", lambda p: format_bytes(p.memory_bytes)),
        ("ring sends / step", lambda p: format_bytes(p.ring_bytes_per_step)),
        ("gradient exchange sends / step", lambda p: format_bytes(p.gradient_sent_bytes)),
        ("sent / process / step", lambda p: format_bytes(p.sent_bytes_per_step)),
    ]
    header = ["", *(plan.name for plan in plans)]
    body = [[label, *(cell(plan) for plan in plans)] for label, cell in rows]
    notes = (
        f"Training in {plans[0].dtype} with AdamW, one step, per process. Activations: 34 s b h "
        "bytes per layer at 2-byte activations (Korthikanti et al. 2022), fused attention."
    )
    return text_table([header, *body]) + "\n" + notes
