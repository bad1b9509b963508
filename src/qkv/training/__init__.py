"""Training: the loop, its optimizer and schedule, atomic checkpoints, DDP, and the tasks.

`train(task, TrainingConfig(...), out_dir=...)` trains any `Task` (see `qkv.training.tasks`);
`qkv train translate|bert|gpt` is the command-line face of it.
"""

from qkv.training.checkpoint import load_checkpoint, save_checkpoint
from qkv.training.config import TrainingConfig
from qkv.training.loop import DataOrder, LossNotFiniteError, Task, TrainingResult, train
from qkv.training.optim import build_optimizer, parameter_groups
from qkv.training.schedule import build_scheduler, lr_multiplier

__all__ = [
    "DataOrder",
    "Task",
    "TrainingConfig",
    "LossNotFiniteError",
    "TrainingResult",
    "build_optimizer",
    "build_scheduler",
    "load_checkpoint",
    "lr_multiplier",
    "parameter_groups",
    "save_checkpoint",
    "train",
]
