"""The memory of one training step, estimated from formulas before anything is allocated.

A batch that the task's examples can fill may still be too large for the memory: `qkv train gpt
--batch-size 100000` on a corpus of that many blocks would grow until the system kills the
process. `check_step_fits(task, config, ...)` estimates what one step takes and refuses it,
naming batch_size and accumulation_steps, when the estimate is more than `REFUSE_FACTOR` times
the memory there is: the estimate leaves things out (temporaries of the backward pass, the
allocator's slack), so it stays below the real peak, and a step it refuses cannot run.

One step holds the weights, their gradients and AdamW's two moments (16 bytes a parameter in
fp32; over the processes with fsdp), and the activations of one micro-batch: b examples of s
tokens, b = batch_size / processes / accumulation_steps rounded up, which the backward pass
reads. Per Transformer block of width h, a heads and FFN width f, Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4.1, table 2) count

    s b h (34 + 5 a s / h)  bytes, with 16-bit activations, 1-byte dropout masks and f = 4h:

attention 11 s b h + 5 a s^2 b (its input, Q, K, V, the output projection's input, the
attention scores after softmax and after dropout, and two dropout masks), the FFN 19 s b h
(input, GeLU input and output of width 4h, a mask), two LayerNorm inputs 4 s b h.
`transformer_activation_bytes` writes it for e bytes per value (4 in fp32, 2 under bf16
autocast), any f, gated FFNs (SwiGLU keeps two f-wide inputs and their product: 4 e s b f),
without the masks when there is no dropout, and without the scores when the attention kernel
does not store them. The check leaves them out: fused kernels (FlashAttention, PyTorch's
memory-efficient and CPU flash kernels) keep O(s) values per row, and where a kernel does store
them (PyTorch's CPU attention with dropout) the real peak is only further above the estimate,
the safe side for a refusal. A language model adds its logits: s b V values, and their
log-softmax in fp32.

The tasks whose example length is known before a batch is drawn are checked: gpt (blocks of
block_size tokens, a share of them per process with context parallelism) and vit (the patches
of an image); the others (padded sentence pairs of translate and bert, the diffusion denoiser's
own blocks) are not.
"""

from __future__ import annotations

import math

import torch

from qkv.models import GPTConfig, ViTConfig
from qkv.models.sizes import config_of, memory_bytes, parameter_count
from qkv.training.config import TrainingConfig
from qkv.training.distributed import Distributed
from qkv.training.tasks.gpt import GPTTask

__all__ = [
    "REFUSE_FACTOR",
    "StepEstimate",
    "check_step_fits",
    "estimate_step",
    "transformer_activation_bytes",
]

GIB = 2**30
# A step is refused when the estimate is more than this many times the memory.
REFUSE_FACTOR = 2
# Per parameter in fp32: the weight, its gradient, AdamW's exp_avg and exp_avg_sq.
STATE_BYTES_PER_PARAMETER = 16


def transformer_activation_bytes(
    *,
    tokens: int,
    batch: int,
    width: int,
    heads: int,
    layers: int,
    ffn_dim: int | None = None,
    bytes_per_value: int = 2,
    dropout: bool = True,
    scores: bool = True,
    gated: bool = False,
) -> int:
    """Bytes of the activations `layers` Transformer blocks keep for the backward pass, for a
    micro-batch of `batch` sequences of `tokens` tokens (Korthikanti et al. 2022, table 2:
    s b h (34 + 5 a s / h) per block with the defaults and ffn_dim = 4 * width; see the module
    docstring). scores: whether the attention kernel stores the (a, s, s) scores."""
    s, b, h, a = tokens, batch, width, heads
    f = 4 * h if ffn_dim is None else ffn_dim
    e, mask = bytes_per_value, 1 if dropout else 0
    linear = s * b * h * (8 * e + 2 * mask) + (4 if gated else 2) * e * s * b * f
    quadratic = a * s * s * b * (e + mask * (1 + e)) if scores else 0
    return layers * (linear + quadratic)


class StepEstimate:
    """What one training step takes: `state` (weights, gradients, AdamW moments) and
    `activations` bytes, for micro-batches of `micro_batch` examples of `tokens` tokens."""

    def __init__(self, *, state: int, activations: int, micro_batch: int, tokens: int) -> None:
        self.state, self.activations = state, activations
        self.micro_batch, self.tokens = micro_batch, tokens

    @property
    def total(self) -> int:
        return self.state + self.activations


def estimate_step(
    task, config: TrainingConfig, context: Distributed, *, fsdp: bool = False
) -> StepEstimate | None:
    """The memory one step of `task` under `config` takes in each process, from the model's
    config (captured before anything is built: `config_of`); None for a task whose example
    length is not known before a batch is drawn, or whose model is not sized here."""
    parallel = task.options.context_parallel if isinstance(task, GPTTask) else 1
    world = getattr(context, "world_size", 1)
    examples = config.batch_size if parallel > 1 else math.ceil(config.batch_size / world)
    micro_batch = math.ceil(examples / config.accumulation_steps)
    model_config = _known_length_config(task)
    if model_config is None:
        return None
    e = 2 if config.bf16 else 4
    if isinstance(model_config, GPTConfig):
        tokens = math.ceil(task.options.block_size / parallel)
        heads, gated = model_config.num_heads, model_config.ffn == "swiglu"
        logits = micro_batch * tokens * model_config.vocab_size * (e + 4)  # + log-softmax
    else:  # ViTConfig
        tokens, heads, gated, logits = model_config.num_tokens, model_config.num_heads, False, 0
    activations = logits + transformer_activation_bytes(
        tokens=tokens, batch=micro_batch, width=model_config.embed_dim, heads=heads,
        layers=model_config.num_layers, ffn_dim=model_config.ffn_dim, bytes_per_value=e,
        dropout=model_config.dropout > 0, scores=False, gated=gated,
    )  # fmt: skip
    state = STATE_BYTES_PER_PARAMETER * parameter_count(model_config)
    if fsdp and world > 1:
        state = math.ceil(state / world)
    return StepEstimate(
        state=state, activations=activations, micro_batch=micro_batch, tokens=tokens
    )


def check_step_fits(
    task,
    config: TrainingConfig,
    context: Distributed,
    *,
    device: torch.device | str = "cpu",
    fsdp: bool = False,
) -> None:
    """Raise ValueError, naming batch_size and accumulation_steps, when one step's estimate
    (`estimate_step`) is more than REFUSE_FACTOR times the memory of `device`."""
    estimate = estimate_step(task, config, context, fsdp=fsdp)
    if estimate is None:
        return
    memory = memory_bytes(torch.device(device))
    if estimate.total <= REFUSE_FACTOR * memory:
        return
    world = getattr(context, "world_size", 1)
    raise ValueError(
        f"batch_size: {config.batch_size} with accumulation_steps={config.accumulation_steps} "
        f"over {world} process(es) gives micro-batches of {estimate.micro_batch} examples of "
        f"{estimate.tokens} tokens; one training step would need ~{estimate.total / GIB:,.1f} "
        f"GiB (~{estimate.activations / GIB:,.1f} GiB of activations, ~"
        f"{estimate.state / GIB:,.1f} GiB of weights, gradients and optimizer state), more "
        f"than {REFUSE_FACTOR} times the {memory / GIB:,.1f} GiB of memory here; expected a "
        f"smaller batch_size or more accumulation_steps"
    )


def _known_length_config(task) -> GPTConfig | ViTConfig | None:
    """The model config of a task whose example length is fixed: gpt's blocks, vit's images."""
    if not isinstance(task, GPTTask) and not isinstance(getattr(task, "config", None), ViTConfig):
        return None
    model_config = config_of(task.build_model)
    return model_config if isinstance(model_config, (GPTConfig, ViTConfig)) else None
