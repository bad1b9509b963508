"""Text given to a command, checked before any model loads, with the argument or file named.

Invalid UTF-8 reaches Python in two shapes: in the arguments (and in standard input read with
the surrogateescape handler) as lone surrogates, one per undecodable byte (PEP 383); read
strictly from a file, as a UnicodeDecodeError. Neither names where the text came from, and
lone surrogates only fail deep inside a tokenizer ("TextInputSequence must be str").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def check_arguments(name: str, texts: Sequence[str], *, allow_empty: bool = True) -> list[str]:
    """`texts` from the command line, each valid UTF-8 (and, unless allow_empty, not blank)."""
    for number, text in enumerate(texts, start=1):
        which = "the text" if len(texts) == 1 else f"argument {number}"
        problem = _utf8_problem(text)
        if problem is not None:
            raise ValueError(f"{name}: {which} is not valid UTF-8 ({problem}); expected UTF-8 text")
        if not allow_empty and not text.strip():
            raise ValueError(
                f"{name}: {which} is {text!r}, empty or only whitespace; expected some text"
            )
    return list(texts)


def read_lines(path: str, read: Callable[[str], list[str]]) -> list[str]:
    """The lines `read(path)` gives (path "-": standard input), refused as a whole when the
    file is not UTF-8 text: undecodable bytes, or a NUL character (a binary file)."""
    where = "standard input" if path == "-" else path
    try:
        lines = read(path)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--file: {where} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
            f"offset {error.start}: {error.reason}); expected a text file, one text per line"
        ) from None
    for number, line in enumerate(lines, start=1):
        problem = _utf8_problem(line)
        if problem is not None:
            raise ValueError(
                f"--file: {where}, line {number}, is not valid UTF-8 ({problem}); expected a "
                f"text file, one text per line"
            )
        if "\0" in line:
            raise ValueError(
                f"--file: {where}, line {number}, holds a NUL character: a binary file? "
                f"expected a text file, one text per line"
            )
    return lines


def _utf8_problem(text: str) -> str | None:
    """None for text that encodes to UTF-8; else its bytes and the first bad one, in words."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")  # the bytes the surrogates stand for
        raw.decode("utf-8")
    except UnicodeEncodeError:  # a surrogate that stands for no byte (U+D800 .. U+DC7F)
        return f"{text.encode('utf-8', 'backslashreplace')[:60]!r}: a lone surrogate"
    except UnicodeDecodeError as error:
        return f"{raw[:60]!r}: byte {raw[error.start]:#04x} at offset {error.start}, {error.reason}"
    return f"{raw[:60]!r}, escaped as lone surrogates"
