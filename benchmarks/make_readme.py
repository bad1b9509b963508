"""Writes benchmarks/README.md from the result files in benchmarks/results/*.json.

    python benchmarks/make_readme.py            # rewrite benchmarks/README.md
    python benchmarks/make_readme.py --check    # exit 1 if README.md is not what the JSON gives

Every figure of the page comes from a JSON file written by a benchmark script (the ratios and
ranges are computed here from the values in those files), so the page cannot drift from the
measurements: after a benchmark run, run this script; the tests run it with --check. The prose
that explains each benchmark's method lives in benchmarks/readme/, one module per benchmark,
beside the code that builds its tables. A field that a result file does not hold (older files
have no ISA flags) reads "not recorded".

Only the standard library is used, so that the check runs in a fraction of a second.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path

# benchmarks/ is a folder of scripts, not a package: its package readme/ is found on sys.path,
# which holds this folder when the script runs; appended (not prepended) when it is imported
# by path, so that the benchmark scripts' names never shadow another module.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))

from readme.page import README, RESULTS, load_results, render  # noqa: E402

__all__ = ["README", "RESULTS", "load_results", "main", "render"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of *.json")
    parser.add_argument("--out", type=Path, default=README, help="the page to write or check")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the page differs from what the result files give",
    )
    args = parser.parse_args(argv)
    page = render(args.results)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current == page:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            page.splitlines(keepends=True),
            fromfile=f"{args.out} (on disk)",
            tofile=f"{args.out} (generated)",
            n=1,
        )
        sys.stderr.writelines(list(diff)[:60])
        print(f"{args.out} is out of date: run python benchmarks/make_readme.py", file=sys.stderr)
        return 1
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
