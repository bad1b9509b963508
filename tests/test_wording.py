"""The project speaks to its users in the present tense, and cites what they can open.

No text in the package, the tests, the benchmarks, the examples or the README speaks of the
history of its own development (work sessions, "the dev VM", "last time") or cites documents
that are not in the repository (internal specification files and their numbering). Papers are
cited instead (Vaswani et al. 2017 s3.2.1), or the idea is said in plain words. A random seed is
still a seed: only the phrasings that cite a document are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["src", "tests", "benchmarks", "examples", "README.md", "Makefile", "pyproject.toml"]
SUFFIXES = {".py", ".md", ".html", ".json", ".toml", ".txt", ".cfg", ".sh", ""}

# (what is refused, why), matched case-insensitively
FORBIDDEN = [
    (r"\bseed\s+0\d\d\b", "a numbered specification document"),
    (r"\bseeds?'(?!\w)|\bseed's\b", "the specification documents"),
    (r"\bseed\s+doc", "the specification documents"),
    (r"\bseed\s+(passage|formula|section|text|figure|plot|listing|code|sanity)", "a document"),
    (r"\bas (in|does|do) the seeds?\b", "the specification documents"),
    (r"\bDESIGN\.md\b|\bshared/", "a file outside the repository"),
    (r"\bDL\d{4}\b|\bQ\d{1,2}\b", "an entry of an outside document"),
    (r"\bdev(elopment)?\s+VM\b|\b\d-core VM\b|\bthe VM\b", "the development machine"),
    (r"(?<!scope=\")\bsessions?\b", "the history of the project's development"),
    (r"\blast time\b|\bdisturbed by\b", "the history of the project's development"),
    (r"(?<!-)\brounds? (of work )?\d+\b|\brounds of work\b", "numbered rounds of development work"),
]


def checked_files() -> list[Path]:
    files: list[Path] = []
    for name in CHECKED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for file in sorted(path.rglob("*")):
            if (
                file.is_file()
                and file.suffix in SUFFIXES
                and "__pycache__" not in file.parts
                and ".egg-info" not in str(file)
                and file != Path(__file__).resolve()
            ):
                files.append(file)
    return files


def offending_lines(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, why in FORBIDDEN:
            match = re.search(pattern, line, flags=re.IGNORECASE)
            if match:
                found.append(f"{number}: {match.group(0)!r} ({why}): {line.strip()[:120]}")
    return found


@pytest.mark.parametrize(
    "text, refused",
    [
        ("Scaled by sqrt(d_k) (seed 002 Q14).", True),
        ("as the seeds' plots show", True),
        ("See shared/DESIGN.md", True),
        ("measured on the 2-core dev VM in session 7", True),
        ("added in round 3 of the work", True),
        ("24 rounds of RoPE rotation", False),
        ("python benchmarks/decode_smollm2.py --rounds 3", False),  # a command's flag
        ('@pytest.fixture(scope="session")', False),
        ("the data order is a pure function of seed and step", False),
        ("generator = torch.Generator().manual_seed(seed)  # seeded", False),
        ("Vaswani et al. 2017 s3.2.1: softmax(QK^T / sqrt(d_k)) V", False),
    ],
)
def test_the_rule_refuses_citations_and_history_but_not_random_seeds(text, refused):
    assert bool(offending_lines(text)) is refused


def test_no_development_history_and_no_outside_documents():
    problems = []
    for file in checked_files():
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file (a plot)
        problems += [f"{file.relative_to(ROOT)}:{line}" for line in offending_lines(text)]
    assert not problems, "\n".join(problems[:50]) + f"\n({len(problems)} in all)"
