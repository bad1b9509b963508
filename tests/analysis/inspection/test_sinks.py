"""`qkv.analysis.inspection.sinks`: the sink-head rule (Gu et al. 2024: mean attention on the
first token above 0.3, here also above twice the uniform share) against the same means written
out by hand, on maps whose weights are known. The masses of a real model against transformers'
attentions: tests/studies/test_sinks.py and the SmolLM2 test of tests/analysis/pages/test_viz.py."""

import pytest
import torch

from qkv.analysis.inspection.attention_maps import AttentionMap
from qkv.analysis.inspection.sinks import SINK_THRESHOLD, attention_masses, sink_heads
from tests.generation.reference_models import qkv_model


def _causal_map(rows_weights: list[list[list[float]]], kind: str = "self") -> AttentionMap:
    """A map from per head, per row weights (row i lists the i + 1 keys it sees)."""
    L = len(rows_weights[0])
    weights = torch.zeros(1, len(rows_weights), L, L)
    for h, rows in enumerate(rows_weights):
        for i, row in enumerate(rows):
            weights[0, h, i, : len(row)] = torch.tensor(row)
    heads, rows = tuple(range(len(rows_weights))), tuple(range(L))
    return AttentionMap("blocks.0.self", "blocks.0.attn", kind, 0, heads, rows, weights)


def _uniform_rows(L: int) -> list[list[float]]:
    return [[1 / (i + 1)] * (i + 1) for i in range(L)]


def _sink_rows(L: int, share: float) -> list[list[float]]:
    """Row i >= 1 puts `share` on key 0 and the rest evenly on its other keys."""
    return [[1.0]] + [[share] + [(1 - share) / i] * i for i in range(1, L)]


def test_a_head_with_most_of_its_attention_on_the_first_token_is_a_sink_and_uniform_is_not():
    L = 12
    recorded = _causal_map([_uniform_rows(L), _sink_rows(L, 0.8), _sink_rows(L, 0.25)])
    uniform_head, sink, weak = sink_heads(recorded)
    expected_uniform = sum(1 / (i + 1) for i in range(1, L)) / (L - 1)  # row 0 left out
    assert uniform_head.uniform == pytest.approx(expected_uniform)
    assert uniform_head.mass == pytest.approx(expected_uniform)
    assert sink.mass == pytest.approx(0.8) and weak.mass == pytest.approx(0.25)
    assert [head.is_sink for head in (uniform_head, sink, weak)] == [False, True, False]
    assert weak.mass < SINK_THRESHOLD < sink.mass


def test_on_a_short_text_a_mass_uniform_attention_would_give_marks_nothing():
    # 3 tokens: uniform attention already puts (1/2 + 1/3) / 2 = 0.42 on token 0
    recorded = _causal_map([_sink_rows(3, 0.6), _sink_rows(3, 0.9)])
    moderate, strong = sink_heads(recorded)
    assert moderate.uniform == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert not moderate.is_sink  # 0.6 < 2 x 0.42
    assert strong.is_sink  # 0.9 > 0.83


def test_bidirectional_and_cross_maps_average_every_row_over_every_key():
    weights = torch.full((1, 2, 4, 8), 1 / 8)  # (B, H, rows, L_k): uniform
    weights[0, 1, :, :] = 0.1 / 7
    weights[0, 1, :, 0] = 0.9
    recorded = AttentionMap("decoder.0.cross", "decoder.blocks.0.cross_attn", "cross", 0,
                            (0, 1), (0, 1, 2, 3), weights)  # fmt: skip
    plain, sink = sink_heads(recorded)
    assert plain.uniform == pytest.approx(1 / 8) and plain.mass == pytest.approx(1 / 8)
    assert not plain.is_sink and sink.is_sink and sink.mass == pytest.approx(0.9)


def test_a_first_query_past_the_text_is_refused_by_name():
    model = qkv_model("tiny-llama")
    ids = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="first_query: expected 0..8 for 9 tokens, got 9"):
        attention_masses(model, ids, {"first": [0]}, first_query=9)
