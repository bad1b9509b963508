"""The small constants inductor adds while lowering a step compiled ahead of time (not the
model's tensors: e.g. `_weight_int4pack_mm_for_cpu`'s group size), kept in the library's
metadata. qkv.acceleration.exported leaves every constant out of its libraries, to be pointed
at the model's own tensors when loaded; these few are then the caller's to supply too, so they
are recorded while the library is built (`recorded`) and read back when it is loaded (`read`).
"""

from __future__ import annotations

import contextlib
import json

import torch

__all__ = ["INDUCTOR_CONSTANTS_METADATA", "read", "recorded"]

# The library's metadata entry that holds them
INDUCTOR_CONSTANTS_METADATA = "qkv_inductor_constants"
SMALL_CONSTANT = 64  # values at most: a scalar or a short table, kept as JSON


@contextlib.contextmanager
def recorded(skip: frozenset[str]):
    """While inside, each constant inductor's lowering adds (`GraphLowering.add_tensor_constant`,
    torch 2.13: e.g. `_weight_int4pack_mm_for_cpu`'s group size) of at most SMALL_CONSTANT
    values and not in `skip` is written by name into the metadata of the library being built
    (inductor's live `aot_inductor.metadata`, read once lowering is done)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.add_tensor_constant
    found: dict[str, list] = {}

    def recording(graph, data, name=None):
        before = set(graph.constants)
        box = original(graph, data, name)
        for added in set(graph.constants) - before - skip:
            if data.numel() <= SMALL_CONSTANT:
                found[added] = [str(data.dtype).removeprefix("torch."), list(data.shape),
                                   data.flatten().tolist()]  # fmt: skip
        metadata = inductor_config.aot_inductor.metadata
        metadata[INDUCTOR_CONSTANTS_METADATA] = json.dumps(found, sort_keys=True)
        return box

    GraphLowering.add_tensor_constant = recording
    try:
        yield
    finally:
        GraphLowering.add_tensor_constant = original


def read(metadata: dict) -> dict[str, torch.Tensor]:
    """The constants `recorded` wrote into a library's metadata, as tensors."""
    found = json.loads(metadata.get(INDUCTOR_CONSTANTS_METADATA, "{}"))
    return {
        name: torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
        for name, (dtype, shape, values) in found.items()
    }
