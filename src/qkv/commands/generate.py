"""`qkv generate`: stream the continuation of a prompt from a local checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import sys


def _generate(args: argparse.Namespace) -> int:
    """Stream the continuation of --prompt to stdout, token by token."""
    from qkv.generation.text import load_for_generation, stream_text
    from qkv.layers import packed_linears

    try:
        model, tokenizer = load_for_generation(args.path)
        pieces = stream_text(
            model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            sinks=None if args.sinks is None else tuple(args.sinks), compile=args.compile,
        )  # fmt: skip
        with packed_linears(model) if args.pack else contextlib.nullcontext():
            for piece in pieces:
                print(piece, end="", flush=True)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv generate: error: {error}", file=sys.stderr)
        return 1
    print()
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a local GPT-2/Llama/Mistral checkpoint, streaming the text",
    )
    generate.add_argument(
        "path", help="checkpoint folder (Hugging Face or qkv's own) with its tokenizer.json"
    )
    generate.add_argument("--prompt", required=True, help="the text to continue")
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
        help="on the CPU, oneDNN-packed linear weights (qkv.layers.packed_linears): faster "
        "decoding for a second copy of the weights in memory (default: on)",
    )
    generate.add_argument(
        "--compile",
        action="store_true",
        help="decode with the model compiled by torch.compile (qkv.generate(compile=True)): "
        "2-3x faster steps on the CPU with --pack, after 15-30 s of compiling; worth it for "
        "long outputs (off by default)",
    )
    generate.set_defaults(run=_generate)
