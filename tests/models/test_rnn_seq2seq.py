"""The GRU encoder-decoders (qkv.models.RNNSeq2Seq): shapes, masks, the encoder against
torch.nn.GRU, the loss against F.cross_entropy, step-by-step decoding against teacher forcing,
where each kind attends from, and a tiny overfit decoded greedily."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from qkv.models import RNNSeq2Seq, RNNSeq2SeqConfig
from qkv.models.rnn_seq2seq import ATTENTION_KINDS

V = 13
PAD, BOS, EOS = 0, 1, 2


def _model(kind: str, **sizes) -> RNNSeq2Seq:
    torch.manual_seed(0)
    config = RNNSeq2SeqConfig(
        src_vocab_size=V, tgt_vocab_size=V, attention=kind, embed_dim=8, hidden_size=6,
        attention_dim=5, **sizes,
    )  # fmt: skip
    return RNNSeq2Seq(config).double().eval()


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, V, (3, 6), generator=generator)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:], mask[2, 2:] = False, False
    input_ids = input_ids.masked_fill(~mask, PAD)
    labels = torch.randint(3, V, (3, 5), generator=generator)
    labels[1, 3:] = -100
    return input_ids, mask, labels


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_shapes_alignments_and_padding_invariance(kind):
    model = _model(kind)
    input_ids, mask, labels = _batch()
    out = model(input_ids, mask, labels=labels)
    assert out.logits.shape == (3, 5, V) and out.encoder_last_hidden_state.shape == (3, 6, 12)
    if kind == "none":
        assert out.alignments is None
    else:
        assert out.alignments.shape == (3, 5, 6)
        torch.testing.assert_close(out.alignments.sum(-1), torch.ones(3, 5, dtype=torch.float64))
        assert out.alignments[2, :, 2:].abs().max() == 0  # padding gets no weight
    longer_ids = torch.cat([input_ids, torch.full((3, 3), PAD)], dim=1)  # more padding
    longer_mask = torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], dim=1)
    again = model(longer_ids, longer_mask, labels=labels)
    torch.testing.assert_close(again.logits, out.logits, rtol=0, atol=1e-12)


def test_encoder_equals_torch_gru_on_packed_sequences():
    model = _model("none", num_encoder_layers=2)
    input_ids, mask, _ = _batch()
    reference = nn.GRU(8, 6, num_layers=2, bidirectional=True, batch_first=True).double()
    reference.load_state_dict(model.encoder.state_dict())
    embedded = model.source_embedding(input_ids)
    lengths = mask.sum(1)
    packed = pack_padded_sequence(embedded, lengths, batch_first=True, enforce_sorted=False)
    _, h_n = reference(packed)
    state = model.encode(input_ids, mask)
    torch.testing.assert_close(state.summary, torch.cat([h_n[-2], h_n[-1]], dim=-1))
    expected_hidden = torch.tanh(model.initial_state(state.summary))
    torch.testing.assert_close(state.hidden, expected_hidden)


def test_loss_equals_torch_label_smoothed_cross_entropy():
    model = _model("general", label_smoothing=0.1)
    input_ids, mask, labels = _batch()
    out = model(input_ids, mask, labels=labels)
    expected = F.cross_entropy(
        out.logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1
    )
    assert out.loss.dtype == torch.float32  # the loss is computed in float32
    torch.testing.assert_close(out.loss, expected.float())


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_step_by_step_decoding_equals_teacher_forcing(kind):
    model = _model(kind)
    input_ids, mask, labels = _batch()
    decoder_input_ids = torch.randint(3, V, (3, 4), generator=torch.Generator().manual_seed(3))
    full = model(input_ids, mask, decoder_input_ids=decoder_input_ids)
    state = model.encode(input_ids, mask)
    steps = [model.decode(decoder_input_ids[:, i : i + 1], state) for i in range(4)]
    torch.testing.assert_close(torch.cat([s[0] for s in steps], 1), full.logits, rtol=0, atol=1e-12)
    if kind != "none":
        weights = torch.cat([s[1] for s in steps], 1)
        torch.testing.assert_close(weights, full.alignments, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["additive", "dot"])
def test_additive_attends_from_the_previous_state_luong_from_the_current_one(kind):
    # Bahdanau et al.: c_1 comes from s_0, before y_0 is read; Luong et al.: from s_1, after
    model = _model(kind)
    input_ids, mask, _ = _batch()
    first = model(input_ids, mask, decoder_input_ids=torch.full((3, 1), BOS)).alignments
    other = model(input_ids, mask, decoder_input_ids=torch.full((3, 1), 7)).alignments
    assert torch.equal(first, other) == (kind == "additive")


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_tiny_overfit_then_greedy_decoding_reproduces_the_targets(kind):
    # four sources, each target the source reversed: the order must be learned
    sources = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 3, 4], [5, 9]]
    input_ids = torch.zeros(4, 5, dtype=torch.long)
    labels = torch.full((4, 6), -100)
    for row, source in enumerate(sources):
        input_ids[row, : len(source)] = torch.tensor(source)
        labels[row, : len(source) + 1] = torch.tensor([*source[::-1], EOS])
    torch.manual_seed(0)
    config = RNNSeq2SeqConfig(
        src_vocab_size=V, tgt_vocab_size=V, attention=kind, embed_dim=16, hidden_size=16,
        attention_dim=16, share_embeddings=True,
    )  # fmt: skip
    model = RNNSeq2Seq(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(30):
        loss = model(input_ids, input_ids != PAD, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    sequences, alignments = model.eval().greedy_decode(
        input_ids, input_ids != PAD, max_new_tokens=8
    )
    assert sequences[:, 0].eq(BOS).all()
    for row, source in enumerate(sources):
        expected = [*source[::-1], EOS]
        assert sequences[row, 1 : len(expected) + 1].tolist() == expected
        assert sequences[row, len(expected) + 1 :].eq(PAD).all()  # padded after [EOS]
        if alignments is not None:
            assert alignments[row, len(expected) :].abs().sum() == 0  # after [EOS]
            assert alignments[row, : len(expected), len(source) :].abs().sum() == 0  # padding


def test_greedy_tokens_are_the_argmax_of_teacher_forcing_on_them():
    model = _model("additive")
    input_ids, mask, _ = _batch()
    sequences, alignments = model.greedy_decode(input_ids, mask, max_new_tokens=4)
    out = model(input_ids, mask, decoder_input_ids=sequences[:, :-1])
    alive = torch.ones(3, dtype=torch.bool)
    for step in range(sequences.shape[1] - 1):
        chosen = out.logits[:, step].argmax(-1)
        assert torch.equal(sequences[alive, step + 1], chosen[alive])
        expected = out.alignments[:, step] * alive[:, None]  # zeros once a row has ended
        torch.testing.assert_close(alignments[:, step], expected, rtol=0, atol=1e-12)
        alive &= chosen != EOS


def test_bad_configs_and_inputs_name_the_argument():
    with pytest.raises(ValueError, match="attention: expected one of"):
        RNNSeq2SeqConfig(src_vocab_size=V, tgt_vocab_size=V, attention="concat")
    with pytest.raises(ValueError, match="share_embeddings"):
        RNNSeq2SeqConfig(src_vocab_size=V, tgt_vocab_size=V + 1, share_embeddings=True)
    with pytest.raises(ValueError, match="eos_token_id"):
        RNNSeq2SeqConfig(src_vocab_size=2, tgt_vocab_size=2)
    model = _model("dot")
    input_ids, mask, _ = _batch()
    with pytest.raises(ValueError, match="attention_mask: expected right padding"):
        model(input_ids, mask.flip(1), decoder_input_ids=input_ids)
    with pytest.raises(ValueError, match="decoder_input_ids: got None"):
        model(input_ids, mask)
    with pytest.raises(ValueError, match="input_ids: expected ids in"):
        model(input_ids + V, mask, decoder_input_ids=input_ids)
