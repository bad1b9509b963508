"""The options that `qkv generate` and `qkv chat` share: sampling (`qkv.generate`'s fields), how
a GGUF file's weights are held (`qkv.applications.chat.load_chat_model`'s `weights`) and whether
the decoding steps are compiled (`qkv.acceleration.decoding_steps`' mode)."""

from __future__ import annotations

import argparse
import sys


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature (0: greedy), --top-k, --top-p and --seed."""
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples"
    )
    parser.add_argument("--top-k", type=int, help="sample from the K most likely tokens")
    parser.add_argument("--top-p", type=float, help="nucleus sampling: smallest set of mass P")
    parser.add_argument("--seed", type=int, help="seed of the sampling generator")


KV_DTYPE_CHOICES = ("model", "fp32", "fp16", "bf16")


def add_kv_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--kv-dtype model | fp32 | fp16 | bf16: the KV cache's dtype (`DecodeOptions.kv_dtype`)."""
    parser.add_argument(
        "--kv-dtype", choices=KV_DTYPE_CHOICES, default="model",
        help="the KV cache's dtype: the model's (default), or fp16 / bf16, half an fp32 "
        "model's cache, attention then run in it (llama.cpp's default cache is f16): faster "
        "decoding past a few hundred tokens of context for GQA/MQA models",
    )  # fmt: skip


def kv_dtype(args: argparse.Namespace):
    """The torch dtype --kv-dtype names (None: the model's)."""
    import torch

    return {"model": None, "fp32": torch.float32, "fp16": torch.float16,
            "bf16": torch.bfloat16}[args.kv_dtype]  # fmt: skip


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """--weights auto | quantized | dequantized."""
    parser.add_argument(
        "--weights", choices=("auto", "quantized", "dequantized"), default="auto",
        help="a GGUF file's weights: kept as its Q4_0, Q4_1 or Q8_0 blocks (quantized), or fp32 "
        "(dequantized); auto (the default): quantized where that decodes faster on this CPU "
        "(Q4_0 and Q4_1 files where PyTorch's int4pack kernel runs), said on stderr",
    )  # fmt: skip


COMPILE_MODES = {None: "auto", True: "aot", False: "eager"}  # --compile / --no-compile / neither


def steps_for(model, compile_flag: bool | None, command: str, when_eager=None):
    """`qkv.acceleration.decoding_steps(model, COMPILE_MODES[compile_flag])`. With neither flag,
    where no compiled step is ready (so the steps are eager), a line on stderr says so, and what
    --compile gives; or `when_eager()` runs, and the line it returns is said instead (None:
    nothing was done, the line about --compile is said)."""
    from qkv import acceleration
    from qkv.acceleration.decoding import DecodingSteps, compiled_ready

    mode = COMPILE_MODES[compile_flag]
    steps = acceleration.decoding_steps(model, mode)
    eager = mode == "auto" and isinstance(steps, DecodingSteps) and not compiled_ready(model)
    if eager:
        said = None if when_eager is None else when_eager()
        hint = "--compile builds the compiled step once (tens of seconds; later runs load it)"
        said = said or f"eager decoding steps; {hint}, for faster steps"
        print(f"qkv {command}: {said}", file=sys.stderr)
    return steps


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """--compile / --no-compile: `args.compile` is True, False or None (COMPILE_MODES)."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode with the step compiled ahead of time by AOTInductor (faster steps after "
        "a compilation of tens of seconds, paid once per machine: later runs load it in well "
        "under a second); --no-compile: eagerly. Default: compiled where an earlier run "
        'compiled it, else eager (qkv.acceleration.decoding_steps\' mode="auto")',
    )
