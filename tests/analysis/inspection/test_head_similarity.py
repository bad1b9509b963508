"""Per-position cosine similarity between what an attention layer reads and what it writes,
against `F.cosine_similarity` on tensors captured from nn.MultiheadAttention,
transformers' BertModel and nn.Transformer; ALBERT-style shared layers give one entry per call."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.analysis.inspection.heads import position_cosine_similarity
from qkv.layers import MultiHeadAttention
from qkv.models import BertConfig, BertModel, Transformer, TransformerConfig
from tests.analysis.inspection.heads_helpers import make_bert_pair, random_ids
from tests.layers.helpers import randomize_

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    return make_bert_pair(tmp_path_factory.mktemp("bert"))


def test_cosine_similarity_of_one_layer_matches_f_cosine_similarity_on_nn_multihead_attention():
    """Embed "the cat sat on mat", causal self-attention with E=64 and 4 heads, then
    nn.functional.cosine_similarity(x[0], output[0], dim=-1)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(5, 64)
    reference = randomize_(nn.MultiheadAttention(64, 4, batch_first=True), std=0.1).eval()
    ours = MultiHeadAttention.from_torch(reference).eval()
    x = embedding(torch.tensor([[0, 1, 2, 3, 4]])).detach()  # (1, 5, 64)
    blocked = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # True = may not attend
    with torch.no_grad():
        output, _ = reference(x, x, x, attn_mask=blocked)
    expected = nn.functional.cosine_similarity(x[0], output[0], dim=-1)  # (5,)
    got = position_cosine_similarity(ours, x, causal=True)
    assert got.shape == (1, 5)
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-6)


def test_cosine_similarity_per_layer_matches_transformers_bert(bert_pair):
    """Layer l's attention reads hidden_states[l] and writes attention.output.dense's output
    (before dropout, residual and LayerNorm) in transformers' BertModel."""
    theirs, ours, _, batches = bert_pair
    ids, mask, segments, _ = batches[0]
    written = []
    hooks = [
        layer.attention.output.dense.register_forward_hook(lambda m, a, out: written.append(out))
        for layer in theirs.bert.encoder.layer
    ]
    with torch.no_grad():
        states = theirs.bert(
            input_ids=ids, attention_mask=mask, token_type_ids=segments, output_hidden_states=True
        ).hidden_states
    for hook in hooks:
        hook.remove()
    expected = torch.stack([F.cosine_similarity(states[i], written[i], dim=-1) for i in (0, 1)])
    got = position_cosine_similarity(ours, ids, attention_mask=mask, token_type_ids=segments)
    assert list(got) == ["bert.0.self", "bert.1.self"]
    torch.testing.assert_close(torch.stack(list(got.values())), expected, rtol=0, atol=1e-5)


def test_cosine_similarity_of_self_and_cross_attention_matches_nn_transformer():
    torch.manual_seed(0)
    reference = randomize_(
        nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True), seed=3
    ).eval()
    config = TransformerConfig.from_name("transformer-tiny", dropout=0.0, max_positions=16)
    model = Transformer.from_torch(reference, config).eval()
    src, tgt = random_ids(128, (2, 7), 0), random_ids(128, (2, 5), 1)
    captured = []

    def capture(module, args, output):
        captured.append(F.cosine_similarity(args[0], output[0], dim=-1))

    attentions = [layer.self_attn for layer in reference.encoder.layers]
    for layer in reference.decoder.layers:
        attentions += [layer.self_attn, layer.multihead_attn]  # in the order they run
    hooks = [attention.register_forward_hook(capture) for attention in attentions]
    # With gradients on, nn.Transformer takes its slow path, which calls the hooked modules.
    causal = qkv.masks.to_torch_attn_mask(qkv.masks.causal(5))
    reference(model.embed_source(src), model.embed_target(tgt), tgt_mask=causal)
    for hook in hooks:
        hook.remove()
    got = position_cosine_similarity(model, src, decoder_input_ids=tgt)
    names = ["encoder.0.self", "encoder.1.self", "decoder.0.self", "decoder.0.cross",
             "decoder.1.self", "decoder.1.cross"]  # fmt: skip
    assert list(got) == names
    for name, expected in zip(names, captured, strict=True):
        torch.testing.assert_close(got[name], expected.detach(), rtol=0, atol=1e-5, msg=name)


def test_a_shared_layer_gives_one_entry_per_call():
    """ALBERT-style sharing: one block applied twice equals two identical blocks."""
    shared = randomize_(BertModel(BertConfig.from_name("tiny", share_layers=True)))
    unshared = BertModel(BertConfig.from_name("tiny")).eval()
    shared.eval()
    state = shared.state_dict()
    state.update(
        {k.replace("layers.0.", "layers.1."): v for k, v in state.items() if "layers.0." in k}
    )
    unshared.load_state_dict(state)
    ids = random_ids(128, (2, 6), 0)
    got = position_cosine_similarity(shared, ids)
    expected = position_cosine_similarity(unshared, ids)
    assert list(got) == ["layers.0.self", "layers.0.self#1"]
    torch.testing.assert_close(list(got.values()), list(expected.values()), rtol=0, atol=1e-6)
