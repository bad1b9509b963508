"""The GGUF tokenizer and chat template against transformers, on SmolLM2-135M-Instruct's file.

transformers builds its tokenizer from the same file (`AutoTokenizer.from_pretrained(folder,
gguf_file=...)`): the ids must be equal on hard text (Unicode, emoji, white space, code, special
tokens inside text), and the chat template must render the same prompt. One difference is
deliberate: SmolLM's pre-tokenizer ("smollm") cuts every number character off first, as SmolLM's
own tokenizer.json and llama.cpp do, while transformers 5.24 reads "smollm" as plain GPT-2; the
two differ only where white space comes right before a number character (NUMBERS_AFTER_WHITESPACE),
and there, as everywhere, the ids are checked against llama.cpp's two-step split, rebuilt here
with the `regex` module.
The other pre-tokenizer names are checked against transformers' own GGUF converter.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import regex
from tokenizers import Regex, pre_tokenizers
from transformers.integrations.gguf import convert_gguf_tokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
from transformers.utils.chat_template_utils import render_jinja_template

from qkv.data import (
    GGUF_PRE_TOKENIZERS,
    ChatFormat,
    chat_format_from_metadata,
    gguf_pre_tokenizer,
    render_chat,
    tokenizer_from_gguf,
    tokenizer_from_metadata,
)

HARD = {
    "english": "The quick brown fox jumps over the lazy dog. It's done; they'll see, we've won.",
    "accents": "Café naïve résumé façade Ångström déjà vu ÉCOLE",
    "cjk": "東京は日本の首都です。你好，世界！한국어 텍스트",
    "arabic": "مرحبا بالعالم، كيف حالك؟",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353 \u0915\u094d\u0937",
    "emoji": "👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈 🇫🇷🇯🇵 ❤️ 🫠",
    "spaces": "a  b   c    d     e      f",
    "edges": "   leading and trailing   ",
    "newlines_tabs": "line\n\nline\n\n\n\tindent\t\ttabs\r\nwindows\n",
    "digits": "1234567890123 3.14159 1,000,000 -42 2024-11-28 0x1F v2.0 x²,٣٤(½)",
    "code": 'def area(r: float) -> float:\n    """Circle."""\n    if r < 0:\n'
    "        raise ValueError(r)\n    return 3.14159 * r ** 2  # pi r^2\n",
    "specials": "<|im_start|>user\nhi<|im_end|>",
    "specials_glued": "text<|endoftext|>more<|im_end|><|im_start|>x",
    "empty": "",
    "only_spaces": "     ",
    "control_bytes": "\x04\x06 bell\x07 nul\x00",
}
# white space right before a number character, where transformers' plain GPT-2 split keeps one
# space with the number and the merges join them: 2+ white-space characters before 0-9 ("Ġ",
# "Ġ1" there, "ĠĠ", "1" in SmolLM's split), one space before ½ or ٣ ("ĠÂ", "½" / "Ġ", "Â½")
NUMBERS_AFTER_WHITESPACE = {
    "two_spaces": "x  1",
    "blank_line": "total:\n\n42",
    "indented": "values = [\n    1,\n    22,\n]\n\t\t7",
    "other_numbers": "½ cup, x ², ٣٤ and ⅻ",
}
# the control bytes missing from SmolLM2's vocabulary (4, 6, ...) are dropped by both tokenizers
NOT_ROUND_TRIPPED = {"control_bytes"}

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And in Japanese? 日本語で。"},
]
SYSTEM = {"role": "system", "content": "You are terse. Réponds en une phrase."}


@pytest.fixture(scope="module")
def gguf_path(smollm2_path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def metadata(smollm2_file) -> dict[str, object]:
    """The file's metadata as plain Python values (the gguf package's reader, via read_gguf)."""
    return smollm2_file.metadata


@pytest.fixture(scope="module")
def hf(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def ours(metadata):
    return tokenizer_from_metadata(metadata)


def llama_cpp_ids(hf, text: str) -> list[int]:
    """SmolLM's ids as llama.cpp makes them: cut every \\p{N} off, split the stretches between
    them with GPT-2's pattern, spell each piece's bytes in GPT-2's characters, then BPE."""
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    pieces = []
    for stretch in regex.split(r"(\p{N})", text):
        pieces += regex.findall(gpt2, stretch)
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model = hf.backend_tokenizer.model
    return [
        token.id
        for piece in pieces
        for spelled, _ in spell.pre_tokenize_str(piece)
        for token in model.tokenize(spelled)
    ]


@pytest.mark.parametrize("name", HARD)
def test_ids_equal_transformers(ours, hf, name):
    text = HARD[name]
    assert ours.encode(text).ids == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False).ids == hf.encode(text)


@pytest.mark.parametrize("name", [*HARD, *NUMBERS_AFTER_WHITESPACE])
def test_ids_equal_llama_cpp_split(ours, hf, name):
    text = {**HARD, **NUMBERS_AFTER_WHITESPACE}[name]
    if "<|" not in text:  # llama_cpp_ids knows no special tokens
        assert ours.encode(text).ids == llama_cpp_ids(hf, text)


@pytest.mark.parametrize("name", NUMBERS_AFTER_WHITESPACE)
def test_smollm_cuts_numbers_off_white_space(ours, hf, name):
    text = NUMBERS_AFTER_WHITESPACE[name]
    encoding = ours.encode(text)
    assert encoding.ids == llama_cpp_ids(hf, text)
    digits = [token for token in encoding.tokens if any(c in "0123456789" for c in token)]
    assert all(len(token) == 1 for token in digits), encoding.tokens
    assert ours.decode(encoding.ids) == text


def test_long_numbers_are_one_token_per_digit(ours):
    assert ours.encode("12345678901234567890").tokens == list("12345678901234567890")
    assert ours.encode(" 2024").tokens == ["Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize("name", HARD)
def test_decode_encode_round_trips_where_transformers_does(ours, hf, name):
    text = HARD[name]
    ids = hf.encode(text)
    theirs = hf.decode(ids, skip_special_tokens=False)
    assert (theirs == text) is (name not in NOT_ROUND_TRIPPED)
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == theirs


def test_special_tokens_are_matched_whole_and_skipped_on_request(ours):
    encoding = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert encoding.tokens[0] == "<|im_start|>" and encoding.tokens[-1] == "<|im_end|>"
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2
    assert ours.decode(encoding.ids) == "user\nhi"


def test_vocabulary_and_added_tokens_equal_transformers(ours, hf):
    backend = hf.backend_tokenizer
    assert ours.get_vocab(with_added_tokens=True) == backend.get_vocab(with_added_tokens=True)
    assert ours.get_vocab_size() == backend.get_vocab_size() == 49152

    def added(tokenizer):
        decoder = tokenizer.get_added_tokens_decoder()
        return sorted((i, t.content, t.special, t.normalized) for i, t in decoder.items())

    assert added(ours) == added(backend)
    assert len(added(ours)) == 17  # the control tokens <|endoftext|> ... <empty_output>


def test_bos_and_eos_are_added_where_the_file_asks(metadata):
    asks = {**metadata, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    tokenizer = tokenizer_from_metadata(asks)
    plain = tokenizer_from_metadata(metadata)
    a, b = plain.encode("hi").ids, plain.encode("there").ids
    assert tokenizer.encode("hi").ids == [1, *a, 2]
    assert tokenizer.encode("hi", "there").ids == [1, *a, 2, 1, *b, 2]
    assert tokenizer.encode("hi", "there").type_ids == [0] * (len(a) + 2) + [1] * (len(b) + 2)
    assert tokenizer.encode("hi", add_special_tokens=False).ids == a


def test_tokenizer_from_gguf_reads_the_file(gguf_path, ours):
    assert tokenizer_from_gguf(gguf_path).to_str() == ours.to_str()


def test_every_pre_tokenizer_transformers_supports_is_supported():
    assert set(GGUF_PRE_TOKENIZER_SPLITS) <= set(GGUF_PRE_TOKENIZERS)


@pytest.mark.parametrize("pre", sorted(set(GGUF_PRE_TOKENIZERS) - {"smollm"}))
def test_pre_tokenizer_splits_as_transformers(pre):
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:  # transformers' GGUF converter keeps GPT-2's ByteLevel for these
        theirs = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        theirs = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    mine = gguf_pre_tokenizer(pre)
    texts = [*HARD.values(), *NUMBERS_AFTER_WHITESPACE.values(), "HTTPServer's JSONParser'LL ok"]
    for text in texts:
        assert mine.pre_tokenize_str(text) == theirs.pre_tokenize_str(text), (pre, text)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"])
def test_ids_equal_transformers_converter_for_each_split(metadata, pre):
    tokenizer_dict = {
        "tokenizer_type": "gpt2",
        "pre_tokenizer_type": pre,
        "tokens": metadata["tokenizer.ggml.tokens"],
        "token_type": metadata["tokenizer.ggml.token_type"],
        "merges": metadata["tokenizer.ggml.merges"],
    }
    theirs, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    mine = tokenizer_from_metadata({**metadata, "tokenizer.ggml.pre": pre})
    for text in [*HARD.values(), *NUMBERS_AFTER_WHITESPACE.values()]:
        assert mine.encode(text).ids == theirs.encode(text).ids, (pre, text)


@pytest.fixture(scope="module")
def chat(metadata) -> ChatFormat:
    return chat_format_from_metadata(metadata)


def test_chat_format_reads_the_template_and_special_tokens(chat, metadata):
    assert chat.template == metadata["tokenizer.chat_template"]
    assert (chat.bos_token, chat.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (chat.unk_token, chat.pad_token) == ("<|endoftext|>", "<|im_end|>")


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_renders_as_transformers(chat, hf, ours, system, add_generation_prompt):
    messages = [SYSTEM, *CONVERSATION] if system else CONVERSATION
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    prompt = chat.render(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == expected
    assert prompt.endswith("<|im_start|>assistant\n") is add_generation_prompt
    assert ("helpful AI assistant named SmolLM" in prompt) is not system
    assert ours.encode(prompt).ids == hf.encode(expected, add_special_tokens=False)


def test_render_chat_defaults_to_a_generation_prompt(chat):
    assert render_chat(chat.template, CONVERSATION) == chat.render(CONVERSATION)


JINJA_FEATURES = (
    "{% set ns = namespace(n=0) %}\n"
    "{% for m in messages %}\n"
    "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
    "  {% set ns.n = ns.n + 1 %}\n"
    "  {{ m | tojson }} {{ m | tojson(indent=2, sort_keys=True) }}\n"
    "{% endfor %}\n"
    "{% generation %}{{ ns.n }} {{ strftime_now('%Y') }} {{ bos_token }}{% endgeneration %}\n"
    "{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }}"
)


def test_jinja_environment_equals_transformers():
    messages = [
        {"role": "user", "content": '<b>&</b> Ünïcode "quoted" 日本'},
        *CONVERSATION,
    ]
    (theirs,), _ = render_jinja_template(
        [messages], chat_template=JINJA_FEATURES, add_generation_prompt=True, bos_token="<s>"
    )
    assert render_chat(JINJA_FEATURES, messages, bos_token="<s>") == theirs
    assert "<b>&</b> Ünïcode" in theirs  # tojson neither escapes HTML nor non-ASCII


def test_raise_exception_raises_a_template_error():
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system') }}{% endif %}"
    )
    with pytest.raises(jinja2.TemplateError, match="no system"):
        render_chat(template, CONVERSATION)


def test_the_template_runs_in_an_immutable_sandbox():
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.append(messages[0]) }}", CONVERSATION)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", CONVERSATION)


@pytest.mark.parametrize(
    "messages, named",
    [
        ([], "messages"),
        ("hi", "messages"),
        (None, "messages"),
        ([CONVERSATION[0], "hi"], r"messages\[1\]"),
        ([CONVERSATION[0], {"content": "no role"}], r"messages\[1\]"),
        ([{"role": "user"}], r"messages\[0\]"),
        ([{"role": "user", "content": None}], r"messages\[0\]"),
        ([{"role": "user", "content": ["a", "list"]}], r"messages\[0\]"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]"),
    ],
)
def test_bad_messages_are_refused_by_name(chat, messages, named):
    with pytest.raises(ValueError, match=named):
        render_chat(chat.template, messages)


def test_bad_template_and_flag_are_refused_by_name():
    with pytest.raises(ValueError, match="template"):
        render_chat("", CONVERSATION)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_chat("{{ messages }}", CONVERSATION, add_generation_prompt="yes")


def tiny_metadata(**changes: object) -> dict[str, object]:
    """A byte-level BPE of three tokens and one merge."""
    base = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 3,
    }
    return {**base, **{f"tokenizer.ggml.{key}": value for key, value in changes.items()}}


def test_tiny_metadata_builds_a_tokenizer():
    tokenizer = tokenizer_from_metadata(tiny_metadata())
    assert tokenizer.encode("abab<|end|>").ids == [2, 2, 3]
    appended = tokenizer_from_metadata(tiny_metadata(add_eos_token=True))
    assert appended.encode("ab").ids == [2, 3]


def test_unsupported_pre_tokenizer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre.*'bogus'.*'smollm'"):
        tokenizer_from_metadata(tiny_metadata(pre="bogus"))


@pytest.mark.parametrize("model", ["llama", "t5", "bert", None])
def test_unsupported_tokenizer_model_is_refused_by_name(model):
    metadata = tiny_metadata(model=model)
    if model is None:
        del metadata["tokenizer.ggml.model"]
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model.*expected 'gpt2'"):
        tokenizer_from_metadata(metadata)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"tokens": []}, r"tokenizer\.ggml\.tokens"),
        ({"tokens": ["a", 2, "ab", "x"]}, r"tokenizer\.ggml\.tokens'\]\[1\]"),
        ({"token_type": [1, 1]}, r"tokenizer\.ggml\.token_type"),
        ({"merges": ["a c"]}, r"tokenizer\.ggml\.merges'\]\[0\]"),
        ({"merges": ["ab"]}, r"tokenizer\.ggml\.merges'\]\[0\]"),
        ({"eos_token_id": 9}, r"tokenizer\.ggml\.eos_token_id"),
        ({"bos_token_id": True}, r"tokenizer\.ggml\.bos_token_id"),
        ({"add_bos_token": True}, "add_bos_token is true but bos_token_id is missing"),
        ({"add_eos_token": "yes"}, r"tokenizer\.ggml\.add_eos_token"),
    ],
)
def test_bad_metadata_is_refused_by_key(changes, named):
    with pytest.raises(ValueError, match=named):
        tokenizer_from_metadata(tiny_metadata(**changes))


def test_missing_chat_template_is_refused_by_key():
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template"):
        chat_format_from_metadata(tiny_metadata())
    with pytest.raises(TypeError, match="metadata"):
        tokenizer_from_metadata([("tokenizer.ggml.model", "gpt2")])
