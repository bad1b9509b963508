"""Building a model whose every weight is loaded next: on the "meta" device, without its random
initialization.

A model read from a file (`qkv.models.from_gguf`) is first built with no memory behind its
parameters, then given the file's tensors. Its constructor still fills every parameter through
`torch.nn.init`, and on the meta device one of those fills is costly: PyTorch runs `normal_`'s
meta kernel through a function wrapped to keep torch.compile out, whose first call imports
`torch._dynamo`, several seconds of a cold start (torch 2.13: 5 s on a quiet 2-core machine),
for values that do not exist. `built_on_meta` makes the fills of `torch.nn.init` do nothing
while the model is built, as transformers' `no_init_weights` does.

A loader that lays hundreds of tensors out, each through temporaries of a few MB, also leaves
glibc's heap full of freed pages it keeps for later: `return_freed_heap` gives them back, so
that what the process holds after a load is the model, not the temporaries it was made with.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

__all__ = ["built_on_meta", "return_freed_heap"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# the fills a constructor reaches through torch.nn.init (nn.Linear, nn.Embedding, qkv's models)
_FILLS = (
    "normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_",
    "xavier_normal_", "xavier_uniform_", "zeros_", "ones_", "constant_", "orthogonal_",
)  # fmt: skip


def _unfilled(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def built_on_meta(build: Callable[[], ModuleT]) -> ModuleT:
    """`build()` on the meta device, with `torch.nn.init`'s fills made no-ops meanwhile (not
    thread-safe: another thread's initialization in the same moments would be skipped too)."""
    saved = {name: getattr(nn.init, name) for name in _FILLS}
    try:
        for name in _FILLS:
            setattr(nn.init, name, _unfilled)
        with torch.device("meta"):
            return build()
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)


def return_freed_heap() -> None:
    """Return the freed pages of the C heap to the system (glibc's `malloc_trim(0)`; nothing
    where the C library has none). glibc serves an allocation below its adaptive threshold
    (up to 32 MB, raised by each large block freed) from its heap, and keeps the heap's freed
    pages: a loader's temporaries would stay resident, interleaved with the tensors it keeps."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    return getattr(library, "malloc_trim", None)
