"""`qkv translate TEXT...`: German number words to English with a `qkv train translate` model."""

from __future__ import annotations

import argparse
import sys

from qkv.commands._text_input import check_arguments


def _run(args: argparse.Namespace) -> int:
    from qkv.training.tasks.translate import load_translator, translate

    try:
        texts = check_arguments("TEXT", args.texts, allow_empty=False)
        model, tokenizer = load_translator(args.model)
        outputs = translate(model, tokenizer, texts, num_beams=args.beams)
    except (ValueError, OSError) as error:
        print(f"qkv translate: error: {error}", file=sys.stderr)
        return 1
    for output in outputs:
        print(output)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "translate", help="translate German number words with a model from `qkv train translate`"
    )
    parser.add_argument("texts", nargs="+", metavar="TEXT", help='e.g. "dreihundertzwölf"')
    parser.add_argument(
        "--model", default="runs/translate/model", help="model folder (default %(default)s)"
    )
    parser.add_argument("--beams", type=int, default=1, help="beam search width (1: greedy)")
    parser.set_defaults(run=_run)
