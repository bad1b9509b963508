"""The section of benchmarks/context_parallel.py: sequence-parallel training per process."""

from __future__ import annotations

from .format import get, md_table, num, prose
from .machine import machine_table

TEXT = """\
One training step (forward and backward, fp32) of a Llama-style GPT ({layers} layers, width
{width}, {heads}/{kv_heads} heads, vocabulary {vocab}) on one sequence of {length} tokens: on
1 process with plain attention, and on P processes (gloo) that share the sequence in zigzag
shards, every attention layer a ring (`qkv.distributed.use_ring_attention`), gradients
all-reduced by DDP. Per process (the largest over the ranks): the bytes autograd saves for the
backward (weights left out), against `qkv cost --context-parallel P`'s activation estimate
(Korthikanti et al. 2022's 34 s b h per layer; it leaves out the logits); the ring's K/V bytes
counted at `batch_isend_irecv` and the gradient bytes handed to the all-reduce, against the
plan (`qkv.analysis.cost.parallel`); the step's seconds and peak resident memory. The P
processes share this machine's cores, one thread each: the times show the cost of the ring on
shared cores, not the speed-up of P machines."""


def context_parallel_section(data: dict) -> list[str]:
    model = data.get("model", {})
    text = TEXT.format(
        layers=model.get("num_layers", "?"), width=model.get("embed_dim", "?"),
        heads=model.get("num_heads", "?"), kv_heads=model.get("num_kv_heads", "?"),
        vocab=model.get("vocab_size", "?"), length=data.get("length", "?"),
    )  # fmt: skip
    rows = data.get("rows", [])
    first = rows[0] if rows else {}
    header = ["P", "saved MiB", "x of P=1", "planned MiB", "ring MiB (counted / planned)",
              "all-reduce MiB (counted / planned)", "s / step", "peak RSS MiB"]  # fmt: skip
    body = []
    for row in rows:
        ratio = get(row, "saved_bytes", default=0) / max(get(first, "saved_bytes", default=1), 1)
        body.append([
            row.get("processes"), _mib(row.get("saved_bytes")), num(ratio, ".3f"),
            _mib(row.get("planned_activation_bytes")),
            f"{_mib(row.get('ring_bytes'))} / {_mib(row.get('planned_ring_bytes'))}",
            f"{_mib(row.get('payload_bytes'))} / {_mib(row.get('planned_payload_bytes'))}",
            num(row.get("seconds"), ".2f"), _mib(row.get("max_rss_bytes")),
        ])  # fmt: skip
    lines = ["## Sequence-parallel training (`context_parallel.py`)", "", *prose(text), ""]
    return [*lines, *md_table(header, body), "", *machine_table([("context_parallel", data)])]


def _mib(value: object) -> str:
    return num(value / 2**20, ".2f") if isinstance(value, (int, float)) else "-"
