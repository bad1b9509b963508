"""`qkv cost --layer-types`: Vaswani et al. 2017, Table 1 at concrete sizes. Each row's FLOPs
against `FlopCounterMode` on a real layer (nn.RNN, nn.Conv1d, attention's scores and weighted
sum, and a banded attention that computes only each query's r keys and gives what
`qkv.attention` gives with the same window), the path lengths measured on real layers against
the formulas, the command's output and the errors that name the argument."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.layer_paths import measure_path_length
from qkv.analysis.cost.layer_types import LAYER_NAMES, dilated_depth, layer_types
from qkv.attention import attention
from tests.analysis.cost.command import run_cost

SIZES = [(12, 8, 3, 4), (20, 6, 2, 5)]  # (n, d, k, r)


def _flops(run) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return counter.get_total_flops()


def _rows(n: int, d: int, k: int, r: int) -> dict[str, int]:
    table = layer_types(length=n, width=d, kernel=k, neighbourhood=r)
    return {row.name: row.flops for row in table.rows}


def _banded_attention(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """Attention of x (B, L, E) over the r = before + 1 + after keys around each query, keys
    past the ends masked: only each query's band is multiplied."""
    B, L, E = x.shape
    r = before + 1 + after
    padded = F.pad(x, (0, 0, before, after))  # (B, before + L + after, E)
    windows = padded.unfold(1, r, 1)  # (B, L, E, r): the keys of each query
    position = torch.arange(L)[:, None] - before + torch.arange(r)  # (L, r)
    outside = (position < 0) | (position >= L)
    scores = (x.unsqueeze(2) @ windows) / math.sqrt(E)  # (B, L, 1, r)
    weights = scores.masked_fill(outside[:, None, :], float("-inf")).softmax(-1)
    return (weights @ windows.transpose(-1, -2)).squeeze(2)  # (B, L, E)


@pytest.mark.parametrize(("n", "d", "k", "r"), SIZES)
def test_each_row_counts_what_flop_counter_mode_counts(n, d, k, r):
    rows = _rows(n, d, k, r)
    x = torch.randn(1, n, d)  # (B, L, E)
    q = x.unsqueeze(1)  # (B, 1, L, E)
    assert _flops(lambda: attention(q, q, q, backend="reference")) == rows["self-attention"]
    assert _flops(lambda: nn.RNN(d, d, batch_first=True)(x)) == rows["recurrent"]
    convolution = nn.Conv1d(d, d, k)
    causal = F.pad(x.transpose(1, 2), (k - 1, 0))  # (B, E, L + k - 1)
    assert _flops(lambda: convolution(causal)) == rows["convolutional (contiguous)"]
    dilated = nn.Conv1d(d, d, k, dilation=k)
    spread = F.pad(x.transpose(1, 2), ((k - 1) * k, 0))
    assert _flops(lambda: dilated(spread)) == rows["convolutional (dilated)"]
    before, after = r // 2, r - 1 - r // 2
    assert _flops(lambda: _banded_attention(x, before, after)) == rows[LAYER_NAMES[4]]


def test_the_banded_attention_is_qkv_attention_with_the_window():
    """What the restricted row counts is the layer `qkv.attention` runs with window=(2, 1)."""
    x = torch.randn(2, 9, 4, dtype=torch.float64)  # (B, L, E)
    q = x.unsqueeze(1)  # (B, 1, L, E)
    expected = attention(q, q, q, window=(2, 1), backend="reference").squeeze(1)
    torch.testing.assert_close(_banded_attention(x, 2, 1), expected)


def test_the_rows_hold_table_1_at_the_base_model():
    """n = 1024, d = 512 (the base model), k = 3, r = 256: the orders and their values."""
    table = layer_types(length=1024, width=512)
    assert [row.name for row in table.rows] == list(LAYER_NAMES)
    assert table.neighbourhood == 256 and table.kernel == 3
    got = {row.name: (row.multiply_adds, row.sequential_operations, row.max_path_length)
           for row in table.rows}  # fmt: skip
    assert got == {
        "self-attention": (2 * 1024**2 * 512, 1, 1),
        "recurrent": (2 * 1024 * 512**2, 1024, 1024),
        "convolutional (contiguous)": (3 * 1024 * 512**2, 1, 512),
        "convolutional (dilated)": (3 * 1024 * 512**2, 1, 7),  # 3^6 < 1024 <= 3^7
        "self-attention (restricted)": (2 * 256 * 1024 * 512, 1, 8),  # 1023 / 128
    }
    assert [row.path for row in table.rows] == ["O(1)", "O(n)", "O(n/k)", "O(log_k n)", "O(n/r)"]
    assert all(row.flops == 2 * row.multiply_adds for row in table.rows)


def test_the_neighbourhood_defaults_to_the_length_when_shorter():
    assert layer_types(length=100, width=8).neighbourhood == 100
    assert [dilated_depth(n, 3) for n in (2, 3, 4, 9, 10, 27, 28)] == [1, 1, 2, 2, 3, 3, 4]


@pytest.mark.parametrize(("n", "k", "r"), [(2, 2, 2), (7, 3, 5), (16, 2, 2), (17, 4, 7)])
def test_the_measured_path_lengths_equal_the_formulas(n, k, r):
    table = layer_types(length=n, width=2, kernel=k, neighbourhood=r)
    expected = {row.name: row.max_path_length for row in table.rows}
    measured = {
        name: measure_path_length(name, length=n, kernel=k, neighbourhood=r) for name in LAYER_NAMES
    }
    assert measured == expected
    assert measured["recurrent"] == n and measured["self-attention"] == 1


# --- the command -------------------------------------------------------------------------------


def test_command_prints_the_rows_under_the_column(capsys):
    code, out, _ = run_cost(capsys, "gpt2", "--layer-types")
    assert code == 0 and "124,439,808" in out
    assert "gpt2: layer types at n = 1024, d = 768, k = 3, r = 256" in out
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()}
    assert rows["self-attention"] == ["O(n^2", "d)", "3.22", "GFLOP", "O(1)", "=", "1", "O(1)",
                                      "=", "1"]  # fmt: skip
    assert rows["recurrent"][-3:] == ["O(n)", "=", "1,024"]
    assert rows["convolutional (contiguous)"][-3:] == ["O(n/k)", "=", "512"]
    assert rows["convolutional (dilated)"][-4:] == ["O(log_k", "n)", "=", "7"]
    assert rows["self-attention (restricted)"][-3:] == ["O(n/r)", "=", "8"]


def test_command_takes_the_kernel_and_neighbourhood(capsys):
    argv = ["transformer-base", "--context", "64", "--kernel", "5", "--neighbourhood", "16"]
    code, out, _ = run_cost(capsys, *argv, "--json")
    [document] = json.loads(out)
    table = layer_types(length=64, width=512, kernel=5, neighbourhood=16, name="transformer-base")
    assert code == 0 and document["layer_types"]["rows"][3]["max_path_length"] == 3  # 5^3 >= 64
    assert [row["flops"] for row in document["layer_types"]["rows"]] == [
        row.flops for row in table.rows
    ]


@pytest.mark.parametrize(("argv", "named"), [
    (["gpt2", "--layer-types", "--kernel", "1"], "kernel"),
    (["gpt2", "--layer-types", "--neighbourhood", "4096"], "neighbourhood"),
    (["gpt2", "--neighbourhood", "1"], "neighbourhood"),
    (["--layer-types"], "model"),
])  # fmt: skip
def test_command_errors_name_the_argument(capsys, argv, named):
    code, out, err = run_cost(capsys, *argv)
    assert code == 1 and out == ""
    assert err.startswith(f"qkv cost: error: {named}: ")


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"length": 0}, ValueError, "length: expected an int >= 2, got 0"),
    ({"length": 8.0}, TypeError, "length: expected an int >= 2, got float 8.0"),
    ({"width": True}, TypeError, "width: expected an int >= 1, got bool True"),
    ({"kernel": 1}, ValueError, "kernel: expected an int >= 2, got 1"),
    ({"neighbourhood": 9}, ValueError, "neighbourhood: expected an int >= 2 and <= 8, got 9"),
])  # fmt: skip
def test_bad_sizes_name_the_argument(arguments, error, message):
    sizes = {"length": 8, "width": 4, **arguments}
    with pytest.raises(error, match=f"^{message}$"):
        layer_types(**sizes)
    with pytest.raises(error, match=f"^{message}$"):
        measure_path_length("recurrent", **sizes)


def test_an_unknown_layer_is_named():
    with pytest.raises(ValueError, match="^layer: expected one of"):
        measure_path_length("lstm", length=8)
