"""Text in, text out: a checkpoint folder and a prompt to a stream of decoded text.

What `qkv generate` does, as library functions the CLI only prints from:
- `load_for_generation(path)`: a decoder-only model from a local folder, either qkv's own
  checkpoint (config.json with "format": "qkv", `qkv.models.load`) or a Hugging Face directory
  (`qkv.models.from_pretrained`), with the folder's `tokenizer.json` (the `tokenizers` library).
- `stream_text(model, tokenizer, prompt, ...)`: encodes the prompt, decodes with
  `qkv.generation.stream` and yields the new text as each token comes.
- `incremental_text(tokenizer, token_ids)`: the decoding behind it. A token need not be a whole
  character (byte-level BPE splits "é" into two tokens), so each step decodes the whole
  generated list and yields only what is new; text ending in an incomplete character (U+FFFD,
  the replacement character) is held back until the next token completes it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

import qkv.models as models
from qkv.generation.streaming import stream
from qkv.models.checkpoints.core import read_tokenizer

__all__ = ["incremental_text", "load_for_generation", "stream_text"]

logger = logging.getLogger(__name__)

TOKENIZER_NAME = "tokenizer.json"
_INCOMPLETE = "\ufffd"  # what a decoder shows for bytes that are not yet a whole character


def load_for_generation(path: str | os.PathLike) -> tuple[nn.Module, object]:
    """(model in eval mode, `tokenizers.Tokenizer`) from the checkpoint folder `path`.

    Raises ValueError (qkv.models.CheckpointError is one) when the folder has no config.json or
    no valid tokenizer.json, or holds a model that is not a decoder-only `qkv.models.GPT`.
    """

    directory = Path(path)
    tokenizer = read_tokenizer(directory, name=TOKENIZER_NAME)  # before the (slower) model
    loader = models.load if _is_qkv_checkpoint(directory) else models.from_pretrained
    model = loader(directory)
    if not isinstance(model, models.GPT):
        raise ValueError(
            f"path: {directory} holds a {type(model).__name__}; expected a decoder-only "
            f"language model (qkv.models.GPT: GPT-2, Llama, Mistral)"
        )
    return model.eval(), tokenizer


def _is_qkv_checkpoint(directory: Path) -> bool:
    """qkv's own config.json carries "format": "qkv" (`qkv.models.serialization`)."""
    try:
        document = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False  # from_pretrained then reports the missing or broken file
    return isinstance(document, dict) and document.get("format") == "qkv"


def stream_text(
    model: nn.Module,
    tokenizer: object,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    sinks: tuple[int, int] | None = None,
    steps: Callable | None = None,
    kv_dtype: torch.dtype | None = None,
) -> Iterator[str]:
    """The continuation of `prompt`, as pieces of text in the order they are generated.

    The prompt is encoded with the tokenizer's own settings (special tokens included); the
    pieces join to `tokenizer.decode(new token ids)`. Arguments are checked when called.
    `steps` and `kv_dtype` are `qkv.generate`'s.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {type(prompt).__name__}")
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError(f"prompt: {prompt!r} encodes to no tokens; expected some text")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, L)
    tokens = stream(
        model, input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, sinks=sinks, steps=steps, kv_dtype=kv_dtype,
    )  # fmt: skip
    return incremental_text(tokenizer, (int(step[0]) for step in tokens))


def incremental_text(tokenizer: object, token_ids: Iterable[int]) -> Iterator[str]:
    """Yield the text that each new token id adds to `tokenizer.decode(all ids so far)`.

    Text ending in U+FFFD (an incomplete character), or text that no longer starts with what
    was shown, waits for the next token; what is still held at the end is yielded then. For
    decoders whose text of a prefix of ids is a prefix of the whole text (byte-level BPE,
    WordLevel, WordPiece, Metaspace), the pieces join to the full decode.
    """
    ids: list[int] = []
    shown = ""
    for token_id in token_ids:
        ids.append(token_id)
        text = tokenizer.decode(ids)
        if text.endswith(_INCOMPLETE) or not text.startswith(shown):
            continue  # wait until the text settles
        if len(text) > len(shown):
            yield text[len(shown) :]
            shown = text
    text = tokenizer.decode(ids) if ids else ""
    if text.startswith(shown):
        if len(text) > len(shown):
            yield text[len(shown) :]
    else:  # the decoder rewrote text already shown; what is printed cannot be taken back
        logger.warning("decoded text changed after it was shown: %r -> %r", shown, text)
