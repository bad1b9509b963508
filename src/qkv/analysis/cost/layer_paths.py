"""Table 1's maximum path lengths (Vaswani et al. 2017, s4), measured on real layers by autograd.

What is measured, for a sequence of n = `length` positions: the fewest stacked layers L after
which output position n - 1 depends on input position 0, that is has a nonzero derivative
with respect to it (a nonzero gradient). Layers are added one at a time, and forward-mode
autograd carries the derivative with respect to input 0 up the stack: one pass finds L, where
a gradient per depth would run L backward passes.

- self-attention: `qkv.attention` with q = k = v = the hidden states (no projections, which
  act on each position alone and change no path);
- self-attention (restricted): the same with window=(r // 2, r - 1 - r // 2), r keys centred on
  each query;
- convolutional (contiguous): `nn.Conv1d` of width k, causal (padded k - 1 on the left);
- convolutional (dilated): the same, layer l dilated k^l (ByteNet, Kalchbrenner et al. 2017);
- recurrent: one `nn.RNN` layer suffices, but its path runs through its steps, which wait on
  each other. It is run one step per call, and what is counted is the steps on the path: those
  whose hidden state depends on input 0 and on which output n - 1 depends.

No two paths may cancel, or a gradient could be 0 where a path exists: the inputs are ones and
every weight is positive, so every gradient on a path is positive (and in float64, so that no
product of many small weights underflows).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn import functional as F

from qkv.analysis.cost.layer_types import DEFAULT_NEIGHBOURHOOD, KERNEL, LAYER_NAMES, check_sizes
from qkv.attention import attention
from qkv.validation import check_choice

__all__ = ["measure_path_length"]

Layer = Callable[[torch.Tensor], torch.Tensor]  # (B, L, E) -> (B, L, E)


def _attention_layer(window: tuple[int, int] | None) -> Layer:
    def layer(hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.unsqueeze(1)  # (B, 1, L, E): one head of width E
        options = {} if window is None else {"window": window}
        return attention(x, x, x, backend="reference", **options).squeeze(1)  # (B, L, E)

    return layer


def _convolution_layer(width: int, kernel: int, dilation: int) -> Layer:
    convolution = nn.Conv1d(width, width, kernel, dilation=dilation, dtype=torch.float64)
    nn.init.ones_(convolution.weight)

    def layer(hidden: torch.Tensor) -> torch.Tensor:
        x = F.pad(hidden.transpose(1, 2), ((kernel - 1) * dilation, 0))  # (B, E, L + pad)
        return convolution(x).transpose(1, 2)  # (B, L, E)

    return layer


def _make_layer(layer: str, width: int, kernel: int, neighbourhood: int) -> Callable[[int], Layer]:
    """The l-th layer (l = 0, 1, ...) of the stack named `layer`."""
    before = neighbourhood // 2
    makers = {
        "self-attention": lambda depth: _attention_layer(None),
        "self-attention (restricted)": lambda depth: _attention_layer(
            (before, neighbourhood - 1 - before)
        ),
        "convolutional (contiguous)": lambda depth: _convolution_layer(width, kernel, 1),
        "convolutional (dilated)": lambda depth: _convolution_layer(width, kernel, kernel**depth),
    }
    return makers[layer]


@contextlib.contextmanager
def _dual_level() -> Iterator[None]:
    """forward_ad.dual_level, without the warning that torch.jit.script is deprecated: forward
    mode scripts torch's own decompositions the first time it runs, nothing of ours."""
    with warnings.catch_warnings(), forward_ad.dual_level():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        yield


def _tangent_of_first(length: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ones (B, L, E) and the tangent that moves input 0 alone."""
    inputs = torch.ones(1, length, width, dtype=torch.float64)  # (B, L, E)
    tangent = torch.zeros_like(inputs)
    tangent[:, 0] = 1.0
    return inputs, tangent


def _stack_depth(make_layer: Callable[[int], Layer], length: int, width: int) -> int:
    """The fewest layers after which output length - 1 has a nonzero derivative w.r.t. input 0."""
    inputs, tangent = _tangent_of_first(length, width)
    with _dual_level():
        hidden = forward_ad.make_dual(inputs, tangent)
        for depth in range(1, length + 1):  # every layer here reaches at least one position back
            hidden = make_layer(depth - 1)(hidden)
            if forward_ad.unpack_dual(hidden).tangent[0, -1].abs().sum() > 0:
                return depth
    raise RuntimeError(f"no path from position 0 to {length - 1} through {length} layers")


def _steps(recurrent: nn.RNN, inputs: torch.Tensor) -> list[torch.Tensor]:
    """The hidden state (1, B, E) after each step, one call per step: the sequential
    operations, one by one."""
    states, state = [], None
    for step in range(inputs.shape[1]):
        _, state = recurrent(inputs[:, step : step + 1], state)
        states.append(state)
    return states


def _recurrent_steps(length: int, width: int) -> int:
    """The steps of one `nn.RNN` layer whose hidden state is on a path from input 0 to output
    length - 1 (the output at a step is its hidden state): the states that depend on input 0
    (forward mode) and on which output length - 1 depends (reverse mode)."""
    recurrent = nn.RNN(width, width, batch_first=True, dtype=torch.float64)
    for parameter in recurrent.parameters():  # positive and small: tanh stays far from flat
        nn.init.constant_(parameter, 0.5 / width)
    inputs, tangent = _tangent_of_first(length, width)
    with _dual_level():
        states = _steps(recurrent, forward_ad.make_dual(inputs, tangent))
        reached = [bool(forward_ad.unpack_dual(s).tangent.abs().sum() > 0) for s in states]
    states = _steps(recurrent, inputs)
    read = torch.autograd.grad(states[-1].sum(), states)
    on_path = [hit and bool(g.abs().sum() > 0) for hit, g in zip(reached, read, strict=True)]
    return sum(on_path)


def measure_path_length(
    layer: str, *, length: int, width: int = 2, kernel: int = KERNEL,
    neighbourhood: int | None = None,
) -> int:  # fmt: skip
    """The maximum path length of `layer` (a name in LAYER_NAMES) over `length` positions, as
    the module docstring measures it: layers for a stack, steps for the recurrent layer.
    neighbourhood defaults to min(DEFAULT_NEIGHBOURHOOD, length), as in `layer_types`.
    TypeError/ValueError naming the argument as `check_sizes` does, or naming `layer`."""
    check_choice("layer", layer, LAYER_NAMES)
    if neighbourhood is None and isinstance(length, int):
        neighbourhood = min(DEFAULT_NEIGHBOURHOOD, length)
    check_sizes(length, width, kernel, neighbourhood)
    with torch.enable_grad():
        if layer == "recurrent":
            return _recurrent_steps(length, width)
        return _stack_depth(_make_layer(layer, width, kernel, neighbourhood), length, width)
