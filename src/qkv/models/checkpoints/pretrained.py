"""Local Hugging Face folders <-> qkv models: `from_pretrained` and `save_pretrained`.

Importing this module imports the family modules, which register their architectures, and
connects the model classes' `from_pretrained` / `save_pretrained` methods to these functions
(`qkv.models.pretrained`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from qkv.models.checkpoints import bert, gpt2, llama, t5  # noqa: F401  (they register themselves)
from qkv.models.checkpoints.core import (
    CheckpointError,
    check_local_folder,
    load_into,
    read_config,
    write,
)
from qkv.models.checkpoints.fields import architectures
from qkv.models.checkpoints.registry import ARCHITECTURES, Architecture
from qkv.models.checkpoints.weight_files import read_weights, remove_shards
from qkv.models.gguf.model import from_gguf
from qkv.models.gpt import GPT
from qkv.models.pretrained import connect

__all__ = ["from_pretrained", "save_pretrained"]

# transformers' class that saves a checkpoint of each qkv class (for the hint of a Hub name)
_AUTO_CLASSES = {
    "BertModel": "AutoModel",
    "BertForPreTraining": "AutoModelForPreTraining",
    "BertForSequenceClassification": "AutoModelForSequenceClassification",
    "T5Transformer": "AutoModelForSeq2SeqLM",
}


def from_pretrained(path: str | Path, *, expected: type[nn.Module] | None = None) -> nn.Module:
    """Load a local Hugging Face checkpoint directory into the qkv model its config names.

    The architecture is config.json's `architectures` entry; with `expected` (a qkv class), a
    checkpoint of another architecture of that class is also accepted when its layout fits
    (BertModel from a BertForPreTraining checkpoint, the heads dropped).
    A path with nothing there (a Hub name such as "gpt2": nothing is downloaded) raises
    NotAFolderError, which says how to make the folder. A `.gguf` file is read by
    `qkv.models.gguf.from_gguf` (a GPT).
    """
    if Path(path).suffix == ".gguf" and Path(path).is_file():
        if expected is not None and not issubclass(GPT, expected):
            raise CheckpointError(f"path: {path} is a GGUF file, which qkv reads as a GPT, "
                                  f"not a {expected.__name__}")  # fmt: skip
        return from_gguf(path)
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
    candidates = [a for a in ARCHITECTURES.values() if type(model) is a.model_class]
    if not candidates:
        raise CheckpointError(f"model: qkv cannot save a {type(model).__name__} in the HF layout")
    chosen: list[Architecture] = []

    def config_of(architecture: Architecture) -> dict:
        hf_config = architecture.hf_config(model)
        chosen.append(architecture)
        return hf_config

    hf_config = _first_that_fits(candidates, config_of)
    remove_shards(path)  # a stale index would be read instead of the new model.safetensors
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


connect(from_pretrained, save_pretrained)
