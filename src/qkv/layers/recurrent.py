"""The gated recurrent unit (Cho et al. 2014, "Learning Phrase Representations using RNN
Encoder-Decoder for Statistical Machine Translation", s2.3), written from its equations.

At each step t the hidden state h (B, H) reads the input x_t (B, I) through two gates:

    r = sigmoid(W_ir x_t + b_ir + W_hr h + b_hr)          reset gate
    z = sigmoid(W_iz x_t + b_iz + W_hz h + b_hz)          update gate
    n = tanh(W_in x_t + b_in + r * (W_hn h + b_hn))       candidate state
    h' = (1 - z) * n + z * h

This is the layout of `torch.nn.GRU` (and cuDNN): the reset gate multiplies the recurrent
product W_hn h + b_hn, where Cho et al.'s eq. 7 writes U (r * h), the product of the already
reset state. The two differ in where r acts, not in what the unit can represent; the PyTorch
form is kept so that `nn.GRU` weights load unchanged. The weights are stacked in the gate order
(r, z, n): weight_ih (3H, I), weight_hh (3H, H), under PyTorch's parameter names, so that
`load_state_dict(gru.state_dict())` and `from_torch` both work.

`GRU` runs whole batch-first sequences, stacked and optionally bidirectional (Schuster &
Paliwal 1997; the annotations of Bahdanau et al. 2015, s3.2). Its input products x W_i^T are
computed for every step at once; only the recurrent product runs one step at a time. With
`lengths`, steps past a sequence's length leave its state unchanged and output zeros, and the
backward direction starts at each sequence's last real step, as PyTorch's packed sequences do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers._dropout import make_dropout
from qkv.validation import check_positive_int, check_probability, describe

__all__ = ["GRU", "GRUCell", "gru_cell"]


def gru_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    *,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
    bias_ih: torch.Tensor | None = None,
    bias_hh: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GRU step (see the module docstring): x (B, I), h (B, H) -> h' (B, H)."""
    return _step(F.linear(x, weight_ih, bias_ih), h, weight_hh, bias_hh)


def _step(
    input_gates: torch.Tensor,
    h: torch.Tensor,
    weight_hh: torch.Tensor,
    bias_hh: torch.Tensor | None,
) -> torch.Tensor:
    """One step from the input's gate pre-activations W_i x + b_i (B, 3H) and h (B, H)."""
    x_r, x_z, x_n = input_gates.chunk(3, dim=-1)  # (B, H) each
    h_r, h_z, h_n = F.linear(h, weight_hh, bias_hh).chunk(3, dim=-1)  # (B, H) each
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return n + z * (h - n)  # (1 - z) * n + z * h


def _init_uniform(module: nn.Module, hidden_size: int) -> None:
    """U(-1/sqrt(H), 1/sqrt(H)) for every weight and bias, PyTorch's initialisation."""
    bound = 1.0 / math.sqrt(hidden_size)
    for parameter in module.parameters():
        nn.init.uniform_(parameter, -bound, bound)


class GRUCell(nn.Module):
    """One GRU step, parameters named as `nn.GRUCell`'s: x (B, I), h (B, H) or None -> (B, H)."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = check_positive_int("input_size", input_size)
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        factory = {"device": device, "dtype": dtype}
        H = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(3 * H, input_size, **factory))
        self.weight_hh = nn.Parameter(torch.empty(3 * H, H, **factory))
        self.bias_ih = nn.Parameter(torch.empty(3 * H, **factory)) if bias else None
        self.bias_hh = nn.Parameter(torch.empty(3 * H, **factory)) if bias else None
        _init_uniform(self, H)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.input_size:
            raise ValueError(f"x: expected a (B, {self.input_size}) tensor, got {describe(x)}")
        if h is None:
            h = x.new_zeros(x.shape[0], self.hidden_size)
        elif h.shape != (x.shape[0], self.hidden_size):
            raise ValueError(
                f"h: expected shape ({x.shape[0]}, {self.hidden_size}), got {tuple(h.shape)}"
            )
        return gru_cell(
            x, h, weight_ih=self.weight_ih, weight_hh=self.weight_hh,
            bias_ih=self.bias_ih, bias_hh=self.bias_hh,
        )  # fmt: skip

    @classmethod
    def from_torch(cls, module: nn.GRUCell) -> GRUCell:
        """A GRUCell with the weights of `module` (copied, same dtype and device)."""
        weight = module.weight_ih
        cell = cls(
            module.input_size, module.hidden_size, bias=module.bias,
            device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        cell.load_state_dict(module.state_dict())
        return cell


class GRU(nn.Module):
    """A batch-first, stacked, optionally bidirectional GRU, parameters named as `nn.GRU`'s.

    forward(x (B, L, I), h0 (layers * directions, B, H) or None, *, lengths (B,) or None)
    -> (output (B, L, directions * H) of the last layer, h_n (layers * directions, B, H)).
    Bidirectional outputs are [forward; backward] on the last axis; h_n orders its rows layer
    by layer, forward before backward, as PyTorch does. `dropout` applies to the outputs of
    every layer but the last, in training.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        num_layers: int = 1,
        bidirectional: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = check_positive_int("input_size", input_size)
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.num_directions = 2 if bidirectional else 1
        self.bias = bias
        self.dropout = make_dropout(check_probability("dropout", dropout))
        factory = {"device": device, "dtype": dtype}
        H = hidden_size
        for layer in range(num_layers):
            width = input_size if layer == 0 else H * self.num_directions
            for suffix in self._suffixes(layer):
                self.register_parameter(
                    f"weight_ih{suffix}", nn.Parameter(torch.empty(3 * H, width, **factory))
                )
                self.register_parameter(
                    f"weight_hh{suffix}", nn.Parameter(torch.empty(3 * H, H, **factory))
                )
                for name in ("bias_ih", "bias_hh"):
                    value = nn.Parameter(torch.empty(3 * H, **factory)) if bias else None
                    self.register_parameter(f"{name}{suffix}", value)
        _init_uniform(self, H)

    def _suffixes(self, layer: int) -> list[str]:
        """The parameter-name suffixes of one layer: "_l0", and "_l0_reverse" if bidirectional."""
        return [f"_l{layer}", f"_l{layer}_reverse"][: self.num_directions]

    def forward(
        self,
        x: torch.Tensor,
        h0: torch.Tensor | None = None,
        *,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, L = self._check_input(x)
        rows = self.num_layers * self.num_directions
        if h0 is None:
            h0 = x.new_zeros(rows, B, self.hidden_size)
        elif not isinstance(h0, torch.Tensor) or h0.shape != (rows, B, self.hidden_size):
            raise ValueError(
                f"h0: expected shape ({rows}, {B}, {self.hidden_size}), got {describe(h0)}"
            )
        active = None if lengths is None else self._active_steps(lengths, B, L, x.device)
        finals = []
        for layer in range(self.num_layers):
            if layer > 0:
                x = self.dropout(x)
            outputs = []
            for direction, suffix in enumerate(self._suffixes(layer)):
                h = h0[layer * self.num_directions + direction]  # (B, H)
                output, h = self._run(x, h, suffix, active, reverse=direction == 1)
                outputs.append(output)
                finals.append(h)
            x = torch.cat(outputs, dim=-1)  # (B, L, directions * H)
        return x, torch.stack(finals)  # (B, L, directions * H), (layers * directions, B, H)

    def _run(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        suffix: str,
        active: torch.Tensor | None,
        *,
        reverse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One direction of one layer over x (B, L, I): (outputs (B, L, H), final state)."""
        weight_hh, bias_hh = getattr(self, f"weight_hh{suffix}"), getattr(self, f"bias_hh{suffix}")
        gates = F.linear(x, getattr(self, f"weight_ih{suffix}"), getattr(self, f"bias_ih{suffix}"))
        if reverse:
            order = _reversed_order(active, x.shape[0], x.shape[1], x.device)  # (B, L)
            gates = gates.gather(1, order[..., None].expand_as(gates))  # (B, L, 3H)
        outputs = []
        for t in range(x.shape[1]):
            h_next = _step(gates[:, t], h, weight_hh, bias_hh)  # (B, H)
            if active is None:
                h = h_next
                outputs.append(h)
            else:  # a finished sequence keeps its state and outputs zeros
                keep = active[:, t, None]  # (B, 1)
                h = torch.where(keep, h_next, h)
                outputs.append(h_next * keep)
        output = torch.stack(outputs, dim=1)  # (B, L, H)
        if reverse:  # the same permutation puts each step back
            output = output.gather(1, order[..., None].expand_as(output))
        return output, h

    def _check_input(self, x: torch.Tensor) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(
                f"x: expected a batch-first (B, L, {self.input_size}) tensor, got {describe(x)}"
            )
        return x.shape[0], x.shape[1]

    @staticmethod
    def _active_steps(lengths: torch.Tensor, B: int, L: int, device) -> torch.Tensor:
        """(B, L) bool, True at the steps before each sequence's length."""
        if (
            not isinstance(lengths, torch.Tensor)
            or lengths.shape != (B,)
            or lengths.is_floating_point()
            or lengths.dtype == torch.bool
        ):
            raise ValueError(f"lengths: expected a ({B},) integer tensor, got {describe(lengths)}")
        if B and (int(lengths.min()) < 0 or int(lengths.max()) > L):
            raise ValueError(
                f"lengths: expected values in [0, {L}], got values in "
                f"[{int(lengths.min())}, {int(lengths.max())}]"
            )
        return torch.arange(L, device=device) < lengths.to(device)[:, None]  # (B, L)

    @classmethod
    def from_torch(cls, module: nn.GRU) -> GRU:
        """A GRU with the weights of `module` (copied, same dtype and device), which must be
        batch-first and have no projection; its dropout is kept."""
        if not module.batch_first:
            raise ValueError("module: expected an nn.GRU with batch_first=True, got False")
        if getattr(module, "proj_size", 0):
            raise ValueError(f"module: expected proj_size=0, got {module.proj_size}")
        weight = module.weight_ih_l0
        gru = cls(
            module.input_size, module.hidden_size, num_layers=module.num_layers,
            bidirectional=module.bidirectional, bias=module.bias, dropout=module.dropout,
            device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        gru.load_state_dict(module.state_dict())
        return gru


def _reversed_order(active: torch.Tensor | None, B: int, L: int, device) -> torch.Tensor:
    """(B, L) time indices that reverse each sequence within its length and leave its padding
    in place; without lengths, the plain reversal. Applying it twice gives the identity."""
    steps = torch.arange(L, device=device).expand(B, L)  # (B, L)
    if active is None:
        return steps.flip(1)
    lengths = active.sum(dim=1, keepdim=True)  # (B, 1)
    return torch.where(active, lengths - 1 - steps, steps)
