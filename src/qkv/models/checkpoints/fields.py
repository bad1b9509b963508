"""Typed reads of a Hugging Face config.json: a value of the wrong JSON type is refused there,
naming the key, the value and its type, instead of failing later deep inside a constructor
(`"32" * 4` builds a string, `range(2.0)` a TypeError) or being taken for another value
(`bool("false")` is True).

JSON has one number type: an int field accepts only an integer (not 2.0, not true), a float
field any number but a bool, a bool field only true or false.
"""

from __future__ import annotations

import logging

from qkv.models.checkpoints.core import CheckpointError

__all__ = [
    "ACTIVATIONS", "activation", "aliased", "architectures", "boolean", "integer", "labels",
    "mapping", "number", "optional_integer",
]  # fmt: skip

logger = logging.getLogger(__name__)

# transformers' activation names (activations.ACT2FN) of the functions qkv computes -> qkv's
# name; gelu_new, gelu_fast and gelu_pytorch_tanh all compute the tanh approximation of GELU
ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu", "relu": "relu", "silu": "silu", "swish": "silu",
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}  # fmt: skip

_MISSING = object()


def _get(config: dict, key: str, default: object) -> object:
    if key in config:
        return config[key]
    if default is _MISSING:
        raise CheckpointError(f"config.json: {key} is missing; expected it in the model's config")
    return default


def _refuse(key: str, value: object, expected: str) -> CheckpointError:
    return CheckpointError(
        f"config.json: {key} is {value!r:.80} ({type(value).__name__}); expected {expected}"
    )


def integer(config: dict, key: str, default: object = _MISSING) -> int:
    """config[key] (or `default` when absent), which must be a JSON integer."""
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(key, value, "an int")
    return value


def optional_integer(config: dict, key: str) -> int | None:
    """config[key] when present and not null, else None; an int when given."""
    return None if config.get(key) is None else integer(config, key)


def number(config: dict, key: str, default: object = _MISSING) -> float:
    """config[key] (or `default`) as a float; any JSON number but a bool."""
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(key, value, "a number")
    return float(value)


def boolean(config: dict, key: str, default: object = _MISSING) -> bool:
    """config[key] (or `default`), which must be true or false."""
    value = _get(config, key, default)
    if not isinstance(value, bool):
        raise _refuse(key, value, "a bool (true or false)")
    return value


def mapping(config: dict, key: str) -> dict:
    """config[key] when present and not null, else {}; a JSON object when given."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(key, value, "an object")
    return value


def architectures(config: dict) -> list[str]:
    """config.json's `architectures`: a list of class names (absent or null: none)."""
    names = config.get("architectures")
    if names is None:
        return []
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise CheckpointError(
            f"config.json: architectures is {names!r:.80}; expected a list of class names, "
            f'such as ["LlamaForCausalLM"]'
        )
    return names


def aliased(config: dict, key: str, alias: str) -> str:
    """Which of two spellings of one field (a transformers `attribute_map` entry: alias -> key)
    config.json's value is read from: transformers sets the alias after the field itself, so
    the alias wins when both are given (with a warning here when they differ)."""
    if alias not in config:
        return key
    if key in config and config[key] != config[alias]:
        logger.warning(
            "config.json: %s=%r and %s=%r name one field; %s is used, as transformers reads them",
            key, config[key], alias, config[alias], alias,
        )  # fmt: skip
    return alias


def activation(config: dict, key: str, default: str, computed: tuple[str, ...]) -> str:
    """config[key] (or `default`), a transformers activation name, as qkv's name (one of
    `computed`); CheckpointError for a function qkv does not compute here."""
    name = _get(config, key, default)
    if not isinstance(name, str):
        raise _refuse(key, name, "an activation name (a string)")
    ours = ACTIVATIONS.get(name)
    if ours not in computed:
        names = sorted(hf for hf, qkv in ACTIVATIONS.items() if qkv in computed)
        raise CheckpointError(f"config.json: {key} is {name!r}; qkv computes {names} here")
    return ours


def labels(config: dict) -> tuple[int, list[str] | None]:
    """The classes of a classifier's config.json, as transformers 5 resolves them: (count,
    names). id2label's names, unless num_labels is given and differs (then num_labels classes
    without names, LABEL_i, with transformers' warning); num_labels alone; neither: 2 classes.
    The names of a counted number of classes are not made here (num_labels may be huge)."""
    id2label = mapping(config, "id2label")
    named = all(key.isdigit() and isinstance(name, str) for key, name in id2label.items())
    if not named:
        raise CheckpointError(
            f"config.json: id2label is {id2label!r:.80}; expected an object from label ids "
            f'to names, such as {{"0": "NEGATIVE", "1": "POSITIVE"}}'
        )
    count = optional_integer(config, "num_labels")
    if id2label and count is not None and count != len(id2label):
        logger.warning(
            "config.json: num_labels=%d does not match the %d names of id2label; num_labels is "
            "used, as transformers reads them", count, len(id2label),
        )  # fmt: skip
    if id2label and count in (None, len(id2label)):
        return len(id2label), [id2label[key] for key in sorted(id2label, key=int)]
    return (2 if count is None else count), None
