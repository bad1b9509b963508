"""`from_pretrained` and `save_pretrained` as methods of the model classes.

Reading and writing Hugging Face folders is the business of `qkv.models.checkpoints`, which
sits above the model classes (its key maps name them). The methods here only forward to the
reader and writer it connects when it is imported, which `import qkv.models` does; so the
model modules never import the checkpoint code, and the import graph has no cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

__all__ = ["PretrainedIO", "connect"]

_READ: Callable[..., nn.Module] | None = None
_WRITE: Callable[[nn.Module, str | Path], Path] | None = None


def connect(read: Callable[..., nn.Module], write: Callable[[nn.Module, str | Path], Path]):
    """Called once by `qkv.models.checkpoints`: read(path, expected=cls), write(model, path)."""
    global _READ, _WRITE
    _READ, _WRITE = read, write


class PretrainedIO:
    """Mixin: `from_pretrained(path)` and `save_pretrained(path)` for a qkv model class."""

    @classmethod
    def from_pretrained(cls, path: str | Path) -> nn.Module:
        """Load a local Hugging Face checkpoint directory (config.json + weights) into `cls`
        (`qkv.models.checkpoints.from_pretrained` with expected=cls)."""
        return _connected(_READ)(path, expected=cls)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write config.json + model.safetensors that transformers' from_pretrained loads."""
        return _connected(_WRITE)(self, path)


def _connected(function):
    if function is None:  # only if qkv.models.checkpoints failed to import
        raise RuntimeError("qkv.models.checkpoints is not imported: import qkv.models first")
    return function
