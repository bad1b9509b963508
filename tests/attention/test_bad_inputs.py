"""Nothing quietly accepted by attention: each bad input of the catalogue fails in validation
with a ValueError naming the argument, on every entry point; and one NaN rule holds on every
backend that runs here (reference, sdpa, tiled): masking never hides a NaN."""

from __future__ import annotations

import pytest
import torch

import qkv

BACKENDS = ["reference", "sdpa", "tiled"]
NAN, INF = float("nan"), float("inf")


def _qkv(D: int = 4, D_v: int | None = None, L_q: int = 3, L_k: int = 5):
    torch.manual_seed(0)
    D_v = D if D_v is None else D_v
    return torch.randn(1, 2, L_q, D), torch.randn(1, 2, L_k, D), torch.randn(1, 2, L_k, D_v)


def _call(entry: str, q, k, v, **options):
    if entry == "flash_attention":
        return qkv.flash_attention(q, k, v, **options)
    return qkv.attention(q, k, v, backend=entry, **options)


# (description, inputs (q, k, v, options), expected error, message)
CATALOGUE = [
    ("head dim D = 0", lambda: (*_qkv(D=0), {}), ValueError, r"q, k, v: .*D >= 1.*got D=0"),
    (
        "value head dim D_v = 0",
        lambda: (*_qkv(D_v=0), {}),
        ValueError,
        r"q, k, v: .*D_v >= 1.*got D=4, D_v=0",
    ),
    (
        "bool mask on another device than q",
        lambda: (*_qkv(), {"mask": torch.ones(3, 5, dtype=torch.bool, device="meta")}),
        ValueError,
        r"mask: on device meta, expected q's device cpu",
    ),
    (
        "float mask on another device than q",
        lambda: (*_qkv(), {"mask": torch.zeros(1, 1, 3, 5, device="meta")}),
        ValueError,
        r"mask: on device meta, expected q's device cpu",
    ),
    (
        "bias on another device than q",
        lambda: (*_qkv(), {"bias": torch.zeros(3, 5, device="meta")}),
        ValueError,
        r"bias: on device meta, expected q's device cpu",
    ),
]


@pytest.mark.parametrize("entry", [*BACKENDS, "flash_attention"])
@pytest.mark.parametrize(
    ("description", "make", "error", "message"), CATALOGUE, ids=[c[0] for c in CATALOGUE]
)
def test_bad_input_fails_in_validation_naming_the_argument(
    entry, description, make, error, message
):
    q, k, v, options = make()
    with pytest.raises(error, match=message):
        _call(entry, q, k, v, **options)


def test_auto_refuses_a_mask_on_another_device_after_a_good_call_of_the_same_shapes():
    """auto remembers its choice per signature: the device is part of it."""
    q, k, v = _qkv()
    qkv.attention(q, k, v, mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask: on device meta"):
        qkv.attention(q, k, v, mask=torch.ones(3, 5, dtype=torch.bool, device="meta"))


def _float_mask(*cells: tuple[int, int, float], fill: float = 0.0) -> torch.Tensor:
    mask = torch.full((3, 5), fill)
    for row, column, value in cells:
        mask[row, column] = value
    return mask


# (description, options, the query rows whose output must be NaN): query 1's row throughout.
NAN_RULE = [
    ("a row of the float mask all NaN", {"mask": _float_mask(*[(1, j, NAN) for j in range(5)])},
     [1]),
    ("one NaN in a row of the float mask", {"mask": _float_mask((1, 2, NAN))}, [1]),
    ("one +inf in a row of the float mask", {"mask": _float_mask((1, 2, INF))}, [1]),
    ("NaN in a row that is otherwise all -inf", {"mask": _float_mask((1, 2, NAN), fill=-INF)},
     [1]),
    ("NaN in the bias", {"bias": _float_mask((1, 2, NAN))}, [1]),
    ("NaN at a position causal hides", {"mask": _float_mask((1, 4, NAN)), "causal": True}, []),
    (
        "NaN in the bias where a bool mask blocks",
        {"bias": _float_mask((1, 2, NAN)), "mask": _float_mask((1, 2, -INF)) == 0},
        [],
    ),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("description", "options", "nan_rows"), NAN_RULE, ids=[c[0] for c in NAN_RULE]
)
def test_one_nan_rule_masking_never_hides_a_nan(backend, description, options, nan_rows):
    """The rule of qkv.attention.masks: a NaN (or +inf) added to a visible score makes its
    query's output NaN; blocked positions are removed, NaN and all; rows of -inf are 0."""
    q, k, v = _qkv()
    output = qkv.attention(q, k, v, backend=backend, **options)  # (1, 2, L_q, D_v)
    for row in range(q.shape[2]):
        if row in nan_rows:
            assert torch.isnan(output[:, :, row]).all(), row
        else:
            assert torch.isfinite(output[:, :, row]).all(), row


def test_a_fully_masked_row_beside_a_nan_row_stays_zero_on_every_backend():
    q, k, v = _qkv()
    mask = _float_mask((1, 2, NAN))
    mask[0] = -INF  # query 0 sees nothing: output 0, finite gradients
    for backend in BACKENDS:
        q.requires_grad_(True)
        output = qkv.attention(q, k, v, mask=mask, backend=backend)
        assert torch.equal(output[:, :, 0], torch.zeros_like(output[:, :, 0])), backend
        assert torch.isnan(output[:, :, 1]).all() and torch.isfinite(output[:, :, 2]).all()
        (grad,) = torch.autograd.grad(output[:, :, 0].sum() + output[:, :, 2].sum(), q)
        assert torch.isfinite(grad[:, :, 0]).all(), backend
        q = q.detach()


def test_triton_propagates_a_nan_query_like_the_reference():
    """Triton (interpreted on the CPU) takes no mask; a NaN in q reaches its row's output."""
    pytest.importorskip("triton")
    q, k, v = _qkv(D=16, L_q=4, L_k=4)
    q[0, 0, 1, 3] = NAN
    output = qkv.attention(q, k, v, backend="triton")
    expected = qkv.attention(q, k, v, backend="reference")
    assert torch.equal(torch.isnan(output), torch.isnan(expected))
    assert torch.isnan(output[0, 0, 1]).all() and torch.isnan(output).sum() == 16


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"sinks": -1, "window": 2}, ValueError, "sinks: expected an int >= 0, got -1"),
        ({"sinks": 1.5}, ValueError, "sinks: expected an int >= 0, got 1.5"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes: expected shape \(2,\)"),
        ({"alibi_slopes": torch.ones(2, dtype=torch.long)}, TypeError, "alibi_slopes: .*floating"),
        ({"alibi_slopes": [1.0, 2.0]}, TypeError, "alibi_slopes: expected a torch.Tensor"),
        ({"softcap": 0.0}, ValueError, "softcap: expected a positive finite number"),
        ({"softcap": float("inf")}, ValueError, "softcap: expected a positive finite number"),
        ({"score_mod": "tanh"}, TypeError, "score_mod: expected a callable"),
    ],
)
def test_pattern_options_are_checked_by_name(options, error, match):
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises(error, match=match):
        qkv.attention(q, k, v, **options)
