"""Studies: the claims of the papers qkv implements, turned into runs anyone can repeat.

Each study trains or measures something small, seeded, on data shipped with qkv, and writes a
`StudyResult` (JSON + Markdown + PNG; `qkv.studies.record`). `qkv study NAME` runs one at its
default size (minutes on 2 CPU cores); the "tiny" size runs in seconds and is what the tests
run end to end. A study module defines:

    TITLE, CLAIM            what is tested, citing the paper
    SIZES                   {"tiny": settings, "default": settings}
    run(settings, *, seed)  -> StudyResult (its table, findings and figure series)
    figure(result)          -> a matplotlib Figure drawn from the result alone
    verdicts(rows)          -> [Verdict]: each part of CLAIM judged from the table rows alone
    UNJUDGED (optional)     the parts of CLAIM left out of the verdicts, each with its reason

`run_study` judges each result (`qkv.studies.record.judge`); `rejudge` judges the committed
results again from their JSON, without running anything.

Studies (`STUDIES`):

- activations: GELU and SwiGLU FFNs at equal parameters (SwiGLU 2/3 as wide): validation loss
  over paired seeds (Shazeer 2020); ReLU is no FFN kind of qkv's GPT.
- before-transformer: GRU encoder-decoders with a fixed context vector, additive and dot/general
  attention, and the Transformer on German -> English numbers: exact match by source length,
  training time, alignment maps (Cho et al. 2014; Bahdanau et al. 2015; Luong et al. 2015).
- cfg-digits: a text-conditioned diffusion Transformer on the 8x8 digits sampled at classifier-free
  guidance scales 0, 1, 3 and 7: prompt accuracy as read by a ViT against the samples' variety,
  and the digit word's cross-attention through the sampling steps (Ho et al. 2020; Ho & Salimans
  2022; Peebles & Xie 2023).
- circuits: sink, previous-token, duplicate-token and induction heads of the real SmolLM2 on
  repeated random tokens, the repeat's loss with the induction heads ablated, and attention
  against gradient attribution per layer (Olsson et al. 2022; Elhage et al. 2021; Jain &
  Wallace 2019).
- conditioning: a diffusion Transformer on the 8x8 digits with its timestep by adaLN-Zero, added to
  the tokens (prompt by cross-attention) or as in-context tokens: validation loss and prompt
  accuracy as read by a ViT, over paired seeds (Peebles & Xie 2023).
- exposure-bias: a GRU encoder-decoder trained with teacher forcing against scheduled sampling
  on German -> English numbers: free-running token error by target position, after a correct
  prefix and overall, exact match, and the teacher-forced loss (Bengio et al. 2015).
- extrapolation: perplexity past the training length for each position encoding (none,
  learned, sinusoidal, RoPE, ALiBi, T5's bias) and RoPE scalings at inference (Press et al.
  2022; Chen et al. 2023; Peng et al. 2023).
- ffn-width: validation loss of small GPTs with FFNs 1x, 2x, 4x and 8x d_model wide at a fixed
  depth and width, against their parameters and FLOPs per token (Vaswani et al. 2017; Kaplan
  et al. 2020).
- flash-io: the HBM traffic of standard attention, FlashAttention's Algorithm 1 and qkv's tiled
  loop, modelled exactly and counted tile by tile, against the block size (Dao et al. 2022,
  Theorem 2; Dao 2023).
- head-symmetry: heads initialised identically stay identical in training, and DropHead, as a
  `qkv.inspect` hook on the head outputs, separates them (Goodfellow et al. 2016; Zhou et al.
  2020).
- heads: validation loss against KV-cache bytes for MHA, GQA and MQA at equal parameters, against
  the number of heads at a fixed width, and with shared Q/K/V projections (Shazeer 2019; Ainslie
  et al. 2023; Vaswani et al. 2017, Table 3 (A); Michel et al. 2019).
- layer-sharing: one block applied N times (ALBERT's cross-layer sharing) against N blocks and
  against one block of the same parameters, in a GPT and in the translate task's
  encoder-decoder: validation loss over paired seeds (Lan et al. 2020; Dehghani et al. 2019).
- norms: what padding does to BatchNorm's statistics, against LayerNorm and RMSNorm; training
  with and without residuals at 2/6/12 layers; post-norm vs pre-norm with and without warm-up
  (Ioffe & Szegedy 2015; Ba et al. 2016; Zhang & Sennrich 2019; He et al. 2016; Xiong et al.
  2020).
- own-predictions: a GRU encoder-decoder reading its own predictions from the first training
  step against teacher forcing, over paired seeds (Bengio et al. 2015, Table 1).
- sinks: attention mass on the first tokens, per layer and head, of a trained model, of
  MiniLM and of the real SmolLM2; window-only vs sinks + window caches past the training
  length or a window (Xiao et al. 2024).
- softmax: saturation of the whole softmax Jacobian with and without the 1/sqrt(d_k) scale
  (Vaswani et al. 2017, s3.2.1); float16 overflow of softmax as written vs max-subtracted on
  MiniLM's real scores (Goodfellow et al. 2016, s4.1).
- unet: a U-Net denoiser (convolutions, self- and cross-attention at two resolutions) against
  the diffusion Transformer on the 8x8 digits: validation loss, prompt accuracy as read by a ViT,
  parameters and training time, over paired seeds (Ho et al. 2020; Rombach et al. 2022; Peebles
  & Xie 2023).
- numpy-lab: attention and multi-head attention in plain NumPy, forward and hand-written
  backward, against PyTorch and autograd (Vaswani et al. 2017, s3.2).
- vit-digits: a Vision Transformer on scikit-learn's 8x8 digits, held-out accuracy per pooling
  ([class], mean, latent queries) and position, and attention rollout maps (Dosovitskiy et al.
  2021; Jaegle et al. 2021; Abnar & Zuidema 2020).
- video-attention: joint against factorised (space, then time) attention on videos of moving
  digits, predicting the digit and its direction: accuracy, training time, attention FLOPs per
  clip and against the number of frames (Bertasius et al. 2021; Arnab et al. 2021).
"""

from __future__ import annotations

import html
import importlib
import logging
import math
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from qkv.analysis.pages.report_html import image, table
from qkv.studies.record import (
    StudyResult,
    command_line,
    judge,
    machine,
    markdown_cell,
    read_result,
    write_result,
)
from qkv.validation import check_choice, check_seed

__all__ = [
    "SIZES",
    "STUDIES",
    "StudyResult",
    "read_result",
    "rejudge",
    "report_section",
    "run_study",
    "study_module",
    "write_index",
]

STUDIES = {  # name -> module under qkv.studies
    "activations": "activations",
    "before-transformer": "before_transformer",
    "cfg-digits": "cfg_digits",
    "circuits": "circuits",
    "conditioning": "conditioning",
    "exposure-bias": "exposure_bias",
    "extrapolation": "extrapolation",
    "ffn-width": "ffn_width",
    "flash-io": "flash_io",
    "head-symmetry": "head_symmetry",
    "heads": "heads",
    "layer-sharing": "layer_sharing",
    "norms": "norms",
    "own-predictions": "own_predictions",
    "sinks": "sinks",
    "softmax": "softmax",
    "unet": "unet",
    "numpy-lab": "numpy_lab",
    "vit-digits": "vit_digits",
    "video-attention": "video_attention",
}
SIZES = ("tiny", "default")
DEFAULT_OUT = "studies"  # the folder of the committed results, at the repository's root

logger = logging.getLogger(__name__)


def study_module(name: str) -> ModuleType:
    """The module of the study called `name` (ValueError naming the choices otherwise)."""
    if name not in STUDIES:
        raise ValueError(f"name: expected one of {sorted(STUDIES)}, got {name!r}")
    return importlib.import_module(f"qkv.studies.{STUDIES[name]}")


def run_study(
    name: str,
    *,
    size: str = "default",
    seed: int = 0,
    out: str | Path | None = DEFAULT_OUT,
    **overrides: Any,
) -> StudyResult:
    """Run one study and, unless `out` is None, write NAME.json/.md/.png and the index there.

    size: "tiny" (seconds; the tests) or "default" (minutes on 2 CPU cores; the committed
    figures). overrides: settings replaced for this run (e.g. train_steps=50), recorded in the
    result with the rest.
    """
    module = study_module(name)
    check_choice("size", size, SIZES)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
    check_seed("seed", seed)
    settings = dict(module.SIZES[size])
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
        raise ValueError(f"overrides: {unknown} are not settings of {name}; expected some of "
                         f"{sorted(settings)}")  # fmt: skip
    for key, value in overrides.items():
        check_setting(key, value, [sizes[key] for sizes in module.SIZES.values()])
    settings.update(overrides)
    started = time.perf_counter()
    logger.info("study %s (size %s, seed %d)", name, size, seed)
    result = module.run(settings, seed=seed)
    result.seconds = time.perf_counter() - started
    result.settings, result.size, result.seed = settings, size, seed
    result.command, result.machine = command_line(), machine()
    _judge(module, result)
    if out is not None:
        result.files = write_result(result, out, _figure(module, result))
        write_index(out)
    return result


# An int override (a count, a size) may reach this multiple of the largest preset value of its
# setting, no more: a study sized past that would run for days or not fit in memory.
MAX_SCALE = 100


def check_setting(name: str, value: Any, presets: list[Any]) -> None:
    """An override of setting `name` must look like its preset values (one per size): the same
    type (an int for an int, a number for a float, a list of such for a list), finite, >= 0;
    an int (a count, a size, steps) >= 1 where every preset is (warm-ups may be 0) and at most
    MAX_SCALE times the largest preset. ValueError or TypeError naming it otherwise."""
    if isinstance(presets[0], list):
        if not isinstance(value, list) or not value:
            raise TypeError(f"{name}: expected a non-empty list like {presets[0]}, got {value!r}")
        elements = [item for preset in presets for item in preset]
        for item in value:
            check_setting(name, item, elements)
        return
    if isinstance(presets[0], bool) or not isinstance(presets[0], int | float):
        if type(value) is not type(presets[0]):
            raise TypeError(f"{name}: expected a {type(presets[0]).__name__} like {presets[0]!r}, "
                            f"got {value!r}")  # fmt: skip
        return
    whole = all(isinstance(preset, int) for preset in presets)
    kind = int if whole else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or value != value:
        raise TypeError(f"{name}: expected {'an int' if whole else 'a number'} like "
                        f"{presets[0]}, got {value!r}")  # fmt: skip
    if not whole:  # a rate, a scale: any finite number >= 0
        if not 0 <= value < math.inf:
            raise ValueError(f"{name}: expected a finite number >= 0, got {value}")
        return
    least = 1 if min(presets) >= 1 and "warmup" not in name else 0
    most = MAX_SCALE * max(max(presets), 1)
    if not least <= value <= most:
        raise ValueError(
            f"{name}: expected an int in [{least}, {most}] ({MAX_SCALE}x the largest preset, "
            f"{max(presets)}), got {value}"
        )


def rejudge(out: str | Path = DEFAULT_OUT) -> list[Path]:
    """Judge every result in `out` again from its JSON (its study's `verdicts` on its committed
    rows) and rewrite its JSON and page, the PNG kept, and the index; nothing is run."""
    written = []
    for path in sorted(Path(out).glob("*.json")):
        result = read_result(path)
        _judge(study_module(result.name), result)
        written += write_result(result, path.parent, keep_figure=True).values()
    return [*written, write_index(out)]


def _judge(module: ModuleType, result: StudyResult) -> None:
    """The study's verdicts on the result's rows (none where the module defines no rule)."""
    if hasattr(module, "verdicts"):
        judge(result, module.verdicts(result.rows), getattr(module, "UNJUDGED", []))


def write_index(out: str | Path) -> Path:
    """out/README.md: every study result in `out`, its claim, verdict and findings, linked."""
    out = Path(out)
    lines = [
        "# Studies",
        "",
        "Claims of the papers qkv implements, measured. Each page is generated from its JSON "
        "by `qkv study NAME`; the JSON records the command, the seed and the machine.",
        "",
    ]
    for path in sorted(out.glob("*.json")):
        result = read_result(path)
        lines += [f"## [{result.title}]({result.name}.md)", "", result.claim, ""]
        if result.verdicts:
            parts = "; ".join(f"{v.claim}: {v.verdict}" for v in result.verdicts)
            lines += [f"Verdict: **{result.verdict}** ({parts}).", ""]
        lines += [f"- {finding}" for finding in result.findings]
        lines += ["", f"`{result.command}`, {result.seconds:.0f} s.", ""]
    index = out / "README.md"
    index.write_text("\n".join(lines), encoding="utf-8")
    return index


def _figure(module: ModuleType, result: StudyResult):
    """The study's figure, or None where matplotlib is missing (the JSON and table stay)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        logger.warning("matplotlib is not installed: %s.png is not drawn", result.name)
        return None
    return module.figure(result)


def report_section(out: str | Path) -> str | None:
    """The HTML body of `qkv report`'s studies section: each result in `out` (its claim,
    table, findings and figure), or None when `out` holds none."""
    paths = sorted(Path(out).glob("*.json")) if Path(out).is_dir() else []
    if not paths:
        return None
    parts = []
    for path in paths:
        result = read_result(path)
        header = list(result.columns)
        rows = [[markdown_cell(row.get(column)) for column in header] for row in result.rows]
        parts += [f"<h3>{html.escape(result.title)}</h3>", f"<p>{html.escape(result.claim)}</p>"]
        parts += [f"<p>{html.escape(f'{v.claim}: {v.verdict}. {v.rule} {v.evidence}.')}</p>"
                  for v in result.verdicts]  # fmt: skip
        parts.append(table(rows, header=header))
        parts += [f"<p>{html.escape(finding)}</p>" for finding in result.findings]
        png = path.with_suffix(".png")
        if png.is_file():
            parts.append(image(png.read_bytes(), figure_id=f"study-{result.name}",
                               caption=result.title))  # fmt: skip
        parts.append(f'<p class="note">{html.escape(result.command)} (seed {result.seed}, '
                     f"{result.seconds:.0f} s)</p>")  # fmt: skip
    return "\n".join(parts)
