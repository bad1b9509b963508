"""A new Python process that decodes through a compile store: what "compiled once per machine"
is checked by, for the libraries of the step compiled ahead of time."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def decodes_from_the_store(directory: Path, *, refused: str, mode: str, new_tokens: int) -> None:
    """Assert that a new process, whose `qkv.acceleration.<refused>` ("module.function", the
    compiler) raises, decodes a tiny Llama of other weights with `decoding_steps(model, mode)`
    through the store at
    `directory`, and gets the eager tokens."""
    module, function = refused.split(".")
    script = textwrap.dedent(f"""
        import torch
        from qkv.acceleration import decoding_steps, {module}
        from qkv.generation import generate
        from tests.generation.reference_models import qkv_model, redraw

        def refuse(*args):
            raise AssertionError("compiled again")

        {module}.{function} = refuse
        model = redraw(qkv_model("tiny-llama"), seed=3)
        prompt = torch.arange(3, 9).unsqueeze(0)
        expected = generate(model, prompt, max_new_tokens={new_tokens})
        steps = decoding_steps(model, {mode!r})
        got = generate(model, prompt, max_new_tokens={new_tokens}, steps=steps)
        assert torch.equal(got, expected), (got, expected)
        print("loaded")
    """)
    environment = {**os.environ, "QKV_COMPILE_CACHE": str(directory)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
        env=environment,
    )  # fmt: skip
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
