"""`qkv sample PROMPT`: images of a prompt from a `qkv train diffusion` model, as a PNG grid.

DDPM ancestral sampling over all T steps by default (Ho et al. 2020, Algorithm 2), or DDIM
with fewer steps (`--sampler ddim --steps 50`; Song et al. 2021), guided by classifier-free
guidance at `--guidance` (Ho & Salimans 2022: 0 ignores the prompt, 1 is the conditional
model, larger values follow the prompt harder at the cost of variety).
"""

from __future__ import annotations

import argparse
import sys

from qkv.commands._device import check_device
from qkv.commands._text_input import check_arguments


def _run(args: argparse.Namespace) -> int:
    import torch

    from qkv.training.tasks.diffusion import load_sampler, sample_digits
    from qkv.validation import check_int

    try:
        (prompt,) = check_arguments("PROMPT", [args.prompt])
        check_int("--num", args.num, minimum=1)
        check_int("--seed", args.seed, minimum=0)
        check_int("--threads", args.threads, minimum=1)
        if args.guidance < 0:
            raise ValueError(f"--guidance: expected a number >= 0, got {args.guidance}")
        if not args.out.lower().endswith((".png", ".svg")):
            raise ValueError(f"--out: expected a .png or .svg file name, got {args.out!r}")
        torch.set_num_threads(args.threads)
        check_device(args.device)
        model, tokenizer = load_sampler(args.model)
        model = model.to(args.device)
        images = sample_digits(
            model, tokenizer, [prompt] * args.num, guidance=args.guidance, seed=args.seed,
            sampler=args.sampler, steps=args.steps,
        )  # fmt: skip
        path = _write(images, args, prompt)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv sample: error: {error}", file=sys.stderr)
        return 1
    steps = model.config.num_timesteps if args.sampler == "ddpm" else args.steps
    print(f"wrote {path}: {args.num} samples of {prompt!r} (guidance {args.guidance:g}, "
          f"{args.sampler}, {steps} steps, seed {args.seed})")  # fmt: skip
    return 0


def _write(images, args: argparse.Namespace, prompt: str):
    """The samples as one grid image at args.out (the plots need matplotlib)."""
    from qkv.analysis.plots import save_figure
    from qkv.analysis.plots.diffusion import sample_grid

    columns = args.columns or min(args.num, 8)
    figure = sample_grid(images, columns=columns, title=f"{prompt!r}, guidance {args.guidance:g}")
    return save_figure(figure, args.out)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sample", help="draw images of a prompt with a model from `qkv train diffusion`"
    )
    parser.add_argument("prompt", metavar="PROMPT", help='e.g. "a handwritten three"')
    parser.add_argument(
        "--model", default="runs/diffusion/model", help="model folder (default %(default)s)"
    )
    parser.add_argument("--guidance", type=float, default=3.0,
                        help="classifier-free guidance scale s (default %(default)s)")  # fmt: skip
    parser.add_argument("--num", type=int, default=16, help="images (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise (default 0)")
    parser.add_argument("--out", default="samples.png",
                        help="the grid, .png or .svg (default %(default)s)")  # fmt: skip
    parser.add_argument("--sampler", choices=("ddpm", "ddim"), default="ddpm",
                        help="ddpm: ancestral, every step; ddim: deterministic, --steps steps "
                        "(default %(default)s)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=50,
                        help="DDIM steps (default %(default)s)")  # fmt: skip
    parser.add_argument("--columns", type=int, default=None,
                        help="images per row of the grid (default: up to 8)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda, cuda:N or mps (default %(default)s)"
    )
    parser.set_defaults(run=_run)
