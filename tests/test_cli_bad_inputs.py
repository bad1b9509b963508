"""Nothing quietly accepted as text: invalid UTF-8 in the arguments or on standard input, a
binary --file, blank texts to translate. Each command prints one line,
`qkv <command>: error: ...` naming the argument or the file, before any model loads; the
library's `translate` refuses blank or non-str texts naming `texts`.

Invalid UTF-8 in argv reaches Python as lone surrogates (PEP 383: os.fsdecode does the same),
and on standard input as lone surrogates or as a UnicodeDecodeError, by the stream's errors
handler.
"""

from __future__ import annotations

import io
import os
import re
import sys

import pytest
import torch

from qkv.cli import main

INVALID = os.fsdecode(b"caf\xff")  # what argv holds for the bytes "caf\xff"
NO_MODEL = "/nonexistent/qkv-model"  # the text is refused before this is looked at


def _stdin(data: bytes, errors: str) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors)


def _file(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# (description, argv (tmp_path -> list), stdin bytes and errors handler or None, message regex)
CLI_CATALOGUE = [
    ("embed: an invalid UTF-8 argument", lambda d: ["embed", INVALID], None,
     r"qkv embed: error: TEXT: the text is not valid UTF-8 \(b'caf\\xff': byte 0xff at "
     r"offset 3, invalid start byte\); expected UTF-8 text"),
    ("embed: the second of two arguments", lambda d: ["embed", "fine", INVALID], None,
     r"qkv embed: error: TEXT: argument 2 is not valid UTF-8"),
    ("embed: a lone surrogate that stands for no byte", lambda d: ["embed", "a\ud800"], None,
     r"qkv embed: error: TEXT: the text is not valid UTF-8 \(.*a lone surrogate\)"),
    ("embed: a binary --file", lambda d: ["embed", "--file", _file(d, "some.bin",
     b"\x89PNG\r\n\x1a\n\x00")], None,
     r"qkv embed: error: --file: \S*some\.bin is not UTF-8 text \(byte 0x89 at offset 0"),
    ("embed: a --file of NUL bytes (valid UTF-8)", lambda d: ["embed", "--file", _file(d,
     "zeros.bin", b"text\n\x00\x00\x00\n")], None,
     r"qkv embed: error: --file: \S*zeros\.bin, line 2, holds a NUL character: a binary file"),
    ("embed: invalid UTF-8 on stdin, decoded strictly", lambda d: ["embed", "--file", "-"],
     (b"ok\n\xff\n", "strict"),
     r"qkv embed: error: --file: standard input is not UTF-8 text \(byte 0xff at offset 3"),
    ("embed: invalid UTF-8 on stdin, surrogate-escaped", lambda d: ["embed", "--file", "-"],
     (b"ok\n\xff\n", "surrogateescape"),
     r"qkv embed: error: --file: standard input, line 2, is not valid UTF-8 \(b'\\xff'"),
    ("translate: an invalid UTF-8 argument", lambda d: ["translate", INVALID, "--model",
     NO_MODEL], None, r"qkv translate: error: TEXT: the text is not valid UTF-8 \(b'caf\\xff'"),
    ("translate: an empty argument", lambda d: ["translate", "acht", "", "--model", NO_MODEL],
     None, r"qkv translate: error: TEXT: argument 2 is '', empty or only whitespace"),
    ("translate: a blank argument", lambda d: ["translate", " \t", "--model", NO_MODEL], None,
     r"qkv translate: error: TEXT: the text is ' \\t', empty or only whitespace"),
    ("generate: an invalid UTF-8 PROMPT", lambda d: ["generate", NO_MODEL, INVALID], None,
     r"qkv generate: error: PROMPT: the text is not valid UTF-8 \(b'caf\\xff'"),
    ("generate: an invalid UTF-8 --prompt", lambda d: ["generate", NO_MODEL, "--prompt",
     INVALID], None, r"qkv generate: error: --prompt: the text is not valid UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("description", "argv", "stdin", "message"), CLI_CATALOGUE, ids=[c[0] for c in CLI_CATALOGUE]
)
def test_bad_text_prints_one_error_line_naming_it(
    description, argv, stdin, message, tmp_path, capsys, monkeypatch
):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", _stdin(*stdin))
    status = main(argv(tmp_path))
    captured = capsys.readouterr()
    assert (status, captured.out) == (1, "")
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert re.fullmatch(message + r".*", lines[0]), lines[0]


@pytest.fixture(scope="module")
def translator():
    from qkv.data.translate import train_translation_tokenizer
    from qkv.models import Transformer, TransformerConfig

    pairs = [("acht", "eight"), ("neun", "nine"), ("zehn", "ten"), ("elf", "eleven")]
    tokenizer = train_translation_tokenizer(pairs, vocab_size=40)
    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        "transformer-tiny", src_vocab_size=vocab, tgt_vocab_size=vocab
    )
    return Transformer(config).eval(), tokenizer


# (description, texts, expected error, message)
TRANSLATE_CATALOGUE = [
    ("an empty text", [""], ValueError, r"texts: item 0 is '', empty or only whitespace"),
    ("a blank text among good ones", ["acht", "  \n"], ValueError,
     r"texts: item 1 is '  \\n', empty or only whitespace; expected text to translate"),
    ("a str instead of a list", "acht", TypeError, r"texts: expected a list of str, got str"),
    ("a number in the list", ["acht", 8], TypeError, r"texts: item 1 is int 8; expected a str"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("description", "texts", "error", "message"),
    TRANSLATE_CATALOGUE,
    ids=[c[0] for c in TRANSLATE_CATALOGUE],
)
def test_translate_refuses_texts_with_nothing_to_translate(
    translator, description, texts, error, message
):
    from qkv.training.tasks.translate import translate

    model, tokenizer = translator
    with pytest.raises(error, match=message):
        translate(model, tokenizer, texts, max_new_tokens=2)


def test_translate_still_translates_real_text_and_nothing(translator):
    from qkv.training.tasks.translate import translate

    model, tokenizer = translator
    outputs = translate(model, tokenizer, ["acht", "neun"], max_new_tokens=2)
    assert len(outputs) == 2 and all(isinstance(text, str) for text in outputs)
    assert translate(model, tokenizer, [], max_new_tokens=2) == []
