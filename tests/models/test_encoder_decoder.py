"""The encoder-decoder Transformer against torch.nn.Transformer, the Vaswani et al. 2017 formulas
and F.cross_entropy.

The stacks are proved against `nn.Transformer` with its weights copied; the parts it does not
have (embeddings scaled by sqrt(E), sinusoidal positions, output projection, teacher forcing and
the loss) against the formulas of the paper, computed directly in the test.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.models.encoder_decoder import Transformer, TransformerConfig, shift_right
from tests.layers.helpers import randomize_

# nn.Transformer's own notices about its nested-tensor fast path (used on purpose below).
pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]

E, H, FFN, N_ENC, N_DEC = 32, 4, 64, 2, 3
V_SRC, V_TGT, PAD, BOS, EOS = 40, 50, 0, 1, 2
SRC_LENGTHS, TGT_LENGTHS = torch.tensor([7, 5, 2]), torch.tensor([6, 3, 1])


def _config(**overrides):
    fields = {
        "src_vocab_size": V_SRC,
        "tgt_vocab_size": V_TGT,
        "embed_dim": E,
        "num_heads": H,
        "num_encoder_layers": N_ENC,
        "num_decoder_layers": N_DEC,
        "ffn_dim": FFN,
        "dropout": 0.0,
        "max_positions": 16,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "label_smoothing": 0.1,
    }
    return TransformerConfig(**{**fields, **overrides})


def _ids(lengths, vocab_size, seed):
    """(B, max(lengths)) random ids >= 3, right-padded with PAD, and the (B, L) bool mask."""
    generator = torch.Generator().manual_seed(seed)
    L = int(lengths.max())
    ids = torch.randint(3, vocab_size, (len(lengths), L), generator=generator)
    real = torch.arange(L) < lengths[:, None]  # (B, L)
    return ids.masked_fill(~real, PAD), real


def _reference(norm_first, seed=3):
    reference = nn.Transformer(
        E, H, N_ENC, N_DEC, FFN, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    return randomize_(reference, seed=seed).eval()


# ---------------------------------------------------------------- parity with nn.Transformer


@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_nn_transformer(norm_first):
    reference = _reference(norm_first)
    model = Transformer.from_torch(reference, _config(norm_first=norm_first)).eval()
    src_ids, src_real = _ids(SRC_LENGTHS, V_SRC, seed=4)
    tgt_ids, tgt_real = _ids(TGT_LENGTHS, V_TGT, seed=5)
    src_keys, tgt_keys = src_real[:, None, None, :], tgt_real[:, None, None, :]  # (B, 1, 1, L)
    with torch.no_grad():
        # Both stacks read the same embedded inputs, so the comparison isolates the stacks.
        x, y = model.embed_source(src_ids), model.embed_target(tgt_ids)
        L_tgt = tgt_ids.shape[1]
        expected_memory = reference.encoder(
            x, src_key_padding_mask=qkv.masks.to_torch_key_padding_mask(src_keys)
        )
        expected = reference(
            x,
            y,
            tgt_mask=qkv.masks.to_torch_attn_mask(qkv.masks.causal(L_tgt)),
            src_key_padding_mask=qkv.masks.to_torch_key_padding_mask(src_keys),
            tgt_key_padding_mask=qkv.masks.to_torch_key_padding_mask(tgt_keys),
            memory_key_padding_mask=qkv.masks.to_torch_key_padding_mask(src_keys),
        )
        memory = model.encoder(x, mask=src_keys)
        hidden = model.decoder(y, memory, mask=tgt_keys, memory_mask=src_keys)
        output = model(
            src_ids, src_real, decoder_input_ids=tgt_ids, decoder_attention_mask=tgt_real
        )
    # Under no_grad in eval mode nn.TransformerEncoder takes its "fast path". For post-norm it
    # packs the batch into a nested tensor without the padded positions and unpacks it with
    # zeros there, so a padded row of its memory is LayerNorm(0) = the final norm's bias; for
    # pre-norm the fused layer kernel runs on the padded batch. qkv (like PyTorch's slow path)
    # computes padded rows like any other. Those rows are never read (every later attention
    # masks padded keys), so memory is compared on real tokens only, and the decoder output,
    # which depends on real memory rows only, on every position.
    if not norm_first:
        padded_rows = expected_memory[~src_real]  # (number of padded tokens, E)
        assert torch.equal(padded_rows, reference.encoder.norm.bias.expand_as(padded_rows))
    torch.testing.assert_close(memory[src_real], expected_memory[src_real], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=0)
    # The whole model (embedding, masks from (B, L) attention masks, lm_head) on the same path.
    torch.testing.assert_close(output.logits, model.lm_head(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        output.encoder_last_hidden_state[src_real], expected_memory[src_real], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_matches_nn_transformer_slow_path_on_every_position(norm_first):
    """With gradients on, nn.TransformerEncoder runs its layers plainly: padded rows agree too."""
    reference = _reference(norm_first=norm_first, seed=6)
    model = Transformer.from_torch(reference, _config(norm_first=norm_first)).eval()
    src_ids, src_real = _ids(SRC_LENGTHS, V_SRC, seed=7)
    x = model.embed_source(src_ids)
    expected = reference.encoder(x, src_key_padding_mask=~src_real)
    memory = model.encode(src_ids, src_real)
    torch.testing.assert_close(memory, expected, atol=1e-5, rtol=0)


def test_from_torch_refuses_a_config_that_does_not_match():
    reference = _reference(norm_first=False)
    with pytest.raises(ValueError, match=r"num_decoder_layers=2 but module has 3"):
        Transformer.from_torch(reference, _config(num_decoder_layers=2))
    with pytest.raises(ValueError, match=r"norm_first=True but module has False"):
        Transformer.from_torch(reference, _config(norm_first=True))


# ---------------------------------------------------------------- embeddings (section 3.4, 3.5)


def _vaswani_positions(num_positions, dim):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...), entry by entry."""
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    for pos in range(num_positions):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            table[pos, 2 * i], table[pos, 2 * i + 1] = math.sin(angle), math.cos(angle)
    return table


def test_embedding_is_scaled_by_sqrt_d_model_plus_sinusoids():
    # max_positions=4 < L: positions past the table are computed on the fly and must agree.
    model = Transformer(_config(max_positions=4)).eval()
    src_ids, _ = _ids(torch.tensor([7, 7]), V_SRC, seed=8)
    tgt_ids, _ = _ids(torch.tensor([5, 5]), V_TGT, seed=9)
    positions = _vaswani_positions(7, E)
    for embedded, ids, table in (
        (model.embed_source(src_ids), src_ids, model.source_embedding.weight),
        (model.embed_target(tgt_ids), tgt_ids, model.target_embedding.weight),
    ):
        L = ids.shape[1]
        expected = table.double()[ids] * math.sqrt(E) + positions[:L]
        torch.testing.assert_close(embedded.double(), expected, atol=1e-5, rtol=0)
    assert model.source_embedding.weight is not model.target_embedding.weight


def test_embedding_dropout_acts_in_training_only():
    model = Transformer(_config(dropout=0.5))
    ids, _ = _ids(torch.tensor([6, 6]), V_SRC, seed=10)
    clean = model.eval().embed_source(ids)
    noisy = model.train().embed_source(ids)
    dropped = noisy == 0
    assert 0 < dropped.float().mean() < 1
    torch.testing.assert_close(noisy[~dropped], 2 * clean[~dropped])  # inverted dropout, 1/(1-p)


# ---------------------------------------------------------------- teacher forcing and the loss


def test_shift_right_against_hand_written_decoder_inputs():
    labels = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, -100], [4, EOS, -100, -100]])
    expected = torch.tensor([[BOS, 5, 6, 7], [BOS, 8, 9, EOS], [BOS, 4, EOS, PAD]])
    assert torch.equal(shift_right(labels, bos_token_id=BOS, pad_token_id=PAD), expected)
    assert shift_right(labels[:, :0], bos_token_id=BOS, pad_token_id=PAD).shape == (3, 0)


def test_loss_is_label_smoothed_cross_entropy_over_labelled_positions():
    torch.manual_seed(11)
    model = Transformer(_config(label_smoothing=0.1)).eval()
    src_ids, src_real = _ids(SRC_LENGTHS, V_SRC, seed=12)
    labels, tgt_real = _ids(TGT_LENGTHS, V_TGT, seed=13)
    labels = labels.masked_fill(~tgt_real, -100)
    output = model(src_ids, src_real, labels=labels)
    expected = F.cross_entropy(
        output.logits.reshape(-1, V_TGT), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1
    )
    torch.testing.assert_close(output.loss, expected)
    decoder_input_ids = shift_right(labels, bos_token_id=BOS, pad_token_id=PAD)
    explicit = model(src_ids, src_real, decoder_input_ids=decoder_input_ids)
    assert torch.equal(explicit.logits, output.logits) and explicit.loss is None


def test_loss_is_zero_not_nan_when_no_position_is_labelled():
    model = Transformer(_config())
    src_ids, _ = _ids(torch.tensor([3, 3]), V_SRC, seed=14)
    output = model(src_ids, labels=torch.full((2, 4), -100))
    output.loss.backward()
    assert output.loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_decoder_is_causal_and_autoregressive_decoding_matches_teacher_forcing():
    torch.manual_seed(15)
    model = Transformer(_config()).eval()
    src_ids, src_real = _ids(SRC_LENGTHS, V_SRC, seed=16)
    tgt_ids, _ = _ids(torch.tensor([6, 6, 6]), V_TGT, seed=17)
    with torch.no_grad():
        memory = model.encode(src_ids, src_real)
        logits = model.decode(tgt_ids, memory, memory_mask=src_real)  # (B, L, V)
        changed = tgt_ids.clone()
        changed[:, 4] = (changed[:, 4] + 1) % V_TGT
        after = model.decode(changed, memory, memory_mask=src_real)
        # At inference the decoder sees the prefix only, one token more each step.
        steps = [
            model.decode(tgt_ids[:, : i + 1], memory, memory_mask=src_real)[:, -1]
            for i in range(tgt_ids.shape[1])
        ]
    assert torch.equal(after[:, :4], logits[:, :4])  # earlier positions cannot see position 4
    assert not torch.allclose(after[:, 4:], logits[:, 4:])
    torch.testing.assert_close(torch.stack(steps, dim=1), logits, atol=1e-5, rtol=0)


def test_padded_source_tokens_are_not_attended_to():
    model = Transformer(_config()).eval()
    src_ids, src_real = _ids(SRC_LENGTHS, V_SRC, seed=18)
    tgt_ids, _ = _ids(torch.tensor([4, 4, 4]), V_TGT, seed=19)
    noise = torch.randint(3, V_SRC, src_ids.shape, generator=torch.Generator().manual_seed(20))
    other = torch.where(src_real, src_ids, noise)
    with torch.no_grad():
        first = model(src_ids, src_real, decoder_input_ids=tgt_ids).logits
        second = model(other, src_real, decoder_input_ids=tgt_ids).logits
        unmasked = model(other, decoder_input_ids=tgt_ids).logits
    torch.testing.assert_close(first, second, atol=1e-5, rtol=0)
    assert not torch.allclose(first, unmasked, atol=1e-3)


# ---------------------------------------------------------------- weight tying and size


def _stack_parameters():
    """Parameters of the encoder and decoder stacks with their final norms: nn.Transformer's."""
    reference = nn.Transformer(E, H, N_ENC, N_DEC, FFN, batch_first=True)
    return sum(p.numel() for p in reference.parameters())


def _formula_stack_parameters(E, F, n_enc, n_dec):
    attention = 4 * (E * E + E)  # q, k, v, out projections with biases
    ffn = 2 * E * F + F + E
    norm = 2 * E
    return (
        n_enc * (attention + ffn + 2 * norm) + n_dec * (2 * attention + ffn + 3 * norm) + 2 * norm
    )


@pytest.mark.parametrize(
    ("share", "tie", "embedding_rows"),
    [(True, True, V_TGT), (False, True, V_SRC + V_TGT), (False, False, V_SRC + 2 * V_TGT)],
)
def test_tied_weights_are_one_tensor_and_parameter_count_matches(share, tie, embedding_rows):
    src_vocab = V_TGT if share else V_SRC
    model = Transformer(_config(src_vocab_size=src_vocab, share_embeddings=share, tie_output=tie))
    assert (model.target_embedding.weight is model.lm_head.weight) == tie
    assert (model.source_embedding.weight is model.target_embedding.weight) == share
    count = sum(p.numel() for p in model.parameters())  # parameters() lists a shared one once
    assert _formula_stack_parameters(E, FFN, N_ENC, N_DEC) == _stack_parameters()
    assert count == _stack_parameters() + embedding_rows * E
    model.double()  # casting keeps the tie (the parameter is converted in place)
    assert (model.target_embedding.weight is model.lm_head.weight) == tie


def test_tied_weight_gets_gradient_from_embedding_and_output_projection():
    model = Transformer(_config(tie_output=True)).eval()
    src_ids, _ = _ids(torch.tensor([3]), V_SRC, seed=21)
    tgt = torch.tensor([[5]])
    model(src_ids, decoder_input_ids=tgt).logits[0, 0, 7].backward()
    grad = model.lm_head.weight.grad
    assert grad[7].abs().sum() > 0  # the output row of the scored token
    assert grad[5].abs().sum() > 0  # the embedding row of the input token


@pytest.mark.parametrize(
    ("name", "paper_millions"), [("transformer-base", 65), ("transformer-big", 213)]
)
def test_presets_have_the_papers_sizes(name, paper_millions):
    """Vaswani et al. 2017 Table 3 gives 65M (base) and 213M (big) parameters."""
    config = TransformerConfig.from_name(name)
    with torch.device("meta"):
        model = Transformer(config)
    count = sum(p.numel() for p in model.parameters())
    stacks = _formula_stack_parameters(config.embed_dim, config.ffn_dim, 6, 6)
    assert count == stacks + config.tgt_vocab_size * config.embed_dim
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.05
    assert (config.label_smoothing, config.norm_first, config.num_encoder_layers) == (0.1, False, 6)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"embed_dim": 30}, ValueError, r"embed_dim: 30 is not divisible by num_heads=4"),
        ({"embed_dim": 4, "num_heads": 4, "ffn_dim": 0}, ValueError, r"ffn_dim"),
        ({"dropout": 1.0}, ValueError, r"dropout: .* got 1.0"),
        ({"label_smoothing": -0.1}, ValueError, r"label_smoothing"),
        ({"num_heads": 4.0}, TypeError, r"num_heads: expected a positive int, got float"),
        ({"bos_token_id": V_TGT}, ValueError, rf"bos_token_id: expected an id in \[0, {V_TGT}\)"),
        ({"share_embeddings": True}, ValueError, r"share_embeddings: .*src_vocab_size=40"),
        ({"tie_output": 1}, TypeError, r"tie_output: expected a bool, got int"),
    ],
)
def test_config_errors_name_the_argument(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        _config(**overrides)


def test_config_presets_and_their_errors():
    tiny = TransformerConfig.from_name("transformer-tiny", dropout=0.0)
    assert tiny.dropout == 0.0 and tiny.share_embeddings and tiny.tie_output
    with pytest.raises(ValueError, match=r"name: expected one of .*transformer-base"):
        TransformerConfig.from_name("transformer-huge")
    with pytest.raises(TypeError, match=r"overrides: \['d_model'\] are not fields"):
        TransformerConfig.from_name("transformer-tiny", d_model=64)
    with pytest.raises(ValueError, match=r"tie_output: False contradicts share_embeddings"):
        TransformerConfig.from_name("transformer-tiny", tie_output=False)


def test_call_errors_name_the_argument():
    model = Transformer(_config())
    src_ids, src_real = _ids(torch.tensor([4, 4]), V_SRC, seed=22)
    tgt_ids = torch.full((2, 3), 5)
    with pytest.raises(ValueError, match=r"decoder_input_ids: got None and labels=None"):
        model(src_ids)
    with pytest.raises(TypeError, match=r"attention_mask: .*additive float mask"):
        model(src_ids, src_real.float(), decoder_input_ids=tgt_ids)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 4\), got \(2, 3\)"):
        model(src_ids, src_real[:, :3], decoder_input_ids=tgt_ids)
    with pytest.raises(ValueError, match=rf"input_ids: expected ids in \[0, {V_SRC}\)"):
        model(src_ids + V_SRC, decoder_input_ids=tgt_ids)
    with pytest.raises(ValueError, match=rf"labels: expected ids in \[0, {V_TGT}\)"):
        model(src_ids, labels=tgt_ids + V_TGT)
    with pytest.raises(TypeError, match=r"config: expected a TransformerConfig, got dict"):
        Transformer({"embed_dim": E})
