"""Writes benchmarks/README.md from the result files in benchmarks/results/*.json.

    python benchmarks/make_readme.py            # rewrite benchmarks/README.md
    python benchmarks/make_readme.py --check    # exit 1 if README.md is not what the JSON gives

Every figure of the page comes from a JSON file written by a benchmark script, so the page
cannot drift from the measurements: after a benchmark run, run this script; the tests run it
with --check. The text and the tables are Markdown templates in readme/templates/, one per
section (page.md: the introduction, the headlines and the order of the sections), whose fields
name the values of the files (readme/template.py fills them); readme/derived.py adds the few
figures the files do not hold (verdicts against targets, ratios), readme/machine.py the table
of the machine each file ran on. Only the standard library is used, so that the check takes a
fraction of a second.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

# benchmarks/ is a folder of scripts, not a package: its package readme/ is found on sys.path,
# which holds this folder when the script runs; appended (not prepended) when it is imported
# by path, so that the benchmark scripts' names never shadow another module.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))

from readme.derived import derive  # noqa: E402
from readme.machine import machine_table  # noqa: E402
from readme.template import fill  # noqa: E402

RESULTS = HERE / "results"
README = HERE / "README.md"


class Section(NamedTuple):
    """A section of the page: part `part` of templates/TEMPLATE.md over the result files
    `stems` (the first one as `d`, its rows as `r`), with their machine table; `each`: a part
    rendered once per file (`d`, `r`, `machine` its own), given as `files`; `missing`: the part
    shown without any file."""

    template: str
    stems: tuple[str, ...]
    part: str = "section"
    each: str | None = None
    missing: str | None = None


# In the order of the page; the runs held to AVX2 (`*_avx2`) are the same scripts with
# ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (and MKL_ENABLE_INSTRUCTIONS=AVX2).
PATTERN_FILES = (
    "patterns", "patterns_backward", "patterns_long", "patterns_backward_long", "patterns_avx2",
    "patterns_backward_avx2",
)  # fmt: skip
SECTIONS = {
    "attention": Section("attention", ("attention",)),
    "patterns": Section("patterns", PATTERN_FILES, each="file"),
    "flash": Section("flash", ("flash",)),
    "sparse": Section("sparse", ("sparse",)),
    "linear": Section("linear", ("linear",)),
    "long_documents": Section("long_documents", ("long_documents",)),
    "gpu": Section("gpu", ("flash_gpu",), missing="missing"),
    "models": Section("models", ("models",), each="figures"),
    "models_avx2": Section("models", ("models_avx2",), part="avx2", each="figures"),
    "decode": Section("decode", ("decode",)),
    "decode_batch": Section("decode_batch", ("decode_batch",)),
    "decode_batch_padded": Section("decode_batch", ("decode_batch_padded",), part="padded"),
    "decode_breakdown": Section("decode_breakdown", ("decode_breakdown",)),
    "kv_heads": Section("kv_heads", ("kv_heads",)),
    "inspect_overhead": Section("inspect_overhead", ("inspect_overhead",)),
    "context_parallel": Section("context_parallel", ("context_parallel",)),
    "parity_llama_cpp": Section("real_model", ("parity_llama_cpp",), part="parity"),
    "parity_llama_cpp_q8_0": Section("real_model", ("parity_llama_cpp_q8_0",), part="parity"),
    "parity_llama_cpp_q4_0": Section("real_model", ("parity_llama_cpp_q4_0",), part="parity"),
    "quantize_llama_cpp": Section("real_model", ("quantize_llama_cpp",), part="quantize"),
    "load_gguf": Section("real_model", ("load_gguf",), part="load"),
    "decode_smollm2": Section(
        "real_model", ("decode_smollm2", "decode_smollm2_avx2"), part="decode", each="decode_file"
    ),
    "decode_context": Section("real_model", ("decode_context",), part="context"),
    "prompt_chunks": Section("real_model", ("prompt_chunks",), part="chunks"),
    "chat_turns": Section("real_model", ("chat_turns",), part="chat"),
    "perplexity_smollm2": Section("real_model", ("perplexity_smollm2",), part="perplexity"),
}  # fmt: skip
# Any other result file is listed at the end; smoke runs (*_quick.json) are left out.
KNOWN = {stem for section in SECTIONS.values() for stem in section.stems}


def load_results(results: Path) -> dict[str, dict]:
    """{file stem: parsed JSON, its derived figures added} for every results/*.json but smoke
    runs, sorted by name."""
    found = {}
    for path in sorted(results.glob("*.json")):
        if not path.stem.endswith("_quick"):
            found[path.stem] = derive(path.stem, json.loads(path.read_text(encoding="utf-8")))
    return found


def render(results_dir: Path = RESULTS) -> str:
    """The whole README.md for the result files in `results_dir` (templates/page.md)."""
    results = load_results(Path(results_dir))
    sections = {name: section(s, results) for name, s in SECTIONS.items()}
    others = [(stem, data) for stem, data in results.items() if stem not in KNOWN]
    # a file the page lacks is an empty list: the headlines that read it repeat zero times
    headlines = fill("page", "headlines", **{stem: results.get(stem, []) for stem in KNOWN})
    page = fill(
        "page", "page", **sections, headlines=headlines or fill("page", "none"),
        others=fill("page", "others", machines=machine_table(others)) if others else "",
    )  # fmt: skip
    return page + "\n"


def section(s: Section, results: dict[str, dict]) -> str:
    """One section: its files' figures and machine table, or its note for no file."""
    files = [(stem, results[stem]) for stem in s.stems if stem in results]
    if not files:
        return fill(s.template, s.missing) if s.missing else ""
    each = [fill(s.template, s.each, d=x, r=x.get("rows", []), machine=machine_table([(stem, x)]))
            for stem, x in files if s.each]  # fmt: skip
    d = files[0][1]
    return fill(s.template, s.part, d=d, r=d.get("rows", []), files="\n\n".join(each),
                machine=machine_table(files))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of *.json")
    parser.add_argument("--out", type=Path, default=README, help="the page to write or check")
    parser.add_argument(
        "--check", action="store_true",
        help="write nothing; exit 1 if the page differs from what the result files give",
    )  # fmt: skip
    args = parser.parse_args(argv)
    page = render(args.results)
    if not args.check:
        args.out.write_text(page, encoding="utf-8")
        print(f"wrote {args.out}")
        return 0
    current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    if current == page:
        return 0
    diff = difflib.unified_diff(
        current.splitlines(keepends=True), page.splitlines(keepends=True),
        f"{args.out} (on disk)", f"{args.out} (generated)", n=1,
    )  # fmt: skip
    sys.stderr.writelines(list(diff)[:60])
    print(f"{args.out} is out of date: run python benchmarks/make_readme.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
