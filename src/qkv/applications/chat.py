"""Chat with a decoder-only model: the model, its tokenizer and chat template from one spec, and a
conversation kept within the model's context.

- `load_chat_model(spec)`: a `ChatModel` (model in eval mode, `tokenizers.Tokenizer`, the chat
  template as a `ChatFormat`, None where the source has none) from the short name of a packaged
  model ("smollm2", `PACKAGED_MODELS`), a GGUF file, or a checkpoint folder. A GGUF file is read
  once: its weights, tokenizer and template come from the same `GGUFFile`; its Q4_0 and Q4_1
  weights stay quantized where that decodes faster here (`weights="auto"`, see
  `load_chat_model`). A folder is read by `qkv.generation.text.load_for_generation`; its
  template is chat_template.jinja, else tokenizer_config.json's "chat_template", as
  transformers saves them.
- `trim_history(messages, count_tokens, budget)`: the oldest turns dropped until the prompt
  fits, the system message and the question being asked kept.
- `Chat`: a conversation. Each answer continues the whole history, rendered by the template with
  the assistant's header at the end (transformers' `apply_chat_template(messages,
  add_generation_prompt=True)`), streamed as text until the token that ends an assistant's turn.
  The KV cache stays from one answer to the next (`qkv.generation.PromptCache`): the model reads
  only what the history gained since, not the whole of it at every turn.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import TemplateError
from torch import nn

from qkv.acceleration.quantized_models import quantized_from_gguf, quantized_pays
from qkv.data.gguf_tokenizer import ChatFormat, chat_format_from_metadata, tokenizer_from_metadata
from qkv.generation.options import DecodeOptions
from qkv.generation.prompt_cache import PromptCache
from qkv.generation.streaming import stream
from qkv.generation.text import incremental_text, load_for_generation
from qkv.models.checkpoints.bundled import PACKAGED_MODELS, packaged_model_path
from qkv.models.gguf.file import read_gguf
from qkv.models.gguf.model import model_from_file

__all__ = ["Chat", "ChatModel", "load_chat_model", "stop_token_ids", "trim_history"]

logger = logging.getLogger(__name__)

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": text}


@dataclass(frozen=True)
class ChatModel:
    """A decoder-only `qkv.models.GPT` in eval mode, its `tokenizers.Tokenizer`, and its chat
    template (None where the source carries none)."""

    model: nn.Module
    tokenizer: object
    chat_format: ChatFormat | None
    weights: str = ""  # how a GGUF file's weights are held, and why ("" for other sources)


WEIGHTS = ("auto", "quantized", "dequantized")


def load_chat_model(
    spec: str | os.PathLike, *, argument: str = "spec", weights: str = "auto"
) -> ChatModel:
    """The model `spec` names: a packaged model's short name (`PACKAGED_MODELS`), a GGUF file, or
    a checkpoint folder (Hugging Face or qkv's own, with its tokenizer.json).

    weights (a GGUF file): "quantized" keeps the file's Q4_0, Q4_1 and Q8_0 linear weights as
    blocks (`qkv.acceleration.quantized_from_gguf`), "dequantized" makes every weight fp32
    (`qkv.models.from_gguf`), "auto" (the default) quantized where
    `qkv.acceleration.quantized_pays` says so: Q4_0 and Q4_1 files on a CPU where PyTorch's
    int4pack kernel runs (faster decoding than fp32 in a third of the memory:
    benchmarks/decode_smollm2.py), else fp32.

    Raises ValueError naming `argument` for a spec that is none of these, FileNotFoundError (with
    how to install it) for a packaged model whose package is missing, and what the readers raise
    for a file or folder they cannot read."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {WEIGHTS}, got {weights!r}")
    if isinstance(spec, str) and spec in PACKAGED_MODELS:
        return _from_gguf(packaged_model_path(spec), weights)
    path = Path(spec)
    if path.is_dir():
        model, tokenizer = load_for_generation(path)
        return ChatModel(model, tokenizer, folder_chat_format(path))
    if path.is_file():
        return _from_gguf(path, weights)
    raise ValueError(
        f"{argument}: {str(spec)!r} is neither a packaged model nor a file or folder that exists; "
        f"expected one of {sorted(PACKAGED_MODELS)}, a .gguf file or a checkpoint folder"
    )


def _from_gguf(path: Path, weights: str) -> ChatModel:
    file = read_gguf(path)  # the slow part: read once for the weights, tokenizer and template
    metadata = file.metadata
    pays = quantized_pays(file) if weights == "auto" else None
    if weights == "quantized" or pays:
        model = quantized_from_gguf(file)
        held = f"quantized: {pays.reason}" if pays else "quantized, as asked"
    else:
        model = model_from_file(file)
        held = f"dequantized to fp32: {pays.reason}" if pays is not None else "fp32, as asked"
    chat_format = None
    if metadata.get("tokenizer.chat_template"):
        chat_format = chat_format_from_metadata(metadata)
    return ChatModel(model, tokenizer_from_metadata(metadata), chat_format, f"weights {held}")


def folder_chat_format(path: str | os.PathLike) -> ChatFormat | None:
    """The chat template of a checkpoint folder with the special tokens tokenizer_config.json
    names: chat_template.jinja, else that file's "chat_template" (a string, or a list of named
    templates of which "default" is taken); None when there is none."""
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"path: {config_file} is not a readable JSON file ({error})") from error
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(template, str) or not template:
        return None
    tokens = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
    tokens |= {name: _token_text(config.get(name)) for name in ("unk_token", "pad_token")}
    return ChatFormat(template, **tokens)


def _token_text(value: object) -> str | None:
    """A token of tokenizer_config.json: its text, or a dict with the text under "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def stop_token_ids(tokenizer, chat_format: ChatFormat) -> frozenset[int]:
    """The ids that end an answer: the end-of-text token's, and the special token the template
    writes right after an assistant's message (<|im_end|> of ChatML, Llama 3's <|eot_id|>),
    found by rendering one."""
    eos = None if chat_format.eos_token is None else tokenizer.token_to_id(chat_format.eos_token)
    ids = set() if eos is None else {eos}
    marker = "\u2063answer\u2063"  # text no template writes itself (INVISIBLE SEPARATOR)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}]
    try:
        rendered = chat_format.render(messages, add_generation_prompt=False)
    except (TemplateError, ValueError, TypeError):
        rendered = ""  # a template that refuses this chat; the end-of-text token alone then
    if marker in rendered:
        after = tokenizer.encode(rendered.split(marker, 1)[1], add_special_tokens=False).ids
        special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        if after and after[0] in special:
            ids.add(after[0])
    if not ids:
        logger.warning("no token ends an answer: each answer runs to max_new_tokens")
    return frozenset(ids)


def trim_history(
    messages: Sequence[Message], count_tokens: Callable[[list[Message]], int], budget: int
) -> tuple[list[Message], int]:
    """(`messages` less their oldest turns, the number of turns dropped), dropping as few as
    make `count_tokens(messages) <= budget`. A turn is a user message and what follows it up
    to the next one; a system message at the start is never dropped, nor is the last turn.

    Raises ValueError when the system message and the last turn alone are over the budget."""
    kept = list(messages)
    start = 1 if kept and kept[0]["role"] == "system" else 0
    dropped = 0
    while (count := count_tokens(kept)) > budget:
        later_users = [i for i in range(start + 1, len(kept)) if kept[i]["role"] == "user"]
        if not later_users:
            raise ValueError(
                f"messages: the last message is too long: {count} tokens with the system "
                f"message, over the {budget} the context leaves; expected a shorter message"
            )
        del kept[start : later_users[0]]
        dropped += 1
    return kept, dropped


class Chat:
    """A conversation with `loaded`: its messages, an optional system message first, kept
    within the model's context (`trim_history`), each answer streamed as text.

    `options` are `qkv.generate`'s sampling fields (temperature, top_k, top_p, seed); greedy
    by default, so that an answer is the same each time. `steps` is `qkv.generate`'s.
    `prompt_cache` keeps the KV cache of the conversation's tokens between answers, so that
    each prompt's tokens already seen are not run again (`prompt_cache.reused`: how many were
    not, for the latest answer)."""

    def __init__(
        self,
        loaded: ChatModel,
        *,
        system: str | None = None,
        max_new_tokens: int = 256,
        steps: Callable | None = None,
        **options: object,
    ) -> None:
        if loaded.chat_format is None:
            raise ValueError(
                "loaded: the model has no chat template (a GGUF file's tokenizer.chat_template, "
                "or a folder's chat_template.jinja or tokenizer_config.json); expected one"
            )
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system: expected a str or None, got {type(system).__name__}")
        self.options = DecodeOptions(max_new_tokens=max_new_tokens, **options)
        self.context = loaded.model.config.context_length
        if max_new_tokens >= self.context:
            raise ValueError(f"max_new_tokens: {max_new_tokens} leaves no room for a prompt in "
                             f"the model's context of {self.context}; expected fewer")  # fmt: skip
        self.loaded, self.system, self.steps = loaded, system, steps
        self.stop_ids = stop_token_ids(loaded.tokenizer, loaded.chat_format)
        self.messages: list[Message] = []
        self.generated = 0  # tokens of the last answer
        self.prompt_cache = PromptCache()
        self.reset()

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def prompt_ids(self, messages: Sequence[Message] | None = None) -> list[int]:
        """The token ids of `messages` (default: the history) as the template renders them, with
        the assistant's header at the end. The template writes the special tokens it wants, so
        the tokenizer adds none (as `apply_chat_template(..., tokenize=True)`)."""
        text = self.loaded.chat_format.render(list(self.messages if messages is None else messages))
        return self.loaded.tokenizer.encode(text, add_special_tokens=False).ids

    def add_user(self, text: str) -> int:
        """Append the user's message, dropping the oldest turns where the prompt and
        max_new_tokens would not fit in the context; the number of turns dropped. A message too
        long to fit even alone raises ValueError and is not kept."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        budget = self.context - self.options.max_new_tokens
        messages = [*self.messages, {"role": "user", "content": text}]
        self.messages, dropped = trim_history(messages, lambda m: len(self.prompt_ids(m)), budget)
        if dropped:
            logger.info("dropped the %d oldest turns to fit the context of %d", dropped, budget)
        return dropped

    def answer(self, on_text: Callable[[str], None]) -> str:
        """The model's answer to the history, each piece of text passed to `on_text` as it is
        decoded (`qkv.generation.text.incremental_text`), until a stop token or max_new_tokens.
        The answer joins the history, also when `on_text` or the decoding raises (Ctrl-C:
        KeyboardInterrupt), with the text produced until then; the exception goes on."""
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError("messages: expected a user message last; call add_user first")
        model = self.loaded.model
        device = next(model.parameters()).device
        input_ids = torch.tensor([self.prompt_ids()], dtype=torch.long, device=device)  # (1, L)
        tokens = stream(model, input_ids, self.options, steps=self.steps,
                        prompt_cache=self.prompt_cache)  # fmt: skip
        self.generated, pieces = 0, []
        try:
            for piece in incremental_text(self.loaded.tokenizer, self._until_stop(tokens)):
                pieces.append(piece)
                on_text(piece)
        finally:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
        return "".join(pieces)

    def _until_stop(self, tokens: Iterable[torch.Tensor]) -> Iterator[int]:
        """The ids of the streamed steps (B = 1), up to but without the first stop token."""
        for step in tokens:
            token = int(step[0])
            self.generated += 1
            if token in self.stop_ids:
                return
            yield token
