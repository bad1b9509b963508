"""The tests the Makefile names by id exist: `make test-masked` runs some of them on CPUs with
more than AVX2 only, where a renamed test would fail a run that this machine never makes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_makefile_names_exists():
    named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", (ROOT / "Makefile").read_text())
    assert named, "the Makefile names no test file"
    for path, function in named:
        assert (ROOT / path).is_file(), f"Makefile names {path}, which does not exist"
        if function:
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {function}\(", source, re.M), f"{path}::{function} is gone"
