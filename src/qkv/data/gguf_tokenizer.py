"""The tokenizer and the chat template of a GGUF file, as a `tokenizers.Tokenizer` and text.

A GGUF file (ggml's single-file model format, specified in ggml's docs/gguf.md) carries no
tokenizer.json; its metadata describes the tokenizer instead: `tokenizer.ggml.model` (the
algorithm: "gpt2" is byte-level BPE, the one read here), `.pre` (how text is cut into words),
`.tokens` (the vocabulary, an id is a position), `.token_type` (1 normal, 3 control such as
<|im_end|>, 4 user-defined), `.merges` ("left right", best first), the bos/eos/unknown/padding
ids, `.add_bos_token` / `.add_eos_token`, and `tokenizer.chat_template` (a Jinja template).

Byte-level BPE is GPT-2's (Radford et al. 2019, section 2.2): text is UTF-8 bytes, each written
as one printable character, so any text encodes without an unknown token; within each word,
merges join the best-ranked adjacent pair until none applies. How the words are cut differs
between model families, and `tokenizer.ggml.pre` names it (`GGUF_PRE_TOKENIZERS`):
- "gpt2", "gpt-2", "default": GPT-2's split (llama.cpp cuts "default" files its own way; this
  follows transformers, as the file does not say how the model was trained);
- "smollm": each number character alone, then GPT-2's split, as SmolLM's tokenizer.json and
  llama.cpp do (transformers reads it as plain GPT-2, which differs where white space precedes
  a number: 2+ white-space characters before 0-9, "x  1", or one space before "½", "٣");
- Llama-3's, Qwen-2's, Qwen-3.5's, Tekken's and GPT-4o's splits, under their GGUF names.
Control tokens, user-defined ones and the bos/eos/unknown/padding tokens are added tokens,
matched whole in text; all but the user-defined are special. The ids are those of
transformers' `AutoTokenizer.from_pretrained(folder, gguf_file=name)` but for "smollm" above.

`render_chat` renders a chat template as transformers' `apply_chat_template` does: a sandboxed
Jinja environment, trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
a `tojson` that leaves non-ASCII and HTML as they are, and `{% generation %}` blocks.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from qkv.models.gguf.file import read_gguf

__all__ = [
    "GGUF_PRE_TOKENIZERS",
    "ChatFormat",
    "chat_format_from_metadata",
    "gguf_pre_tokenizer",
    "render_chat",
    "tokenizer_from_gguf",
    "tokenizer_from_metadata",
]

CONTROL, USER_DEFINED = 3, 4  # values of tokenizer.ggml.token_type
# tokenizer.ggml.<name>_token_id -> the name transformers and chat templates give that token
_SPECIAL_NAMES = dict(bos="bos_token", eos="eos_token", unknown="unk_token", padding="pad_token")

# The word splits, as alternatives tried left to right at each position of the text: words
# (one non-letter may lead, a space mostly), numbers, other symbols, then runs of white space.
_LEAD, _CONTRACTIONS = r"[^\r\n\p{L}\p{N}]?", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CASED = (  # capitals then lower case, or capitals alone (Tekken, GPT-4o)
    _LEAD + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    _LEAD + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
)


def _split(words: tuple[str, ...], numbers: str, symbols: str) -> str:
    return "|".join((*words, numbers, symbols, r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))


_WORDS, _SYMBOLS = (_CONTRACTIONS, _LEAD + r"\p{L}+"), r" ?[^\s\p{L}\p{N}]+"
_SPLIT_NAMES = {
    _split(_WORDS, r"\p{N}{1,3}", _SYMBOLS + r"[\r\n]*"): "llama3 llama-v3 llama-bpe falcon3 "
    "falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano dbrx smaug-bpe",
    _split(_WORDS, r"\p{N}", _SYMBOLS + r"[\r\n]*"): "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez",
    _split(
        (_CONTRACTIONS, _LEAD + r"[\p{L}\p{M}]+"), r"\p{N}", r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    ): "qwen35",
    _split(_CASED, r"\p{N}", _SYMBOLS + r"[\r\n/]*"): "tekken",
    _split(
        tuple(word + _CONTRACTIONS + "?" for word in _CASED), r"\p{N}{1,3}", _SYMBOLS + r"[\r\n/]*"
    ): ("gpt-4o llama4 kanana2 talkie minimax-m2"),
}
_SPLITS = {name: pattern for pattern, names in _SPLIT_NAMES.items() for name in names.split()}
_GPT2_NAMES = ("default", "gpt-2", "gpt2")
GGUF_PRE_TOKENIZERS = tuple(sorted((*_GPT2_NAMES, "smollm", *_SPLITS)))


def gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split into words, then bytes as GPT-2's printable characters, that the
    `tokenizer.ggml.pre` value `pre` names; a ValueError lists the supported values."""
    byte_level = functools.partial(pre_tokenizers.ByteLevel, add_prefix_space=False)
    if pre in _GPT2_NAMES:
        return byte_level(use_regex=True)
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level(use_regex=True)])
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level(use_regex=False)])
    raise ValueError(
        f"metadata['tokenizer.ggml.pre']: unsupported pre-tokenizer {pre!r}; "
        f"expected one of {list(GGUF_PRE_TOKENIZERS)}"
    )


@functools.cache
def _byte_spelling() -> tuple[str, ...]:
    """GPT-2's character for each byte: printable Latin-1 bytes stand for themselves, the other
    68 (controls, space, soft hyphen, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    spelling = {byte: chr(byte) for byte in printable}
    spelling.update({byte: chr(0x100 + rank) for rank, byte in enumerate(others)})
    return tuple(spelling[byte] for byte in range(256))


def _is(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _key(metadata: Mapping[str, object], key: str, kind: type, default: object = None) -> object:
    """metadata[key], which must be a `kind` (a bool is not an int), or `default` if absent."""
    value = metadata.get(key)
    if value is None:
        return default
    if not _is(value, kind):
        raise ValueError(
            f"metadata[{key!r}]: expected {kind.__name__}, got {type(value).__name__} {value!r:.60}"
        )
    return value


def _list(metadata: Mapping[str, object], key: str, kind: type, default: object = None) -> list:
    """metadata[key], a non-empty list of `kind`, or `default` if absent."""
    values = metadata.get(key, default)
    if not isinstance(values, list) or not values:
        raise ValueError(f"metadata[{key!r}]: expected a non-empty list, got {values!r:.60}")
    for index, value in enumerate(values):
        if not _is(value, kind):
            raise ValueError(
                f"metadata[{key!r}][{index}]: expected {kind.__name__}, got {value!r:.60}"
            )
    return values


def _vocabulary(tokens: list[str], added: set[int]) -> dict[str, int]:
    """Token -> id. A token the file writes in plain text rather than in GPT-2's byte characters
    is respelled, unless it is an added token: those keep their text, the text they match."""
    spelling = _byte_spelling()
    alphabet = frozenset(spelling)
    vocabulary = {}
    for index, token in enumerate(tokens):
        if index not in added and not alphabet.issuperset(token):
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocabulary[token] = index
    return vocabulary


def _merges(metadata: Mapping[str, object], vocabulary: Mapping[str, int]) -> list[tuple[str, str]]:
    key = "tokenizer.ggml.merges"
    merges = []
    for index, merge in enumerate(_list(metadata, key, str)):
        pair = tuple(merge.split(" "))
        if len(pair) != 2 or not all(part in vocabulary for part in (*pair, "".join(pair))):
            raise ValueError(
                f"metadata[{key!r}][{index}]: {merge!r} is not two tokens of the vocabulary "
                "whose join is one"
            )
        merges.append(pair)
    return merges


def _special_id(metadata: Mapping[str, object], name: str, count: int) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    token_id = _key(metadata, key, int)
    if token_id is not None and not 0 <= token_id < count:
        raise ValueError(f"metadata[{key!r}]: {token_id} is not an id of the {count} tokens")
    return token_id


def _added_ids(metadata: Mapping[str, object], count: int) -> tuple[list[int], list[int]]:
    """The ids of the special added tokens (control, and the bos/eos/unknown/padding ones), and
    of the plain ones (user-defined, such as <think>)."""
    key = "tokenizer.ggml.token_type"
    types = _list(metadata, key, int, [1] * count)
    if len(types) != count:
        raise ValueError(f"metadata[{key!r}]: {len(types)} types for {count} tokens")
    named = {_special_id(metadata, name, count) for name in _SPECIAL_NAMES} - {None}
    special = [i for i, kind in enumerate(types) if kind == CONTROL or i in named]
    plain = [i for i, kind in enumerate(types) if kind == USER_DEFINED and i not in named]
    return special, plain


def _post_processor(metadata: Mapping[str, object], tokens: list[str]) -> processors.PostProcessor:
    """[bos] A [eos] for one text, [bos] A [eos] [bos] B [eos] for a pair, each mark where the
    file's add_bos_token / add_eos_token (default false) ask for it."""
    single, pair, specials = ["$A:0"], ["$B:1"], []
    for name, at_start in (("bos", True), ("eos", False)):
        if not _key(metadata, f"tokenizer.ggml.add_{name}_token", bool, False):
            continue
        token_id = _special_id(metadata, name, len(tokens))
        if token_id is None:
            raise ValueError(f"metadata: add_{name}_token is true but {name}_token_id is missing")
        specials.append((tokens[token_id], token_id))
        single.insert(0 if at_start else len(single), f"{tokens[token_id]}:0")
        pair.insert(0 if at_start else len(pair), f"{tokens[token_id]}:1")
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(single + pair), special_tokens=specials
    )


def tokenizer_from_metadata(metadata: Mapping[str, object]) -> Tokenizer:
    """The byte-level BPE tokenizer a GGUF file's metadata (plain Python values) describes."""
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata: expected a mapping, got {type(metadata).__name__}")
    model = _key(metadata, "tokenizer.ggml.model", str, "")
    if model != "gpt2":
        raise ValueError(
            f"metadata['tokenizer.ggml.model']: unsupported tokenizer {model!r}; expected 'gpt2' "
            "(byte-level BPE); SentencePiece ('llama') and the others are not read here"
        )
    pre = gguf_pre_tokenizer(_key(metadata, "tokenizer.ggml.pre", str, "default"))
    tokens = _list(metadata, "tokenizer.ggml.tokens", str)
    special, plain = _added_ids(metadata, len(tokens))
    vocabulary = _vocabulary(tokens, {*special, *plain})
    tokenizer = Tokenizer(models.BPE(vocabulary, _merges(metadata, vocabulary), fuse_unk=False))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False) for i in special])
    tokenizer.add_tokens([AddedToken(tokens[i], normalized=False) for i in plain])
    tokenizer.post_processor = _post_processor(metadata, tokens)
    return tokenizer


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer of the GGUF file at `path` (`tokenizer_from_metadata` on its metadata)."""
    return tokenizer_from_metadata(read_gguf(path).metadata)


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the special tokens it may name ({{ bos_token }}, {{ eos_token }})."""

    template: str
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        **variables: object,
    ) -> str:
        """`render_chat` with this template; `variables` may override the special tokens."""
        tokens = {k: v for k, v in vars(self).items() if k != "template" and v is not None}
        variables = {**tokens, **variables}
        return render_chat(
            self.template, messages, add_generation_prompt=add_generation_prompt, **variables
        )


def chat_format_from_metadata(metadata: Mapping[str, object]) -> ChatFormat:
    """The file's `tokenizer.chat_template` with the texts of its bos/eos/unknown/padding ids."""
    template = _key(metadata, "tokenizer.chat_template", str, "")
    if not template:
        raise ValueError("metadata['tokenizer.chat_template']: the file has no chat template")
    tokens = _list(metadata, "tokenizer.ggml.tokens", str)
    ids = {field: _special_id(metadata, key, len(tokens)) for key, field in _SPECIAL_NAMES.items()}
    return ChatFormat(template, **{f: None if i is None else tokens[i] for f, i in ids.items()})


def _checked_messages(messages: object) -> list[dict[str, object]]:
    """Each message as a new dict, without the keys whose value is None (as transformers)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise ValueError(f"messages: expected a non-empty list of messages, got {messages!r:.60}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}]: expected a mapping, got {message!r:.60}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise ValueError(
                    f"messages[{index}]: expected a string under {field!r}, got {message!r:.80}"
                )
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, object]],
    *,
    add_generation_prompt: bool = True,
    **variables: object,
) -> str:
    """The prompt `template` makes of `messages` (each with a string 'role' and 'content'), with
    the assistant's header at the end when `add_generation_prompt`. `variables` are what else
    the template reads (bos_token, tools, ...); tools and documents default to None."""
    if not isinstance(template, str) or not template:
        raise ValueError(f"template: expected a non-empty Jinja template, got {template!r:.60}")
    if not isinstance(add_generation_prompt, bool):
        raise ValueError(f"add_generation_prompt: expected a bool, got {add_generation_prompt!r}")
    context = {"tools": None, "documents": None, **variables}
    return _compiled(template).render(
        messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt, **context
    )


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled in a sandbox: it comes with a downloaded model, so it is untrusted
    code (jinja2 before 3.1.6 has known sandbox escapes, hence the floor)."""
    import jinja2  # installed with torch; imported only when a chat is rendered
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(map(int, re.findall(r"\d+", jinja2.__version__)[:3])) < (3, 1, 6):
        raise ImportError(f"render_chat needs jinja2>=3.1.6, found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: marks the assistant's text; renders it."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        options = {"indent": indent, "separators": separators, "sort_keys": sort_keys}
        return json.dumps(value, ensure_ascii=ensure_ascii, **options)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)
