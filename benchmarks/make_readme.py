"""Writes benchmarks/README.md from the result files in benchmarks/results/*.json.

    python benchmarks/make_readme.py            # rewrite benchmarks/README.md
    python benchmarks/make_readme.py --check    # exit 1 if README.md is not what the JSON gives

Every figure of the page comes from a JSON file written by a benchmark script (the ratios and
ranges are computed from the values in those files), so the page cannot drift from the
measurements: after a benchmark run, run this script; the tests run it with --check. The text
and the tables' columns are in readme/templates/, one Markdown template per section (page.md:
the introduction, the headlines and the order of the sections); readme/sections.py,
readme/decoding.py and readme/real_model.py compute each section's figures and rows (for most,
the fields of its template: a table's columns name the keys of the rows or of the file), and
readme/template.py fills the templates. Only the standard library is used, so that the check
takes a fraction of a second.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

# benchmarks/ is a folder of scripts, not a package: its package readme/ is found on sys.path,
# which holds this folder when the script runs; appended (not prepended) when it is imported
# by path, so that the benchmark scripts' names never shadow another module.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))

from readme import decoding, real_model, sections  # noqa: E402
from readme.template import fill, get, is_number  # noqa: E402
from readme.values import dtype_name, dtype_rank, machine_table, num, span  # noqa: E402

RESULTS = HERE / "results"
README = HERE / "README.md"
# The sections of one result file each: the function gives the fields of part "section" of
# templates/STEM.md (or of the part named here) but its machine table; the sections of several
# files (patterns, flash, gpu, models) render themselves.
SINGLE = {
    "attention": sections.attention, "sparse": sections.sparse, "linear": sections.linear,
    "long_documents": sections.long_documents, "context_parallel": sections.context_parallel,
    "decode": decoding.decode, "decode_batch": decoding.decode_batch,
    "decode_batch_padded": decoding.decode_batch,
    "decode_breakdown": decoding.decode_breakdown, "kv_heads": decoding.kv_heads,
    "inspect_overhead": decoding.inspect_overhead,
    "parity_llama_cpp": real_model.parity,
    "parity_llama_cpp_q8_0": real_model.parity, "load_gguf": real_model.load,
    "decode_smollm2": real_model.decode, "perplexity_smollm2": real_model.perplexity,
}  # fmt: skip
PARTS = {  # (template, part) where a file's section is not part "section" of templates/STEM.md
    "parity_llama_cpp": ("real_model", "parity"), "parity_llama_cpp_q8_0": ("real_model", "parity"),
    "load_gguf": ("real_model", "load"), "decode_smollm2": ("real_model", "decode"),
    "perplexity_smollm2": ("real_model", "perplexity"),
    "decode_batch_padded": ("decode_batch", "padded"),
}  # fmt: skip
# Any other result file is listed at the end; smoke runs (*_quick.json) are left out.
KNOWN = {
    *SINGLE, *sections.PATTERN_FILES, *sections.FLASH_FILES, "flash_gpu", *decoding.MODELS_FILES,
}  # fmt: skip


def load_results(results: Path) -> dict[str, dict]:
    """{file stem: parsed JSON} for every results/*.json but smoke runs, sorted by name."""
    found = {}
    for path in sorted(results.glob("*.json")):
        if not path.stem.endswith("_quick"):
            found[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    return found


def render(results_dir: Path = RESULTS) -> str:
    """The whole README.md for the result files in `results_dir` (templates/page.md)."""
    results = load_results(Path(results_dir))
    single = {stem: section(stem, results[stem]) if stem in results else "" for stem in SINGLE}
    others = [(stem, data) for stem, data in results.items() if stem not in KNOWN]
    page = fill(
        "page", "page", **single, headlines=headlines(results),
        patterns=sections.patterns(results), flash=sections.flash(results),
        gpu=sections.gpu(results.get("flash_gpu")), models=decoding.models(results),
        others=fill("page", "others", machines=machine_table(others)) if others else "",
    )  # fmt: skip
    return page + "\n"


def section(stem: str, data: dict) -> str:
    """The section of one result file, its machine table last or where its template puts it."""
    name, part = PARTS.get(stem, (stem, "section"))
    return fill(name, part, machine=machine_table([(stem, data)]), **SINGLE[stem](data))


def headlines(results: dict[str, dict]) -> str:
    """One figure from each benchmark."""
    items = []
    if attention := sections.qkv_over_sdpa(_rows(results, "attention")):
        items.append(fill("page", "attention", **attention))
    flash = sections.merged_flash_rows(results)[0]
    for dtype in sorted({r["dtype"] for r in flash}, key=dtype_rank):
        if window := sections.window_speedup(flash, dtype):
            items.append(fill("page", "window", **window))
    models = decoding.default_ratios(results)
    if models:
        avx2 = fill("page", "avx2") if "models_avx2" in results else ""
        items.append(fill(
            "page", "models", span=span(models, ".2f", "x"), count=len(models), avx2=avx2,
        ))  # fmt: skip
    for r in _rows(results, "decode"):
        aot = get(r, "tokens_per_s", "qkv_aot") is not None  # the fastest path, if timed
        speed = get(r, "tokens_per_s", "qkv_aot" if aot else "qkv_compiled")
        hf = get(r, "tokens_per_s", "transformers")
        llama_cpp = get(r, "aot_peer_paired_ratios" if aot else "peer_paired_ratios", "llama_cpp")
        items.append(fill(
            "page", "decode", dtype=dtype_name(r["dtype"]), speed=num(speed, ".1f"),
            path='qkv compile="aot"' if aot else "compiled qkv",
            ratio=num(speed / hf if speed and hf else None, ".2f"), llama_cpp=_llama_cpp(llama_cpp),
        ))  # fmt: skip
    for r in _rows(results, "decode_batch"):
        speed = get(r, "tokens_per_s", r.get("qkv_fastest", "qkv_compiled"))
        items.append(fill(
            "page", "decode_batch", batch=r["batch"], dtype=dtype_name(r["dtype"]),
            speed=num(speed, ".1f"), ratio=num(get(r, "paired_ratios", "transformers"), ".2f"),
            llama_cpp=_llama_cpp(get(r, "paired_ratios", "llama_cpp")),
        ))  # fmt: skip
    return "\n".join(items) or fill("page", "none")


def _rows(results: dict[str, dict], stem: str) -> list[dict]:
    """The rows of results/STEM.json, in dtype order."""
    rows = get(results, stem, "rows", default=[]) or []
    return sorted(rows, key=lambda r: dtype_rank(r["dtype"]))


def _llama_cpp(ratio: object) -> str:
    """', 0.89x llama.cpp (paired)', or nothing where llama.cpp was not timed."""
    return fill("page", "llama_cpp", ratio=ratio) if is_number(ratio) else ""


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
