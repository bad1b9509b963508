"""The embedded training tasks, each a `qkv.training.Task`: translate, bert, gpt, vit, diffusion.

`TASKS` maps a name to (task class, options dataclass); `qkv train NAME` builds its flags from
the options' fields.
"""

from qkv.training.tasks.bert import BertOptions, BertTask
from qkv.training.tasks.diffusion import DiffusionOptions, DiffusionTask
from qkv.training.tasks.gpt import GPTOptions, GPTTask
from qkv.training.tasks.translate import TranslateOptions, TranslateTask
from qkv.training.tasks.vit import VitOptions, VitTask

__all__ = [
    "TASKS",
    "BertOptions",
    "BertTask",
    "DiffusionOptions",
    "DiffusionTask",
    "GPTOptions",
    "GPTTask",
    "TranslateOptions",
    "TranslateTask",
    "VitOptions",
    "VitTask",
]

TASKS: dict[str, tuple[type, type]] = {
    "translate": (TranslateTask, TranslateOptions),
    "bert": (BertTask, BertOptions),
    "gpt": (GPTTask, GPTOptions),
    "vit": (VitTask, VitOptions),
    "diffusion": (DiffusionTask, DiffusionOptions),
}
