"""The sampling options that `qkv generate` and `qkv chat` share (`qkv.generate`'s fields)."""

from __future__ import annotations

import argparse


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature (0: greedy), --top-k, --top-p and --seed."""
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples"
    )
    parser.add_argument("--top-k", type=int, help="sample from the K most likely tokens")
    parser.add_argument("--top-p", type=float, help="nucleus sampling: smallest set of mass P")
    parser.add_argument("--seed", type=int, help="seed of the sampling generator")
