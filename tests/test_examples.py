"""The example scripts run and show what they claim."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, check=True
    )
    return result.stdout


def test_online_softmax_converges_to_the_exact_logsumexp():
    printed = run_example("online_softmax.py")
    rows = [line.split() for line in printed.splitlines() if re.match(r"\s+\d+\s+\d+-\d+", line)]
    assert len(rows) == 4  # one row per key tile
    running, exact = float(rows[-1][4]), float(rows[-1][5])
    assert running == exact and float(rows[0][4]) < exact  # partial sums climb to the exact one
    errors = [float(x) for x in re.findall(r"\|tiled - exact\| \w+:\s+(\S+)", printed)]
    assert len(errors) == 2 and max(errors) < 1e-12
