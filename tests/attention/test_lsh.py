"""LSH attention (qkv.attention.lsh) against references written here from the Reformer paper.

The outside references: the hash as its formula reads, argmax([xR; -xR]) with R drawn as the
docstring says, and the collision rate of a random hyperplane, 1 - angle / pi (Charikar 2002);
PyTorch's F.scaled_dot_product_attention when every token lands in one bucket and one chunk;
an O(L^2) float64 eager formulation that builds, from the same bucket ids, the mask of each round
pair by pair (Kitaev et al. 2020, s2) and combines the rounds with their log-sum-exps; PyTorch's
FLOP counter, and qkv cost's full-attention figures, for the cost.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from qkv.analysis.cost.estimate import score_matrix_bytes
from qkv.analysis.cost.layout import AttentionLayout
from qkv.attention import LSHAttentionCost, lsh_attention, lsh_attention_cost, lsh_hash


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rotations(seed: int, H: int, rounds: int, D: int, num_buckets: int) -> torch.Tensor:
    """R as lsh_hash documents its draw: (H, rounds, D, num_buckets / 2)."""
    return torch.randn(H, rounds, D, num_buckets // 2, generator=seeded(seed))


# --- the hash ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hash_is_the_argmax_over_the_rotation_and_its_negative(dtype):
    B, H, L, D, rounds, num_buckets = 2, 3, 10, 6, 3, 8
    x = torch.randn(B, H, L, D, generator=seeded(1), dtype=dtype)
    buckets = lsh_hash(x, num_buckets=num_buckets, num_rounds=rounds, generator=seeded(7))
    R = rotations(7, H, rounds, D, num_buckets).to(dtype)
    assert buckets.shape == (B, H, rounds, L)
    for b in range(B):
        for h in range(H):
            for r in range(rounds):
                rotated = x[b, h] @ R[h, r]  # (L, num_buckets / 2)
                expected = torch.argmax(torch.cat([rotated, -rotated], dim=1), dim=1)
                assert torch.equal(buckets[b, h, r], expected)


def pairs_at_angles(angles: list[float], D: int) -> torch.Tensor:
    """(1, 1, 2 * len(angles), D): for each angle a random unit x followed by y at that angle."""
    rows = []
    for index, angle in enumerate(angles):
        basis, _ = torch.linalg.qr(torch.randn(D, 2, generator=seeded(100 + index)))
        x, y = basis[:, 0], basis[:, 1]
        rows += [x, math.cos(angle) * x + math.sin(angle) * y]
    return torch.stack(rows).view(1, 1, 2 * len(angles), D)


def collision_rates(angles: list[float], num_buckets: int, rounds: int) -> torch.Tensor:
    x = pairs_at_angles(angles, D=16)
    buckets = lsh_hash(x, num_buckets=num_buckets, num_rounds=rounds, generator=seeded(3))
    buckets = buckets[0, 0].view(rounds, len(angles), 2)  # (rounds, angle, pair member)
    return (buckets[..., 0] == buckets[..., 1]).double().mean(dim=0)


def test_close_vectors_share_buckets_more_often_than_distant_ones():
    angles = [0.0, 0.3, 0.7, 1.2, 1.8, math.pi]
    rates = collision_rates(angles, num_buckets=8, rounds=3000)
    assert rates[0] == 1.0 and rates[-1] == 0.0  # -x always lands in the opposite bucket
    assert torch.all(rates[1:] < rates[:-1] - 0.02), rates


def test_two_buckets_collide_as_a_random_hyperplane_does():
    angles = [0.3, 0.9, 1.5, 2.2, 2.8]
    rates = collision_rates(angles, num_buckets=2, rounds=4000)
    expected = 1.0 - torch.tensor(angles, dtype=torch.float64) / math.pi  # Charikar 2002
    standard_error = (expected * (1 - expected) / 4000).sqrt()
    assert torch.all((rates - expected).abs() < 4 * standard_error), (rates, expected)


# --- one bucket, one chunk: full attention -----------------------------------------------------


def into_bucket_zero(x: torch.Tensor, seed: int, rounds: int) -> torch.Tensor:
    """x (B, H, L, D) moved the least so that x R_r > 0 in every round: bucket 0 throughout."""
    H, D = x.shape[1], x.shape[3]
    R = rotations(seed, H, rounds, D, num_buckets=2)[..., 0].to(x.dtype)  # (H, rounds, D)
    projected = torch.einsum("bhld,hrd->bhlr", x, R)
    shortfall = projected.clamp(min=1.0) - projected  # (B, H, L, rounds)
    gram = R @ R.transpose(-1, -2)  # (H, rounds, rounds)
    step = torch.einsum("bhlr,hrs,hsd->bhld", shortfall, torch.linalg.inv(gram), R)
    return x + step


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rounds, chunk_size", [(1, 12), (3, 20)])
def test_one_bucket_and_one_chunk_is_full_attention_without_self(causal, rounds, chunk_size):
    B, H, L, D = 2, 2, 12, 8
    qk = into_bucket_zero(
        torch.randn(B, H, L, D, generator=seeded(1), dtype=torch.float64), 5, rounds
    )
    v = torch.randn(B, H, L, 5, generator=seeded(2), dtype=torch.float64)
    out, buckets = lsh_attention(
        qk,
        v,
        num_buckets=2,
        num_rounds=rounds,
        chunk_size=chunk_size,
        causal=causal,
        generator=seeded(5),
        return_buckets=True,
    )
    assert torch.all(buckets == 0)
    keys = qk / qk.norm(dim=-1, keepdim=True)
    allowed = ~torch.eye(L, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(L, L, dtype=torch.bool).tril()
        allowed[0, 0] = True  # the first token has no key but itself
    expected = F.scaled_dot_product_attention(qk, keys, v, attn_mask=allowed)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_a_single_token_attends_to_itself():
    qk, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 3)
    out = lsh_attention(qk, v, num_buckets=4, chunk_size=3, generator=seeded())
    torch.testing.assert_close(out, v)


# --- the sort, chunk, unsort machinery against an O(L^2) formulation ---------------------------


def round_masks(buckets: torch.Tensor, chunk_size: int, causal: bool) -> torch.Tensor:
    """(B, H, R, L, L) bool, pair by pair: same bucket, same or previous chunk of the order sorted
    by (bucket, position), key <= query if causal, not itself unless nothing else is visible."""
    L = buckets.shape[-1]
    position = torch.arange(L)
    order = torch.argsort(buckets * L + position, dim=-1)  # distinct sort keys: (bucket, position)
    slot = torch.argsort(order, dim=-1)  # where each position sits in the sorted order
    chunk = slot // chunk_size
    distance = chunk.unsqueeze(-1) - chunk.unsqueeze(-2)  # query's chunk - key's chunk
    others = (buckets.unsqueeze(-1) == buckets.unsqueeze(-2)) & ((distance == 0) | (distance == 1))
    if causal:
        others &= position.view(1, L) <= position.view(L, 1)
    itself = torch.eye(L, dtype=torch.bool)
    others &= ~itself
    alone = ~others.any(dim=-1, keepdim=True)
    return others | (itself & alone)


def eager_lsh(qk, v, buckets, chunk_size, causal):
    """Per round softmax over the round's keys, each score lowered by log(rounds that show the
    key), then the rounds weighted by exp(lse_r - logsumexp_r lse_r) (s2)."""
    masks = round_masks(buckets, chunk_size, causal)  # (B, H, R, L, L)
    seen = masks.sum(dim=2, keepdim=True).clamp(min=1).double()
    keys = qk / qk.norm(dim=-1, keepdim=True)
    scores = (qk @ keys.transpose(-1, -2) / math.sqrt(qk.shape[-1])).unsqueeze(2) - seen.log()
    scores = scores.masked_fill(~masks, -math.inf)  # (B, H, R, L, L)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, R, L)
    per_round = torch.softmax(scores, dim=-1) @ v.unsqueeze(2)  # (B, H, R, L, D_v)
    weights = torch.exp(lse - torch.logsumexp(lse, dim=2, keepdim=True))
    union = masks.any(dim=2)
    full = F.scaled_dot_product_attention(qk, keys, v, attn_mask=union)
    return (weights.unsqueeze(-1) * per_round).sum(dim=2), full


CASES = [  # L, chunk_size, num_buckets, rounds, causal
    (19, 4, 4, 3, False),
    (19, 4, 4, 3, True),
    (16, 4, 8, 2, True),
    (7, 1, 2, 2, False),
    (12, 5, 6, 1, False),
    (10, 3, 2, 4, True),
]


@pytest.mark.parametrize("L, chunk_size, num_buckets, rounds, causal", CASES)
def test_matches_the_quadratic_formulation_from_the_same_buckets(
    L, chunk_size, num_buckets, rounds, causal
):
    qk = torch.randn(2, 3, L, 6, generator=seeded(L), dtype=torch.float64)
    v = torch.randn(2, 3, L, 5, generator=seeded(L + 1), dtype=torch.float64)
    out, buckets = lsh_attention(
        qk,
        v,
        num_buckets=num_buckets,
        num_rounds=rounds,
        chunk_size=chunk_size,
        causal=causal,
        generator=seeded(9),
        return_buckets=True,
    )
    assert torch.equal(
        buckets, lsh_hash(qk, num_buckets=num_buckets, num_rounds=rounds, generator=seeded(9))
    )
    expected, over_the_union = eager_lsh(qk, v, buckets, chunk_size, causal)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # keys counted once across rounds: the rounds together are softmax over the union of sets
    torch.testing.assert_close(out, over_the_union, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs_are_computed_in_fp32(dtype, tolerance):
    qk = torch.randn(1, 2, 14, 8, generator=seeded(4)).to(dtype)
    v = torch.randn(1, 2, 14, 8, generator=seeded(5)).to(dtype)
    out, buckets = lsh_attention(
        qk,
        v,
        num_buckets=4,
        num_rounds=2,
        chunk_size=4,
        causal=True,
        generator=seeded(2),
        return_buckets=True,
    )
    expected, _ = eager_lsh(qk.double(), v.double(), buckets, 4, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_gradients_match_finite_differences():
    qk = torch.randn(1, 1, 6, 4, generator=seeded(6), dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 6, 3, generator=seeded(7), dtype=torch.float64, requires_grad=True)

    def attend(qk, v):
        return lsh_attention(
            qk, v, num_buckets=2, num_rounds=2, chunk_size=2, causal=True, generator=seeded(1)
        )

    assert torch.autograd.gradcheck(attend, (qk, v))


# --- the cost ----------------------------------------------------------------------------------


@pytest.mark.parametrize("L, chunk_size", [(32, 8), (30, 8)])
def test_cost_counts_the_products_pytorch_counts(L, chunk_size):
    qk, v = torch.randn(2, 3, L, 16), torch.randn(2, 3, L, 12)
    with FlopCounterMode(display=False) as counter:
        lsh_attention(qk, v, num_buckets=6, num_rounds=2, chunk_size=chunk_size)
    cost = lsh_attention_cost(
        length=L,
        head_dim=16,
        value_dim=12,
        num_buckets=6,
        num_rounds=2,
        chunk_size=chunk_size,
        batch=2,
        num_heads=3,
    )
    assert isinstance(cost, LSHAttentionCost)
    assert cost.attention_flops + cost.hash_flops == counter.get_total_flops()


def test_cost_is_linear_in_length_where_full_attention_is_quadratic():
    settings = dict(head_dim=64, num_buckets=32, num_rounds=4, chunk_size=64, batch=2, num_heads=8)
    short = lsh_attention_cost(length=4096, **settings)
    long = lsh_attention_cost(length=8192, **settings)
    assert long.attention_flops == 2 * short.attention_flops
    assert long.hash_flops == 2 * short.hash_flops
    assert long.sort_operations == 2 * short.sort_operations * 13 / 12  # L log2 L
    assert 2.0 < long.flops / short.flops < 2.05
    assert long.score_bytes == 2 * short.score_bytes
    assert long.full_attention_flops == 4 * short.full_attention_flops
    assert long.full_score_bytes == 4 * short.full_score_bytes
    assert long.full_score_bytes == 16 * long.score_bytes  # 8192 keys vs 4 rounds x 128


def test_full_attention_figures_are_those_of_qkv_cost():
    B, H, L, D = 2, 8, 4096, 64
    cost = lsh_attention_cost(
        length=L, head_dim=D, num_buckets=16, num_rounds=2, chunk_size=128, batch=B, num_heads=H
    )
    layer = AttentionLayout(embed_dim=H * D, num_heads=H, num_kv_heads=H, head_dim=D, bias=False)
    projections_only = layer.flops(L, 0, new_keys=L)
    assert cost.full_attention_flops == B * (layer.flops(L, L) - projections_only)
    matrix = score_matrix_bytes(length=L, num_heads=H, batch=B, bytes_per_element=4)
    assert cost.full_score_bytes == matrix.per_layer_bytes


# --- bad input ---------------------------------------------------------------------------------

GOOD = dict(num_buckets=4, chunk_size=2)


@pytest.mark.parametrize(
    "change, error, named",
    [
        (dict(num_buckets=5), ValueError, "num_buckets"),
        (dict(num_buckets=0), ValueError, "num_buckets"),
        (dict(num_buckets=4.0), TypeError, "num_buckets"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(num_rounds=0), ValueError, "num_rounds"),
        (dict(causal="yes"), TypeError, "causal"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(generator=0), TypeError, "generator"),
        (dict(qk=torch.randn(2, 8, 4)), ValueError, "qk"),
        (dict(qk=torch.ones(1, 2, 8, 4, dtype=torch.int64)), TypeError, "qk"),
        (dict(v=torch.randn(1, 2, 7, 4)), ValueError, "v"),
        (dict(v=[1.0]), TypeError, "v"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, named):
    arguments = dict(qk=torch.randn(1, 2, 8, 4), v=torch.randn(1, 2, 8, 4), **GOOD) | change
    qk, v = arguments.pop("qk"), arguments.pop("v")
    with pytest.raises(error, match=rf"^{named}: expected"):
        lsh_attention(qk, v, **arguments)


def test_bad_hash_and_cost_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"^num_buckets: expected an even int.*got 3"):
        lsh_hash(torch.randn(1, 1, 4, 2), num_buckets=3)
    with pytest.raises(ValueError, match=r"^length: expected"):
        lsh_attention_cost(length=0, head_dim=8, num_buckets=4, num_rounds=1, chunk_size=4)
    with pytest.raises(ValueError, match=r"^num_buckets: expected"):
        lsh_attention_cost(length=8, head_dim=8, num_buckets=7, num_rounds=1, chunk_size=4)
