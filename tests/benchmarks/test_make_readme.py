"""benchmarks/README.md is generated from the result files by benchmarks/make_readme.py.

The generator fills the Markdown templates of benchmarks/readme/templates/ with the figures of
the result files. It reads tiny result files written here, and its page must show their figures
and their machine, "not recorded" for what a file lacks, and no section for a file that is
absent; every part of every template must be rendered with all its fields filled, and a table
row must have as many cells as its header. Last, the committed page must be what the committed
result files give.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "make_readme.py"
COMMITTED = ROOT / "benchmarks" / "results"


def load_generator():
    """benchmarks/ is a folder of scripts, not a package: import the script by its path."""
    spec = importlib.util.spec_from_file_location("benchmarks_make_readme", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_readme = load_generator()
template = importlib.import_module("readme.template")  # found through the generator's sys.path

MACHINE = {
    "command": "python benchmarks/attention.py --lengths 512 1024",
    "cpu_model": "Example CPU 7000",
    "isa_flags": ["avx2", "avx512f", "amx_bf16"],
    "torch_cpu_capability": "AVX512",
    "torch_threads": 3,
    "cpu_count": 4,
    "torch": "9.9.0+cpu",
    "python": "3.99.1",
    "device": "cpu",
}


def attention_row(L: int, qkv_ms: float, sdpa_ms: float) -> dict:
    return {
        "L": L,
        "causal": False,
        "dtype": "float32",
        "max_abs_diff_vs_sdpa": {"qkv": 0.0, "naive": 3e-7},
        "ms": {"qkv": qkv_ms, "sdpa": sdpa_ms, "naive": 3 * sdpa_ms},
        "ratio_vs_sdpa": {"qkv": qkv_ms / sdpa_ms, "sdpa": 1.0, "naive": 3.0},
        "paired_ratio_vs_sdpa": {"qkv": 1.0125, "sdpa": 1.0, "naive": 3.0},
        "gflops": {"qkv": 123.45, "sdpa": 124.0, "naive": 41.0},
        "fraction_of_matmul": {"qkv": 0.7261, "sdpa": 0.73, "naive": 0.24},
    }


def flash_row(L: int, tiled_fwd_s: float) -> dict:
    peak = 50 * 2**20
    by = {
        "sdpa": {"fwd_s": 0.1, "fb_s": 0.3, "peak_fb_bytes": peak},
        "tiled": {"fwd_s": tiled_fwd_s, "fb_s": 0.45, "peak_fb_bytes": peak},
    }
    return {"setting": "causal", "L": L, "dtype": "bfloat16", "by": by}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    attention = {
        "mode": "forward",
        "shape": {"B": 1, "H": 12, "D": 64},
        "target_qkv_over_sdpa": 1.05,
        "machine": MACHINE,
        "matmul_gflops": {"float32": 170.0},
        "rows": [attention_row(1024, 20.5, 20.0), attention_row(512, 6.0, 6.0)],
    }
    # a file from a run that recorded no machine at all
    models = {
        "rows": [
            {
                "model": "tiny-bert",
                "batch": 2,
                "length": 8,
                "mode": "train",
                "dtype": "fp32",
                "tokens_per_s": {"qkv": 1234.4, "transformers": 1000.0, "qkv_speed_up": 1300.0},
                "ratio": 1.2344,
                "paired_ratio": 1.2,
                "speed_up_ratio": 1.3,
                "speed_up_paired_ratio": 1.25,
                "fraction_of_matmul": {"qkv": 0.5, "transformers": 0.4},
                "max_abs_diff": 0.0,
            }
        ]
    }
    flash = {"machine": {**MACHINE, "command": "python benchmarks/flash.py"}}
    flash["rows"] = [flash_row(2048, 0.4), flash_row(4096, 0.15)]
    quick = {"machine": MACHINE, "rows": []}  # a smoke run: left out of the page
    files = {
        "attention": attention,
        "models": models,
        "flash": flash,
        "attention_quick": quick,
    }
    for stem, payload in files.items():
        (folder / f"{stem}.json").write_text(json.dumps(payload))
    return folder


def test_the_page_shows_the_figures_and_the_machine_of_the_files(results):
    page = make_readme.render(results)
    # attention: the rows in the file's order, each figure as the file has it
    assert "| 512 | no | fp32 | 6.00 | 6.00 | 18.00 | - | 1.000 (1.012) |" in page
    row = "| 1024 | no | fp32 | 20.50 | 20.00 | 60.00 | - | 1.025 (1.012) | 3.00 | - (-) | 123.5 | "
    row += "73% |"
    assert row in page
    assert "median **1.012**, worst **1.025** over 2 rows (target <= 1.05: met)" in page
    # the machine and the command that produced the file
    assert "| command | `python benchmarks/attention.py --lengths 512 1024` |" in page
    assert "| CPU | Example CPU 7000 |" in page
    assert "| ISA flags | avx2, avx512f, amx_bf16 |" in page
    assert "| PyTorch CPU capability | AVX512 |" in page
    assert "| threads (torch) | 3 (of 4 CPUs) |" in page
    assert "| torch | 9.9.0+cpu |" in page
    # models: a row and its ratio
    row = "| tiny-bert | 2 x 8 | train | fp32 | 1,234 | 1,000 | - | 1,300 | 1.234 (1.200) | "
    assert row + "- (-) | 1.300 (1.250) |" in page
    # a training step's default is `speed_up`'s (qkv.training.train)
    assert "qkv by default: 1.300x transformers' tokens/s over 1 rows" in page
    # the flash rows: the tiled path's time over SDPA's, from the file's seconds
    flash = "| causal | 2048 | bf16 | 100.0 | 400.0 | - | - | 4.00 | - | 1.50 | 50 | 50 | - |"
    assert flash in page
    # no GPU file: said so, not left blank
    assert "There is no `results/flash_gpu.json`" in page
    # the smoke run is left out
    assert "attention_quick" not in page


def test_a_field_the_file_lacks_reads_not_recorded(results):
    page = make_readme.render(results)
    models = page[page.index("|  | `results/models.json` |") :]
    machine = models[: models.index("\n\n")]
    for field in ("command", "CPU", "ISA flags", "PyTorch CPU capability", "threads (torch)"):
        assert f"| {field} | not recorded |" in machine, field
    # an older file: a machine record without ISA flags
    data = json.loads((results / "attention.json").read_text())
    del data["machine"]["isa_flags"], data["machine"]["torch_cpu_capability"]
    (results / "attention.json").write_text(json.dumps(data))
    page = make_readme.render(results)
    assert "| ISA flags | not recorded |" in page
    assert "| CPU | Example CPU 7000 |" in page


def test_check_mode_fails_when_the_page_differs_from_the_files(results, tmp_path, capsys):
    out = tmp_path / "README.md"
    assert make_readme.main(["--results", str(results), "--out", str(out)]) == 0
    assert out.read_text() == make_readme.render(results)  # deterministic
    assert make_readme.main(["--results", str(results), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("20.50", "20.40"))
    assert make_readme.main(["--results", str(results), "--out", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_the_committed_page_is_what_the_committed_result_files_give():
    assert make_readme.main(["--check"]) == 0, "run: python benchmarks/make_readme.py"


def test_the_patterns_section_gives_auto_against_the_best_peer(tmp_path):
    def row(pattern, auto_ms, flex_ms, ratio):
        return {
            "pattern": pattern,
            "L": 4096,
            "dtype": "bfloat16",
            "auto_backend": "flex",
            "ms": {"auto": auto_ms, "tiled": 70.0, "sdpa": 212.0, "flex": flex_ms},
            "best_peer": "flex",
            "paired_auto_vs_best_peer": ratio,
            "paired_tiled_vs_sdpa": 0.33,
        }

    machine = {**MACHINE, "command": "python benchmarks/patterns.py"}
    payload = {"machine": machine, "mode": "forward"}
    payload["rows"] = [row("softcap", 50.0, 49.0, 1.02), row("window", 48.0, 80.0, 0.6)]
    (tmp_path / "patterns.json").write_text(json.dumps(payload))
    page = make_readme.render(tmp_path)
    section = page[page.index("## Attention patterns") :]
    assert "auto at most the best peer's time on 1 of 2 rows; auto/best 0.60-1.02x" in section
    assert (
        "| window | 4096 | bf16 | 48.0 | 70.0 | 212.0 | 80.0 | - | flex | flex | 0.60 | 0.33 |"
        in section
    )
    assert (
        "| softcap | 4096 | bf16 | 50.0 | 70.0 | 212.0 | 49.0 | - | flex | flex | 1.02 | 0.33 |"
        in section
    )
    assert "| command | `python benchmarks/patterns.py` |" in section


def test_the_avx2_models_file_has_its_section_and_the_verdict_reads_the_default_path(results):
    row = {
        "model": "tiny-llama",
        "batch": 2,
        "length": 8,
        "mode": "forward",
        "dtype": "fp32",
        "tokens_per_s": {"qkv": 900.0, "transformers": 1000.0, "qkv_packed": 1100.0},
        "ratio": 0.9,
        "paired_ratio": 0.91,
        "packed_ratio": 1.1,
        "packed_paired_ratio": 1.12,
    }
    payload = {"machine": {**MACHINE, "torch_cpu_capability": "AVX2"}, "rows": [row]}
    (results / "models_avx2.json").write_text(json.dumps(payload))
    page = make_readme.render(results)
    section = page[page.index("### The same, held to AVX2") :]
    assert "|  | `results/models_avx2.json` |" in section
    # the packed path is faster, yet the target is judged on what a user gets by default
    assert "0.900x transformers' tokens/s over 1 rows (target >= 1.0 on every row: not met)" in (
        " ".join(section.split())
    )
    headlines = page[page.index("## Headlines") : page.index("## `qkv.attention`")]
    headlines = " ".join(headlines.split())
    assert "The same held to AVX2: 0.900x over 1 rows." in headlines
    assert "## Other result files" not in page  # the file is one the page knows


def test_the_batched_decoding_file_gives_the_ratio_to_llama_cpp(results):
    row = {
        "dtype": "fp32",
        "batch": 8,
        "prompt": 32,
        "new_tokens": 128,
        "tokens_per_s": {
            "qkv": 800.0,
            "qkv_compiled": 1300.0,
            "transformers": 500.0,
            "torch_compile": 1250.0,
        },
        "qkv_fastest": "qkv_compiled",
        "paired_ratios": {"transformers": 2.6, "llama_cpp": 0.95},
        "compiled_over_torch_compile": 1.04,
        "peers": {"tokens_vs_transformers": {"qkv": {"rows_equal": 8}}, "llama_cpp": {}},
    }
    (results / "decode_batch.json").write_text(json.dumps({"machine": MACHINE, "rows": [row]}))
    padded = {**row, "prompt_lengths": [32, 30, 28, 26], "batch": 4}
    padded_file = {"machine": MACHINE, "rows": [padded]}
    (results / "decode_batch_padded.json").write_text(json.dumps(padded_file))
    page = make_readme.render(results)
    section = page[page.index("### Several sequences at once") : page.index("#### Left-padded")]
    assert "qkv over llama.cpp: 0.95x (target >= 1.0: not met)." in section
    expected = "| fp32 | 8 | 800.0 | 1300.0 | 1250.0 | 500.0 | - | 1.040 | 2.600 | 0.950 | 8, -, -"
    assert expected in section
    headline = "batch 8, fp32: qkv 1300.0 tokens/s, 2.60x transformers; paired ratio to llama.cpp"
    assert headline + ": 0.95." in " ".join(page.split())
    section = page[page.index("#### Left-padded") :]
    assert "(26-32 real tokens of 32)" in " ".join(section.split())
    assert "| fp32 | 4 | 800.0 | 1300.0 | 1250.0 |" in section


def write(folder: Path, files: dict[str, dict]) -> Path:
    folder.mkdir(exist_ok=True)
    for stem, payload in files.items():
        (folder / f"{stem}.json").write_text(json.dumps(payload))
    return folder


def committed() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in COMMITTED.glob("*.json")}


@pytest.fixture
def fill(tmp_path, monkeypatch):
    """fill(text, **values): `text` as part "p" of a template "t" of its own."""

    def render(text: str, **values: object) -> str:
        (tmp_path / "t.md").write_text("<!-- part: p -->\n" + text)
        template.parts.cache_clear()
        return template.fill("t", "p", **values)

    monkeypatch.setattr(template, "TEMPLATES", tmp_path)
    yield render
    template.parts.cache_clear()


def test_a_field_without_a_value_fails_naming_its_template_and_part(fill):
    with pytest.raises(KeyError, match=r"templates/t.md, part p: no value for field 'typo'"):
        fill("{d[x]} and {typo}", d={})


def test_a_table_line_repeats_over_its_list_and_a_missing_figure_prints_a_dash(fill):
    table = "| dtype | ms | causal |\n|---|---|---|\n| {r[dtype]!d} | {r[s]:.1f/ms} | {r[causal]} |"
    rows = [{"dtype": "bfloat16", "s": 0.01234, "causal": True}, {"s": None, "causal": False},
            {"dtype": "float32", "s": "x"}, {"s": float("nan")}]  # fmt: skip
    lines = fill(table, r=rows).splitlines()[2:]
    assert lines == ["| bf16 | 12.3 | yes |", "| - | - | no |", "| fp32 | - | - |", "| - | - | - |"]
    assert fill(table, r=[]).count("\n") == 1  # the header, no row
    # a list further down the path repeats too; `[*]` is the item itself
    assert fill("- {d[v][*]} of {d[n]}", d={"v": ["a", "b"], "n": 2}) == "- a of 2\n- b of 2"
    for empty in ({"v": []}, {}):  # an empty list, or none at all
        assert fill("Before.\n\n- {d[v][*]}\n\nAfter.", d=empty) == "Before.\n\nAfter."
    with pytest.raises(ValueError, match="one list"):
        fill("| {r[a]} | {q[b]} |", r=[{}], q=[{}])


def test_units_conversions_and_prose_refilled_to_100_columns(fill):
    values = {"bytes": 3 * 2**20, "lengths": [32, 18, 27], "one": [5]}
    text = "{d[bytes]:.1f/MiB} MiB, {d[lengths]!l} prompts of {d[lengths]!x} and {d[one]!x} tokens"
    assert fill(text, d=values) == "3.0 MiB, 3 prompts of 18-32 and 5 tokens"
    prose = fill("word " * 40 + "\n\n## A heading" + " long" * 30, d={})
    paragraph, heading = prose.split("\n\n")
    assert max(map(len, paragraph.splitlines())) <= 100 and paragraph.count("\n") == 1
    assert heading == "## A heading " + " ".join(["long"] * 30)  # a heading is never wrapped


def test_every_part_of_every_template_is_rendered_with_all_its_fields(results, tmp_path):
    """The committed files, the tiny files, no file at all and a file of each kind the other
    pages lack (a GPU run, every way decoding's tokens can compare, a skipped model, a file the
    page has no section for) render every part of every template, and leave no field behind."""
    used: set[tuple[str, str]] = set()
    parts = template.parts

    class Noted(dict):
        """The parts of one template, noting each part that `fill` reads."""

        def __getitem__(self, part: str) -> tuple[str, bool]:
            used.add((self.name, part))
            return super().__getitem__(part)

    def recording(name: str) -> Noted:
        found = Noted(parts(name))
        found.name = name
        return found

    gpu_machine = {**MACHINE, "device": "cuda", "device_name": "Example GPU", "cuda": "12.9"}
    by = {"sdpa_flash": {"fwd_tflops": 400.0, "fb_tflops": 300.0, "fwd_of_peak": 0.4},
          "triton": {"fwd_tflops": 420.0, "fb_tflops": 280.0, "fwd_of_peak": 0.42}}  # fmt: skip
    margin = {"margin": 0.0, "tied_at_max": 2}
    tokens = [
        {"equal": True, "packed_equals_qkv": True, "compiled_equals_qkv": True},
        {"equal": True, "compiled_first_divergence": {"transformers": 9}},
        {"first_divergence_step": 5, "packed_equals_qkv": True,
         "at_divergence": {"qkv_logits": margin, "transformers_logits": margin}},
        {"first_divergence_step": 7, "compiled_equals_qkv": True},
        {},
    ]  # fmt: skip
    decode_rows = [{"dtype": f"d{i}", "new_tokens": 8, "tokens": t} for i, t in enumerate(tokens)]
    models = {"rows": [], "skipped": ["llama-50m bf16: out of memory"]}
    others = {
        "flash_gpu": {"machine": gpu_machine, "peak_tflops": 989.0, "matmul_tflops": 700.0,
                      "rows": [{"L": 4096, "D": 128, "causal": True, "by": by}]},
        "decode": {"machine": MACHINE, "rows": decode_rows},
        "models": models,
        "mystery": {"machine": MACHINE},
    }  # fmt: skip
    template.parts = recording
    try:
        pages = [
            make_readme.render(COMMITTED),
            make_readme.render(results),
            make_readme.render(write(tmp_path / "empty", {})),
            make_readme.render(write(tmp_path / "others", others)),
        ]
    finally:
        template.parts = parts
    every = {
        (path.stem, part) for path in template.TEMPLATES.glob("*.md") for part in parts(path.stem)
    }
    assert every - used == set(), "parts no page rendered"
    for page in pages:
        assert not re.search(r"\{\w+(\[[^\]]*\])*(:[^{}]*)?\}", page), "a field left unfilled"
    empty, others_page = pages[2], pages[3]
    assert "No result files." in empty and "There is no `results/flash_gpu.json`" in empty
    assert "## Other result files" in others_page and "`results/mystery.json`" in others_page
    assert "| GPU | Example GPU |" in others_page  # a GPU's rows in its machine table
    assert "| compute capability | not recorded |" in others_page
    assert "| 4096 | 128 | yes | triton | 420 | 280 | 42% | 0.93 |" in others_page
    assert "Skipped: llama-50m bf16: out of memory" in others_page
    assert "| d0 | yes | - of 8 | - | - | - | yes | yes | - |" in others_page
    assert "| d2 | - | - of 8 | 5 | 0 | 0 | yes | - | - |" in others_page
    assert "| d4 | - | - of 8 | - | - | - | - | - | - |" in others_page


def test_a_table_row_has_as_many_cells_as_its_header(results):
    for page in (make_readme.render(COMMITTED), make_readme.render(results)):
        for table in re.findall(r"(?:^\|.*\n)+", page, flags=re.MULTILINE):
            header, separator, *rows = table.splitlines()
            assert separator == "|" + "---|" * (header.count(" | ") + 1), header
            for row in rows:
                assert row.count(" | ") == header.count(" | "), (header, row)


@pytest.mark.parametrize(
    ("stem", "heading"),
    [
        ("attention", "## `qkv.attention` against raw SDPA"),
        ("sparse", "## Sparse patterns"),
        ("linear", "## Linear attention"),
        ("long_documents", "## Long documents"),
        ("models_avx2", "### The same, held to AVX2"),
        ("decode", "## Decoding"),
        ("decode_batch", "### Several sequences at once"),
        ("decode_breakdown", "## Where a decoding step's time goes"),
        ("context_parallel", "## Sequence-parallel training"),
    ],
)
def test_a_missing_result_file_leaves_its_section_out(tmp_path, stem, heading):
    files = committed()
    full = make_readme.render(write(tmp_path / "all", files))
    del files[stem]
    page = make_readme.render(write(tmp_path / "partial", files))
    assert heading in full and heading not in page
    # the other sections stay, and so does the GPU section, which says the file is missing
    assert page.count("\n## ") == full.count("\n## ") - heading.startswith("## ")
    assert "There is no `results/flash_gpu.json`" in page


def test_decoding_without_llama_cpp_prints_a_dash_for_its_figures(tmp_path):
    decode = committed()["decode"]
    for row in decode["rows"]:
        for key in ("peers", "peer_paired_ratios", "aot_peer_paired_ratios"):
            row.pop(key, None)
        row["timings"].pop("llama_cpp", None)
    page = make_readme.render(write(tmp_path, {"decode": decode}))
    assert "## Decoding (`decode.py`)" in page
    headlines = " ".join(page[page.index("## Headlines") : page.index("## Triton")].split())
    fp32 = 'batch 1, fp32: qkv compile="aot" 326.1 tokens/s, 3.61x transformers; paired ratio to'
    assert fp32 + " llama.cpp: -." in headlines
