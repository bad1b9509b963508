"""Hugging Face checkpoint directories <-> qkv models (safetensors + JSON, never pickle).

Each supported architecture (the `architectures[0]` of a config.json, e.g. "BertModel",
"GPT2LMHeadModel", "LlamaForCausalLM") registers an `Architecture`: how to build the qkv model
from config.json, how its keys map, and how to write config.json back. Checkpoint key names live
only in the family modules of this package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from qkv.models.checkpoints.core import (
    CheckpointError,
    KeyMap,
    NotAFolderError,
    check_local_folder,
    load_into,
    read_config,
    write,
)
from qkv.models.checkpoints.fields import architectures
from qkv.models.checkpoints.weight_files import read_weights


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture that qkv reads and writes."""

    name: str  # as in config.json's "architectures"
    model_class: type[nn.Module]
    build: Callable[[dict], nn.Module]  # config.json -> a qkv model with fresh weights
    key_map: Callable[[nn.Module], KeyMap]
    hf_config: Callable[[nn.Module], dict]  # qkv model -> config.json


ARCHITECTURES: dict[str, Architecture] = {}
# transformers' class that saves a checkpoint of each qkv class (for the hint of a Hub name)
_AUTO_CLASSES = {
    "BertModel": "AutoModel",
    "BertForPreTraining": "AutoModelForPreTraining",
    "BertForSequenceClassification": "AutoModelForSequenceClassification",
}


def register(architecture: Architecture) -> None:
    ARCHITECTURES[architecture.name] = architecture


def from_pretrained(path: str | Path, *, expected: type[nn.Module] | None = None) -> nn.Module:
    """Load a local Hugging Face checkpoint directory into the qkv model its config names.

    The architecture is config.json's `architectures` entry; with `expected` (a qkv class), a
    checkpoint of another architecture of that class is also accepted when its layout fits
    (BertModel from a BertForPreTraining checkpoint, the heads dropped).
    A path with nothing there (a Hub name such as "gpt2": nothing is downloaded) raises
    NotAFolderError, which says how to make the folder.
    """
    _register_families()
    auto_class = _AUTO_CLASSES.get(getattr(expected, "__name__", ""), "AutoModelForCausalLM")
    check_local_folder(path, auto_class=auto_class)
    config = read_config(path)
    names = architectures(config)
    candidates = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
    if expected is not None:
        candidates = [a for a in candidates if issubclass(a.model_class, expected)] or [
            a for a in ARCHITECTURES.values() if a.model_class is expected
        ]
    if not candidates:
        raise CheckpointError(
            f"path: {path} declares architectures {names}; qkv reads "
            f"{sorted(ARCHITECTURES)}" + (f" as {expected.__name__}" if expected else "")
        )
    config_path = Path(path) / "config.json"
    model = _first_that_fits(candidates, lambda a: _build(a, config, config_path))
    architecture = next(a for a in candidates if type(model) is a.model_class)
    load_into(model, read_weights(path), architecture.key_map(model))
    return model.eval()


def _build(architecture: Architecture, config: dict, config_path: Path) -> nn.Module:
    """architecture.build(config), its errors named after the file (sizes, values)."""
    try:
        return architecture.build(config)
    except CheckpointError:
        raise
    except (TypeError, ValueError) as error:  # a config or size check of the model itself
        raise CheckpointError(f"{config_path}: {error}") from error


def save_pretrained(model: nn.Module, path: str | Path) -> Path:
    """Write `model` as a Hugging Face directory that transformers' from_pretrained loads.

    Several architectures may share a qkv class (GPT: GPT-2, Llama, Mistral): the first whose
    config writer accepts the model's config is used.
    """
    _register_families()
    candidates = [a for a in ARCHITECTURES.values() if type(model) is a.model_class]
    if not candidates:
        raise CheckpointError(f"model: qkv cannot save a {type(model).__name__} in the HF layout")
    chosen: list[Architecture] = []

    def config_of(architecture: Architecture) -> dict:
        hf_config = architecture.hf_config(model)
        chosen.append(architecture)
        return hf_config

    hf_config = _first_that_fits(candidates, config_of)
    return write(path, hf_config, model, chosen[-1].key_map(model))


def _first_that_fits(candidates: list[Architecture], attempt: Callable[[Architecture], object]):
    """The result of `attempt` for the first candidate that does not raise CheckpointError;
    if none fits, one error with every candidate's reason."""
    reasons = []
    for architecture in candidates:
        try:
            return attempt(architecture)
        except CheckpointError as error:
            reasons.append(f"{architecture.name}: {error}")
    raise CheckpointError("no architecture fits:\n  " + "\n  ".join(reasons))


class HuggingFaceIO:
    """Mixin: `from_pretrained(path)` and `save_pretrained(path)` for a qkv model class."""

    @classmethod
    def from_pretrained(cls, path: str | Path) -> nn.Module:
        """Load a local Hugging Face checkpoint directory (config.json + model.safetensors)."""
        return from_pretrained(path, expected=cls)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write config.json + model.safetensors that transformers' from_pretrained loads."""
        return save_pretrained(self, path)


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "HuggingFaceIO",
    "CheckpointError",
    "KeyMap",
    "NotAFolderError",
    "check_local_folder",
    "from_pretrained",
    "register",
    "save_pretrained",
]


def _register_families() -> None:
    """Importing each family module registers its architectures. Imported here, at the end,
    because the family modules import the model classes, which import this module."""
    from qkv.models.checkpoints import bert, gpt2, llama  # noqa: F401
