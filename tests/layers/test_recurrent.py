"""qkv.layers.GRU and GRUCell against torch.nn.GRU / nn.GRUCell with the same weights (float64):
outputs, final states and gradients, stacked and bidirectional, padded batches against packed
sequences and against each sequence run alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from qkv.layers import GRU, GRUCell
from qkv.layers.recurrent import gru_cell


def _torch_gru(**kwargs) -> nn.GRU:
    torch.manual_seed(0)
    return nn.GRU(batch_first=True, **kwargs).double()


def test_cell_equals_torch_gru_cell_with_gradients():
    torch.manual_seed(0)
    reference = nn.GRUCell(5, 7).double()
    cell = GRUCell.from_torch(reference)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    h = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    ours, theirs = cell(x, h), reference(x, h)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(ours.sum(), [x, h, cell.weight_hh])
    expected = torch.autograd.grad(theirs.sum(), [x, h, reference.weight_hh])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(cell(x), reference(x), rtol=0, atol=1e-12)  # h defaults to 0


def test_cell_function_follows_the_gate_equations():
    # r, z, n written out for one row with the (r, z, n) layout of the weights
    torch.manual_seed(1)
    I, H = 4, 3
    w_ih, w_hh = (
        torch.randn(3 * H, I, dtype=torch.float64),
        torch.randn(3 * H, H, dtype=torch.float64),
    )
    b_ih, b_hh = torch.randn(3 * H, dtype=torch.float64), torch.randn(3 * H, dtype=torch.float64)
    x, h = torch.randn(1, I, dtype=torch.float64), torch.randn(1, H, dtype=torch.float64)
    part = lambda w, i: w[i * H : (i + 1) * H]  # noqa: E731
    r = torch.sigmoid(x @ part(w_ih, 0).T + part(b_ih, 0) + h @ part(w_hh, 0).T + part(b_hh, 0))
    z = torch.sigmoid(x @ part(w_ih, 1).T + part(b_ih, 1) + h @ part(w_hh, 1).T + part(b_hh, 1))
    n = torch.tanh(x @ part(w_ih, 2).T + part(b_ih, 2) + r * (h @ part(w_hh, 2).T + part(b_hh, 2)))
    expected = (1 - z) * n + z * h
    got = gru_cell(x, h, weight_ih=w_ih, weight_hh=w_hh, bias_ih=b_ih, bias_hh=b_hh)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {"num_layers": 1, "bidirectional": False},
        {"num_layers": 2, "bidirectional": True},
        {"num_layers": 2, "bidirectional": False, "bias": False},
    ],
)
def test_gru_equals_torch_gru(options):
    reference = _torch_gru(input_size=5, hidden_size=6, **options)
    gru = GRU.from_torch(reference)
    assert list(gru.state_dict()) == list(reference.state_dict())
    rows = options["num_layers"] * (2 if options["bidirectional"] else 1)
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(rows, 3, 6, dtype=torch.float64)
    (out, h_n), (ref_out, ref_h_n) = gru(x, h0), reference(x, h0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(h_n, ref_h_n, rtol=0, atol=1e-12)
    grad = torch.autograd.grad((out.sin().sum() + h_n.sum()), x)[0]
    ref_grad = torch.autograd.grad((ref_out.sin().sum() + ref_h_n.sum()), x)[0]
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_state_dict_of_torch_loads_into_a_fresh_gru():
    reference = _torch_gru(input_size=4, hidden_size=3, num_layers=2, bidirectional=True)
    gru = GRU(4, 3, num_layers=2, bidirectional=True, dtype=torch.float64)
    gru.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(gru(x)[0], reference(x)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_padded_batch_equals_packed_sequences(bidirectional):
    reference = _torch_gru(input_size=4, hidden_size=5, num_layers=2, bidirectional=bidirectional)
    gru = GRU.from_torch(reference)
    lengths = torch.tensor([6, 2, 4, 1])
    x = torch.randn(4, 6, 4, dtype=torch.float64)
    out, h_n = gru(x, lengths=lengths)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    ref_packed, ref_h_n = reference(packed)
    ref_out, _ = pad_packed_sequence(ref_packed, batch_first=True, total_length=6)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)  # zeros past each length
    torch.testing.assert_close(h_n, ref_h_n, rtol=0, atol=1e-12)


def test_padded_batch_equals_each_sequence_alone_whatever_the_padding_holds():
    reference = _torch_gru(input_size=3, hidden_size=4, bidirectional=True)
    gru = GRU.from_torch(reference)
    lengths = torch.tensor([5, 3])
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    noisy = x.clone()
    noisy[1, 3:] = 1e3  # padded steps must not reach the state
    out, h_n = gru(noisy, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        alone_out, alone_h = reference(x[b : b + 1, :n])
        torch.testing.assert_close(out[b : b + 1, :n], alone_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(h_n[:, b : b + 1], alone_h, rtol=0, atol=1e-12)
    assert out[1, 3:].abs().max() == 0


def test_bad_inputs_name_the_argument():
    gru = GRU(3, 4)
    with pytest.raises(ValueError, match="x: expected a batch-first"):
        gru(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="h0: expected shape"):
        gru(torch.randn(2, 5, 3), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="lengths: expected values in"):
        gru(torch.randn(2, 5, 3), lengths=torch.tensor([6, 1]))
    with pytest.raises(ValueError, match="lengths: expected a"):
        gru(torch.randn(2, 5, 3), lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="num_layers"):
        GRU(3, 4, num_layers=0)
    with pytest.raises(ValueError, match="batch_first"):
        GRU.from_torch(nn.GRU(3, 4))
    with pytest.raises(ValueError, match="x: expected a"):
        GRUCell(3, 4)(torch.randn(2, 5))
