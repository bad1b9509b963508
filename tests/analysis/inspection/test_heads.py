"""Head gates, importance and pruning against outside references.

- the gate gradient against a numerical derivative (central difference of the loss with the
  head's out_proj columns scaled, plain torch, float64) and against the gradient of an explicit
  re-implementation of multi-head attention with Michel et al.'s per-head mask xi_h;
- gates at 1.0 leave every model bit-identical; a pruned head equals zeroed out_proj columns;
- BERT: pruning equals transformers' BertModel physically pruned with its `prune_linear_layer`
  (what its `prune_heads` did), and importance equals the head-mask gradient of transformers'
  bertology example, run on transformers' own BERT with a head mask on its eager attention;
- pruning curves remove exactly the least important heads (all heads gone = zeroed out_proj
  weights), and on a model trained in the test fall from accuracy 1.0 to chance.
Per-position cosine similarity is in test_head_similarity.py.
"""

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.bert.modeling_bert import eager_attention_forward
from transformers.pytorch_utils import prune_linear_layer

from qkv.analysis.inspection.heads import (
    head_gates,
    head_importance,
    prune_heads,
    pruning_curve,
)
from qkv.layers import MultiHeadAttention
from qkv.models import GPT, BertConfig, BertModel, GPTConfig, Transformer, TransformerConfig
from tests.analysis.inspection.heads_helpers import make_bert_pair, random_ids
from tests.layers.helpers import randomize_

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread: on a machine with few cores, shared with other work, two OpenMP threads can
    wait on each other and make the training below far slower. Nothing here asserts a time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- models and their inputs


def _bert():
    torch.manual_seed(0)
    return randomize_(BertModel(BertConfig.from_name("tiny", dropout=0.0, attention_dropout=0.0)))


def _gpt(name, dtype=torch.float32):
    torch.manual_seed(0)
    return randomize_(GPT(GPTConfig.from_name(name)), std=0.2).to(dtype).eval()


def _transformer(dtype=torch.float32):
    torch.manual_seed(0)
    config = TransformerConfig.from_name("transformer-tiny", dropout=0.0, label_smoothing=0.0)
    return randomize_(Transformer(config), std=0.2).to(dtype).eval()


def _run(kind, model, seed=0):
    """The model's output tensor on a fixed batch."""
    if kind == "transformer":
        src, tgt = random_ids(128, (2, 7), seed), random_ids(128, (2, 5), seed + 1)
        return model(src, decoder_input_ids=tgt).logits
    if kind == "bert":
        return model(random_ids(128, (2, 9), seed)).last_hidden_state
    return model(random_ids(100, (2, 9), seed)).logits


def _loss(kind, model, seed):
    """Next-token cross-entropy in the model's dtype (the models' own losses compute in fp32)."""
    if kind == "transformer":
        src, labels = random_ids(128, (2, 7), seed), random_ids(128, (2, 5), seed + 1)
        decoder_input_ids = torch.cat([torch.ones(2, 1, dtype=torch.long), labels[:, :-1]], 1)
        logits = model(src, decoder_input_ids=decoder_input_ids).logits
    else:
        ids = random_ids(100, (2, 9), seed)
        logits, labels = model(ids[:, :-1]).logits, ids[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


MODELS = {  # name: (kind for _run / _loss, builder)
    "bert": ("bert", _bert),
    "gpt2": ("gpt", lambda: _gpt("tiny-gpt2")),
    "llama-gqa": ("gpt", lambda: _gpt("tiny-llama")),
    "transformer": ("transformer", _transformer),
}

# (module path, qkv name, heads): paths are used by the plain-torch reference, names by qkv.
PRUNED = {
    "bert": [
        ("layers.0.self_attn", "layers.0.self", [1]),
        ("layers.1.self_attn", "layers.1.self", [0, 3]),
    ],
    "gpt2": [("blocks.1.self_attn", "blocks.1.self", [2])],
    "llama-gqa": [
        ("blocks.0.self_attn", "blocks.0.self", [0, 1]),
        ("blocks.1.self_attn", "blocks.1.self", [3]),
    ],
    "transformer": [
        ("encoder.blocks.1.self_attn", "encoder.1.self", [0]),
        ("decoder.blocks.0.self_attn", "decoder.0.self", [2, 3]),
        ("decoder.blocks.1.cross_attn", "decoder.1.cross", [1]),
    ],
}


def _scale_head_columns_(attention, head, factor):
    """Multiply head `head`'s columns of out_proj.weight by `factor`, in place (plain torch)."""
    D = attention.head_dim
    with torch.no_grad():
        attention.out_proj.weight[:, head * D : (head + 1) * D] *= factor


# ---------------------------------------------------------------- gates and pruning


@pytest.mark.parametrize("key", MODELS)
def test_gates_at_one_leave_the_model_bit_identical(key):
    kind, build = MODELS[key]
    model = build()
    with torch.no_grad():
        expected = _run(kind, model)
        with head_gates(model) as gates:
            gated = _run(kind, model)
        after = _run(kind, model)
    assert {name for _, name, _ in PRUNED[key]} <= set(gates.names())
    assert torch.equal(gated, expected)
    assert torch.equal(after, expected)
    assert all(not m._forward_pre_hooks for m in model.modules())  # the hooks are gone


@pytest.mark.parametrize("key", MODELS)
def test_pruned_heads_equal_zeroed_out_proj_columns(key):
    kind, build = MODELS[key]
    model = build()
    reference = copy.deepcopy(model)
    modules = dict(reference.named_modules())
    for path, _, heads in PRUNED[key]:
        for head in heads:
            _scale_head_columns_(modules[path], head, 0.0)
    with torch.no_grad():
        original = _run(kind, model)
        expected = _run(kind, reference)
        gates = prune_heads(model, {name: heads for _, name, heads in PRUNED[key]})
        pruned = _run(kind, model)
        gates.remove()
        restored = _run(kind, model)
    assert not torch.allclose(expected, original, atol=1e-3)  # the pruned heads mattered
    torch.testing.assert_close(pruned, expected, rtol=0, atol=1e-6)
    assert torch.equal(restored, original)


# ---------------------------------------------------------------- importance: the gradient


@pytest.mark.parametrize("key", ["gpt2", "transformer"])
def test_gate_gradient_equals_a_central_difference(key):
    """dL/d xi_h = (L(W_o^(h) (1 + eps)) - L(W_o^(h) (1 - eps))) / (2 eps), float64: scaling a
    head's out_proj columns is scaling its output. Cross-attention heads included."""
    model = _gpt("tiny-gpt2", torch.float64) if key == "gpt2" else _transformer(torch.float64)
    kind, eps = MODELS[key][0], 1e-6
    with head_gates(model, requires_grad=True) as gates:
        _loss(kind, model, seed=3).backward()
    modules = {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    assert len(modules) == len(gates) == (2 if key == "gpt2" else 6)
    for attention, name in zip(modules.values(), gates.names(), strict=True):
        numerical = []
        for head in range(attention.num_heads):
            with torch.no_grad():
                _scale_head_columns_(attention, head, 1 + eps)
                plus = _loss(kind, model, seed=3)
                _scale_head_columns_(attention, head, (1 - eps) / (1 + eps))
                minus = _loss(kind, model, seed=3)
                _scale_head_columns_(attention, head, 1 / (1 - eps))
            numerical.append((plus - minus) / (2 * eps))
        torch.testing.assert_close(gates[name].grad, torch.stack(numerical), rtol=1e-5, atol=1e-9)
    # head_importance: the mean over batches of |dL/d xi_h|.
    scores = head_importance(model, [3, 5], lambda m, seed: _loss(kind, m, seed), normalize=False)
    with head_gates(model, requires_grad=True) as gates:
        _loss(kind, model, seed=5).backward()
        second = {name: gates[name].grad for name in gates}
    with head_gates(model, requires_grad=True) as gates:
        _loss(kind, model, seed=3).backward()
        for name in gates:
            expected = (gates[name].grad.abs() + second[name].abs()) / 2
            torch.testing.assert_close(scores[name], expected, rtol=1e-12, atol=0)


def _explicit_masked_attention(module, x, xi):
    """Multi-head causal attention written out with a per-head mask: head h's output times xi[h]
    (Michel et al. 2019, eq. 1), then the output projection. GQA: each K/V head serves its group."""
    B, L, _ = x.shape
    H, H_kv, D = module.num_heads, module.num_kv_heads, module.head_dim
    q = F.linear(x, module.q_proj.weight, module.q_proj.bias).view(B, L, H, D).transpose(1, 2)
    k = F.linear(x, module.k_proj.weight, module.k_proj.bias).view(B, L, H_kv, D).transpose(1, 2)
    v = F.linear(x, module.v_proj.weight, module.v_proj.bias).view(B, L, H_kv, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // H_kv, dim=1), v.repeat_interleave(H // H_kv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, L, L)
    future = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    heads = (weights @ v) * xi[None, :, None, None]  # (B, H, L, D)
    concatenated = heads.transpose(1, 2).reshape(B, L, H * D)
    return F.linear(concatenated, module.out_proj.weight, module.out_proj.bias)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_importance_equals_the_gradient_of_an_explicit_head_mask(num_kv_heads):
    module = randomize_(MultiHeadAttention(16, 4, num_kv_heads), seed=1).double()
    generator = torch.Generator().manual_seed(2)
    inputs = [torch.randn(2, 6, 16, generator=generator, dtype=torch.float64) for _ in range(3)]
    target = torch.randn(2, 6, 16, generator=generator, dtype=torch.float64)
    gradients = []
    for x in inputs:
        xi = torch.ones(4, dtype=torch.float64, requires_grad=True)
        output = _explicit_masked_attention(module, x, xi)
        torch.testing.assert_close(output, module(x, causal=True))  # the same attention
        ((output - target) ** 2).mean().backward()
        gradients.append(xi.grad)

    def loss_fn(model, x):
        return ((model(x, causal=True) - target) ** 2).mean()

    raw = head_importance(module, inputs, loss_fn, normalize=False)
    assert list(raw) == ["attention"]  # a bare module is named "attention"
    expected = torch.stack(gradients).abs().mean(dim=0)
    torch.testing.assert_close(raw["attention"], expected, rtol=1e-10, atol=1e-14)
    normalized = head_importance(module, inputs, loss_fn)["attention"]
    torch.testing.assert_close(normalized, expected / expected.norm(), rtol=1e-10, atol=0)


# ---------------------------------------------------------------- BERT against transformers


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    return make_bert_pair(tmp_path_factory.mktemp("bert"))


def _hf_prune_heads_(attention, heads):
    """transformers' BertAttention.prune_heads (removed in v5), with its prune_linear_layer:
    drop the heads' rows of query/key/value and columns of the output dense layer."""
    self_attention, D = attention.self, attention.self.attention_head_size
    keep = [h for h in range(self_attention.num_attention_heads) if h not in heads]
    index = torch.cat([torch.arange(h * D, (h + 1) * D) for h in keep])
    for name in ("query", "key", "value"):
        setattr(self_attention, name, prune_linear_layer(getattr(self_attention, name), index))
    attention.output.dense = prune_linear_layer(attention.output.dense, index, dim=1)
    self_attention.num_attention_heads, self_attention.all_head_size = len(keep), len(keep) * D


def test_bert_pruning_equals_transformers_physically_pruned_model(bert_pair):
    theirs, ours, _, batches = bert_pair
    heads_to_prune = {0: [1], 1: [0, 2, 3]}
    pruned = copy.deepcopy(theirs.bert)
    for layer, heads in heads_to_prune.items():
        _hf_prune_heads_(pruned.encoder.layer[layer].attention, heads)
    assert sum(p.numel() for p in pruned.parameters()) < sum(
        p.numel() for p in theirs.bert.parameters()
    )
    ids, mask, segments, _ = batches[0]
    with torch.no_grad():
        expected = pruned(input_ids=ids, attention_mask=mask, token_type_ids=segments)
        unpruned = ours.bert(ids, mask, segments).last_hidden_state
        names = {f"bert.{layer}.self": heads for layer, heads in heads_to_prune.items()}
        with prune_heads(ours, names):
            got = ours.bert(ids, mask, segments)
    assert not torch.allclose(unpruned, expected.last_hidden_state, atol=1e-2)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, atol=1e-5, rtol=0)


_HEAD_MASK = {}


def _head_masked_eager(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager BERT attention with the v4 `head_mask` put back: head h of layer l
    scaled by head_mask[l, h] (v4 scaled the probabilities, which scales the head's output)."""
    output, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    mask = _HEAD_MASK["head_mask"][module.layer_idx]  # (H,)
    return output * mask[None, None, :, None], weights  # output (B, L, H, D)


def test_bert_importance_equals_bertology_head_mask_gradient(bert_pair):
    """transformers' bertology example (compute_heads_importance): |d loss / d head_mask| summed
    over batches, divided by the token count, then each layer over its L2 norm. (The example
    never zeroes head_mask.grad between batches, so beyond one batch it sums running totals;
    here it is zeroed, which is Michel et al.'s eq. 2.)"""
    _, ours, path, batches = bert_pair
    AttentionInterface.register("head_masked_eager", _head_masked_eager)
    AttentionMaskInterface.register("head_masked_eager", eager_mask)  # eager's additive mask
    theirs = transformers.BertForSequenceClassification.from_pretrained(
        path, attn_implementation="head_masked_eager"
    ).eval()
    head_mask = torch.ones(2, 4, requires_grad=True)
    _HEAD_MASK["head_mask"] = head_mask
    importance, total_tokens = torch.zeros(2, 4), 0.0
    for ids, mask, segments, labels in batches:
        theirs(
            input_ids=ids, attention_mask=mask, token_type_ids=segments, labels=labels
        ).loss.backward()
        importance += head_mask.grad.abs()
        head_mask.grad = None
        total_tokens += float(mask.sum())
    raw = importance / total_tokens
    expected = raw / raw.pow(2).sum(-1).pow(0.5).unsqueeze(-1)

    def loss_fn(model, batch):
        ids, mask, segments, labels = batch
        return model(ids, mask, segments, labels=labels).loss

    got = head_importance(ours, batches, loss_fn)
    assert all(p.grad is None for p in ours.parameters())  # only the gates got gradients
    assert list(got) == ["bert.0.self", "bert.1.self"]
    torch.testing.assert_close(torch.stack(list(got.values())), expected, rtol=1e-4, atol=1e-6)
    unnormalized = head_importance(ours, batches, loss_fn, normalize=False)
    scale = total_tokens / len(batches)  # the mean over batches instead of over tokens
    torch.testing.assert_close(
        torch.stack(list(unnormalized.values())) / scale, raw, rtol=1e-4, atol=1e-9
    )


# ---------------------------------------------------------------- pruning curves


def test_pruning_curve_prunes_the_least_important_heads_at_each_fraction():
    model = _gpt("tiny-llama")
    scores = head_importance(model, [1, 2], lambda m, seed: _loss("gpt", m, seed))

    def evaluate(m):
        with torch.no_grad():
            return _loss("gpt", m, seed=7).item()

    baseline = evaluate(model)
    silenced = copy.deepcopy(model)
    for block in silenced.blocks:
        with torch.no_grad():
            block.self_attn.out_proj.weight.zero_()
    steps = pruning_curve(model, scores, evaluate, fractions=[0.0, 0.25, 0.5, 1.0])
    assert [s.fraction for s in steps] == [0.0, 0.25, 0.5, 1.0]
    assert [s.num_pruned for s in steps] == [0, 2, 4, 8]
    flat = sorted(((float(v), n, h) for n, s in scores.items() for h, v in enumerate(s)))
    for step in steps:
        pruned = {(n, h) for n, heads in step.pruned.items() for h in heads}
        assert pruned == {(n, h) for _, n, h in flat[: step.num_pruned]}
    assert steps[0].metric == baseline and steps[0].pruned == {}
    assert steps[-1].metric == pytest.approx(evaluate(silenced), abs=1e-6)
    assert evaluate(model) == baseline  # restored


def test_pruning_curve_of_a_trained_model_falls_from_perfect_to_chance():
    """A 2-layer GPT trained in the test to output the previous token (accuracy 1.0): the
    accuracy stays at 1.0 with the least important quarter of the heads removed, never rises by
    more than noise as more go, and falls to about chance (1/16) with all of them gone."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny-gpt2", vocab_size=16, max_positions=16))
    generator = torch.Generator().manual_seed(0)

    def batch(size):
        return torch.randint(0, 16, (size, 12), generator=generator)

    def loss_fn(m, ids):  # position t predicts the token at t - 1
        return F.cross_entropy(m(ids).logits[:, 1:].reshape(-1, 16), ids[:, :-1].reshape(-1))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        loss_fn(model, batch(32)).backward()
        optimizer.step()
    model.eval()
    test = batch(64)

    def accuracy(m):
        with torch.no_grad():
            return (m(test).logits[:, 1:].argmax(-1) == test[:, :-1]).float().mean().item()

    scores = head_importance(model, [batch(32) for _ in range(4)], loss_fn)
    steps = pruning_curve(model, scores, accuracy, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert [s.num_pruned for s in steps] == [0, 2, 4, 6, 8]
    metrics = [s.metric for s in steps]
    assert metrics[:2] == [1.0, 1.0]
    assert all(later <= earlier + 0.02 for earlier, later in itertools.pairwise(metrics))
    assert metrics[-1] < 0.2
    assert accuracy(model) == 1.0  # restored


# ---------------------------------------------------------------- errors


def test_bad_arguments_name_what_was_expected():
    model = _gpt("tiny-gpt2")
    with pytest.raises(ValueError, match="heads_to_prune: 'blocks.9.self'"):
        prune_heads(model, {"blocks.9.self": [0]})
    with pytest.raises(ValueError, match=r"expected ints in \[0, 4\)"):
        prune_heads(model, {"blocks.0.self": [4]})
    assert all(not m._forward_pre_hooks for m in model.modules())  # nothing left behind
    with pytest.raises(ValueError, match="batches: got no batch"):
        head_importance(model, [], lambda m, b: m(b).logits.sum())
    with pytest.raises(ValueError, match="loss_fn: expected it to return a scalar"):
        head_importance(model, [random_ids(100, (1, 4), 0)], lambda m, b: m(b).logits)
    scores = {"blocks.0.self": torch.ones(4), "blocks.1.self": torch.ones(4)}
    with pytest.raises(ValueError, match=r"fractions: expected floats in \[0, 1\], got 1.5"):
        pruning_curve(model, scores, lambda m: 0.0, [0.5, 1.5])
    with pytest.raises(ValueError, match="importance: expected scores for exactly"):
        pruning_curve(model, {"blocks.0.self": torch.ones(4)}, lambda m: 0.0, [0.5])
    with pytest.raises(ValueError, match="has no qkv MultiHeadAttention"):
        head_gates(nn.Linear(2, 2))
