"""Warm-up then decay against transformers' schedules; AdamW's groups leave norms and biases be
(the grouping against BERT's names and nanoGPT's dim >= 2 rule)."""

import math
import re

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from qkv.layers import GRU, BatchNorm, LayerNorm, RMSNorm
from qkv.models import BertConfig, BertForPreTraining
from qkv.training import (
    TrainingConfig,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    parameter_groups,
)


@pytest.mark.parametrize(
    ("kind", "reference"),
    [("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)],
)
def test_schedule_equals_transformers_after_warmup_and_is_shifted_by_one_during_it(kind, reference):
    warmup, total = 10, 100
    ours = [
        lr_multiplier(s, warmup_steps=warmup, total_steps=total, kind=kind) for s in range(total)
    ]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = reference(optimizer, warmup, total)
    theirs = []
    for _ in range(total + 1):
        theirs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # warm-up: qkv's step s is transformers' step s + 1 (qkv never spends a step at lr 0)
    assert ours[:warmup] == pytest.approx(theirs[1 : warmup + 1], abs=1e-12)
    assert ours[warmup:] == pytest.approx(theirs[warmup:total], abs=1e-12)


def test_schedule_values_at_chosen_steps():
    values = {
        step: lr_multiplier(step, warmup_steps=4, total_steps=12, kind="linear")
        for step in (0, 1, 3, 4, 8, 11, 12, 20)
    }
    assert values == pytest.approx(
        {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 8: 0.5, 11: 0.125, 12: 0.0, 20: 0.0}
    )
    assert lr_multiplier(8, warmup_steps=4, total_steps=12, kind="cosine") == pytest.approx(0.5)
    assert lr_multiplier(9, warmup_steps=4, total_steps=12, kind="constant") == 1.0


def test_scheduler_drives_the_optimizer_learning_rate():
    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=0.2)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1, 0.2, 0.2, 0.15, 0.1, 0.05])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"warmup_steps": 5, "total_steps": 3}, "warmup_steps"),
        ({"warmup_steps": -1, "total_steps": 3}, "warmup_steps"),
        ({"warmup_steps": 1, "total_steps": 3, "kind": "exp"}, "kind"),
    ],
)
def test_bad_schedules_name_the_argument(arguments, message):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with pytest.raises(ValueError, match=message):
        build_scheduler(optimizer, **arguments)


def test_no_weight_decay_on_norms_and_biases_as_in_bert():
    config = BertConfig(vocab_size=50, embed_dim=16, num_layers=2, num_heads=2, ffn_dim=32)
    model = BertForPreTraining(config)
    decayed, kept = parameter_groups(model, weight_decay=0.1)
    # Hugging Face's BERT recipe by name: no decay for biases and LayerNorm weights
    names = {id(p): n for n, p in model.named_parameters()}
    for parameter in kept["params"]:
        assert "bias" in names[id(parameter)] or "norm" in names[id(parameter)].lower()
    for parameter in decayed["params"]:
        assert parameter.dim() == 2, names[id(parameter)]
    everything = [p for p in model.parameters()]
    assert len(decayed["params"]) + len(kept["params"]) == len(everything)
    assert {id(p) for p in decayed["params"]} | {id(p) for p in kept["params"]} == {
        id(p) for p in everything
    }
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)


def test_adamw_leaves_a_norm_gain_without_gradient_untouched_but_decays_a_matrix():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, learning_rate=0.1, weight_decay=0.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["1.weight"], before["1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(after["0.bias"], before["0.bias"], rtol=0, atol=0)
    torch.testing.assert_close(after["0.weight"], before["0.weight"] * (1 - 0.1 * 0.5))


class _EveryNorm(torch.nn.Module):
    """Embedding, linears, qkv's three norms, a GRU (biases named bias_ih/bias_hh), torch's
    BatchNorm1d and GroupNorm, and the embedding tied to the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = torch.nn.Embedding(11, 6)
        self.batch_norm = BatchNorm(6)
        self.layer_norm = LayerNorm(6)
        self.rms_norm = RMSNorm(6)
        self.gru = GRU(6, 6)
        self.proj = torch.nn.Linear(6, 6)
        self.torch_batch_norm = torch.nn.BatchNorm1d(6)
        self.group_norm = torch.nn.GroupNorm(2, 6)
        self.lm_head = torch.nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.token_embedding.weight


def test_norm_weights_and_every_bias_are_kept_from_decay_as_nanogpt_decides():
    model = _EveryNorm()
    decayed, kept = parameter_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}  # the tied weight once
    decayed_names = sorted(names[id(p)] for p in decayed["params"])
    kept_names = sorted(names[id(p)] for p in kept["params"])
    # nanoGPT's configure_optimizers: decay the parameters with dim >= 2, keep the others
    assert decayed_names == sorted(n for n, p in model.named_parameters() if p.dim() >= 2)
    assert kept_names == sorted(n for n, p in model.named_parameters() if p.dim() < 2)
    assert decayed_names == [
        "gru.weight_hh_l0", "gru.weight_ih_l0", "proj.weight", "token_embedding.weight"
    ]  # fmt: skip
    for norm in ("batch_norm", "layer_norm", "rms_norm", "torch_batch_norm", "group_norm"):
        assert f"{norm}.weight" in kept_names
    assert {"gru.bias_ih_l0", "gru.bias_hh_l0", "proj.bias", "batch_norm.bias"} <= set(kept_names)
    # torch's AdamW with zero gradients moves only the decayed parameters: w <- w (1 - lr wd)
    optimizer = build_optimizer(model, learning_rate=0.1, weight_decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # norms start at ones and zeros: make every value nonzero
            p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if name in decayed_names else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7)


def test_bad_optimizer_arguments():
    with pytest.raises(ValueError, match="learning_rate"):
        build_optimizer(torch.nn.Linear(2, 2), learning_rate=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        build_optimizer(torch.nn.Linear(2, 2), learning_rate=1e-3, weight_decay=-1.0)


def test_warmup_defaults_to_a_share_of_the_steps():
    """warmup_steps None: int(warmup_fraction * steps), at least one step (BERT's 10%)."""
    assert TrainingConfig(steps=800).warmup_steps == 80
    assert TrainingConfig(steps=2000, warmup_fraction=0.2).warmup_steps == 400
    assert TrainingConfig(steps=5).warmup_steps == 1
    assert TrainingConfig(steps=800, warmup_steps=7, warmup_fraction=0.5).warmup_steps == 7
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match="warmup_fraction: expected a number in"):
            TrainingConfig(warmup_fraction=bad)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("learning_rate", math.inf, "learning_rate: expected a finite number > 0, got inf"),
        ("learning_rate", math.nan, "learning_rate: expected a finite number > 0, got nan"),
        ("clip_norm", math.inf, "clip_norm: expected None or a finite number > 0, got inf"),
        ("weight_decay", math.inf, "weight_decay: expected a finite number >= 0, got inf"),
        ("seed", 2**70, "seed: expected an int >= 0 and <= 9223372036854775807"),
    ],
)
def test_values_no_run_can_use_are_refused_by_name(field, value, message):
    """An infinite learning rate gave NaN weights after a step; a seed past int64 failed deep
    inside torch with "Overflow when unpacking long long"."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        TrainingConfig(**{field: value})
