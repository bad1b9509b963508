"""What a reader opens to follow the default `qkv.generate` call: every qkv source file whose
code runs during the call, with its length, and the total.

    .venv/bin/python benchmarks/reading_path.py            # a Llama-style GPT, 8 new tokens
    .venv/bin/python benchmarks/reading_path.py --padded   # two prompts, left-padded

The model is built and the packages imported before the trace starts, so only what the call
itself runs is counted (module-level code run by an import inside the call would count too).
A file counts once, whole: a reader opens the file, not the function. Tests, benchmarks and
torch are not counted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import qkv
from qkv.models import GPT, GPTConfig

SOURCE = Path(qkv.__file__).resolve().parent


def files_run_by(call) -> set[Path]:
    """The qkv source files with a frame executed while `call()` runs."""
    seen: set[str] = set()

    def tracer(frame, event, arg):
        seen.add(frame.f_code.co_filename)
        return None  # no line events: the call and its frames are enough

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    paths = {Path(name).resolve() for name in seen if name.endswith(".py")}
    return {path for path in paths if SOURCE in path.parents}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--padded", action="store_true", help="two left-padded prompts")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_dim=128)  # fmt: skip
    model = GPT(config).eval()
    ids = torch.randint(0, 256, (2 if args.padded else 1, 6))
    mask = None
    if args.padded:
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
    files = files_run_by(lambda: qkv.generate(model, ids, attention_mask=mask, max_new_tokens=8))
    total = 0
    for path in sorted(files):
        lines = len(path.read_text().splitlines())
        total += lines
        print(f"{lines:6d}  {path.relative_to(SOURCE.parent)}")
    print(f"{total:6d}  lines in {len(files)} files")


if __name__ == "__main__":
    main()
