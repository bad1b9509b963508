"""`qkv generate PATH PROMPT`: the prompt and its continuation from a local checkpoint, streamed
as the tokens come, then the speed in tokens/s on stderr."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from qkv.commands._text_input import check_arguments


def _generate(args: argparse.Namespace) -> int:
    """Echo the prompt and stream its continuation to stdout, token by token; then the number
    of tokens and their rate on stderr."""
    from qkv.acceleration import decoding_steps, packed_linears
    from qkv.generation.text import load_for_generation, stream_text
    from qkv.models.checkpoints import check_local_folder

    try:
        prompt = _prompt(args)
    except ValueError as error:
        print(f"qkv generate: error: {error}", file=sys.stderr)
        return 2
    try:
        check_arguments("PROMPT" if args.prompt is not None else "--prompt", [prompt])
        check_local_folder(args.path)  # a Hub name: say that nothing is downloaded, and how to
        model, tokenizer = load_for_generation(args.path)
        after_prompt = _AfterPrompt(tokenizer, prompt)
        with packed_linears(model) if args.pack else contextlib.nullcontext():
            # the steps of the model as packed: "auto" looks for a library of that form
            pieces = stream_text(
                model, after_prompt, prompt, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, sinks=None if args.sinks is None else tuple(args.sinks),
                steps=decoding_steps(model, _MODES[args.compile]),
            )  # fmt: skip
            started = time.perf_counter()
            _print_after(prompt, pieces)
            seconds = time.perf_counter() - started
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv generate: error: {error}", file=sys.stderr)
        return 1
    print()
    count = after_prompt.generated
    rate = f"{count / seconds:.0f}" if seconds > 0 else "-"
    print(f"{count} tokens in {seconds:.2f} s ({rate} tokens/s)", file=sys.stderr)
    return 0


_MODES = {None: "auto", True: "aot", False: "eager"}  # --compile / --no-compile / neither


def _prompt(args: argparse.Namespace) -> str:
    """The prompt, given as the positional PROMPT or as --prompt (both: the same text)."""
    given = [text for text in (args.prompt, args.prompt_option) if text is not None]
    if not given:
        raise ValueError("PROMPT: missing; expected the text to continue, as PROMPT or --prompt")
    if len(set(given)) > 1:
        raise ValueError(
            f"PROMPT: {args.prompt!r} and --prompt {args.prompt_option!r} differ; expected one"
        )
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
        help="continue a prompt with a local GPT-2/Llama/Mistral checkpoint, streaming the text",
    )
    generate.add_argument(
        "path", help="checkpoint folder (Hugging Face or qkv's own) with its tokenizer.json"
    )
    generate.add_argument("prompt", nargs="?", metavar="PROMPT", help="the text to continue")
    generate.add_argument(
        "--prompt", dest="prompt_option", metavar="PROMPT", help="the same, as an option"
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=50, help="tokens to generate (default 50)"
    )
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples"
    )
    generate.add_argument("--top-k", type=int, help="sample from the K most likely tokens")
    generate.add_argument("--top-p", type=float, help="nucleus sampling: smallest set of mass P")
    generate.add_argument("--seed", type=int, help="seed of the sampling generator")
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
    generate.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode with the step compiled ahead of time by AOTInductor (faster steps after "
        "a compilation of tens of seconds, paid once per machine: later runs load it in well "
        "under a second); --no-compile: eagerly. Default: compiled where an earlier run "
        'compiled it, else eager (qkv.acceleration.decoding_steps\' mode="auto")',
    )
    generate.set_defaults(run=_generate)
