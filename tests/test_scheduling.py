"""`make test`'s two workers (tests/scheduling.py), run on a suite of five small modules of its
own: each module's tests run on one worker, the modules naming the SmolLM2 fixtures of
transformers share one, and those come first, then the modules with a slow test."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import json, os, pytest
{mark}
@pytest.mark.parametrize("n", range(4))
def test_records_its_worker(n):  # {mention}
    with open(os.environ["RECORD"], "a") as record:
        record.write(json.dumps([__name__, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_each_module_on_one_worker_smollm2_readers_together_and_first(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from tests.scheduling import pytest_collection_modifyitems, pytest_xdist_make_scheduler\n"
    )
    modules = {  # name: (a slow test?, names the fixture?)
        "test_a": (False, False), "test_b": (False, True), "test_c": (True, False),
        "test_d": (False, False), "test_e": (False, True),
    }  # fmt: skip
    for name, (slow, reads) in modules.items():
        text = MODULE.format(mark="@pytest.mark.slow" if slow else "",
                             mention="smollm2_hf" if reads else "")  # fmt: skip
        (suite / f"{name}.py").write_text(text)
    record = tmp_path / "record.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
         "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(suite)],
        cwd=suite, capture_output=True, text=True, timeout=900,
        env={"PYTHONPATH": str(ROOT), "RECORD": str(record), "PATH": ""},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(rows) == 4 * len(modules)
    workers = {name: {w for n, w in rows if n == name} for name in modules}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert workers["test_b"] == workers["test_e"]
    # each worker's first module (never the order across workers, which their start-up sets):
    # the SmolLM2 readers on one, the slow module on the other
    firsts = {worker: next(n for n, w in rows if w == worker) for _, worker in rows}
    assert len(firsts) == 2 and "test_c" in firsts.values(), firsts
    assert {"test_b", "test_e"} & set(firsts.values()), firsts
