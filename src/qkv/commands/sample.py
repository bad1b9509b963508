"""`qkv sample PROMPT`: images of a prompt from a `qkv train diffusion` model, as a PNG grid.

DDPM ancestral sampling over all T steps by default (Ho et al. 2020, Algorithm 2), or DDIM
with fewer steps (`--sampler ddim --steps 50`; Song et al. 2021), guided by classifier-free
guidance at `--guidance` (Ho & Salimans 2022: 0 ignores the prompt, 1 is the conditional
model, larger values follow the prompt harder at the cost of variety).
"""

from __future__ import annotations

import argparse
import math
import sys

from qkv.commands._device import check_device
from qkv.commands._text_input import check_arguments


def _run(args: argparse.Namespace) -> int:
    import torch

    from qkv.training.tasks.diffusion import load_sampler, sample_digits

    try:
        (prompt,) = check_arguments("PROMPT", [args.prompt])
        _check_options(args)
        import matplotlib  # noqa: F401 - the grid needs it: known before the sampling

        torch.set_num_threads(args.threads)
        check_device(args.device)
        model, tokenizer = load_sampler(args.model)
        _check_grid_fits(args.num, args.columns or min(args.num, 8), model.config.image_size)
        model = model.to(args.device)
        images = sample_digits(
            model, tokenizer, [prompt] * args.num, guidance=args.guidance, seed=args.seed,
            sampler=args.sampler, steps=args.steps,
        )  # fmt: skip
        if not torch.isfinite(images).all():
            raise ValueError(
                f"--guidance {args.guidance:g}: the samples came out NaN or infinite; expected "
                f"a smaller guidance scale"
            )
        path = _write(images, args, prompt)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"qkv sample: error: {error}", file=sys.stderr)
        return 1
    steps = model.config.num_timesteps if args.sampler == "ddpm" else args.steps
    print(f"wrote {path}: {args.num} samples of {prompt!r} (guidance {args.guidance:g}, "
          f"{args.sampler}, {steps} steps, seed {args.seed})")  # fmt: skip
    return 0


# The grid's canvas at save_figure's 150 dpi: 0.06 inch per image pixel (sample_grid), 4 bytes
# per canvas pixel; a grid whose canvas would take more is refused before any sampling.
GRID_CANVAS_LIMIT_BYTES = 2**30


def _check_options(args: argparse.Namespace) -> None:
    from qkv.validation import check_int, check_seed

    check_int("--num", args.num, minimum=1)
    check_seed("--seed", args.seed)
    check_int("--threads", args.threads, minimum=1)
    check_int("--steps", args.steps, minimum=1)
    if args.columns is not None:
        check_int("--columns", args.columns, minimum=1, maximum=args.num)
    if not math.isfinite(args.guidance) or args.guidance < 0:
        raise ValueError(f"--guidance: expected a finite number >= 0, got {args.guidance}")
    if not args.out.lower().endswith((".png", ".svg")):
        raise ValueError(f"--out: expected a .png or .svg file name, got {args.out!r}")


def _check_grid_fits(num: int, columns: int, image_size: int) -> None:
    """Refuse a grid whose canvas would take more than GRID_CANVAS_LIMIT_BYTES."""
    rows = -(-num // columns)
    inches = [max(2.0, (count * (image_size + 1)) * 0.06 + 0.5) for count in (rows, columns)]
    canvas = int(inches[0] * 150) * int(inches[1] * 150) * 4
    if canvas > GRID_CANVAS_LIMIT_BYTES:
        raise ValueError(
            f"--num {num} (--columns {columns}): the grid's image would take "
            f"~{canvas / 2**30:,.1f} GiB, more than {GRID_CANVAS_LIMIT_BYTES / 2**30:g} GiB; "
            f"expected fewer images, or more columns"
        )


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
