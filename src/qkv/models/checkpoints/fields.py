"""Typed reads of a Hugging Face config.json: a value of the wrong JSON type is refused there,
naming the key, the value and its type, instead of failing later deep inside a constructor
(`"32" * 4` builds a string, `range(2.0)` a TypeError) or being taken for another value
(`bool("false")` is True).

JSON has one number type: an int field accepts only an integer (not 2.0, not true), a float
field any number but a bool, a bool field only true or false.
"""

from __future__ import annotations

from qkv.models.checkpoints.core import CheckpointError

__all__ = ["architectures", "boolean", "integer", "mapping", "number", "optional_integer"]

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
