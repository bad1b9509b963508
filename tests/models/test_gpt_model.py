"""GPT's forward contract: the loss against F.cross_entropy written out by hand, and bad input
failing early with errors that name the argument."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.models.gpt import GPT, GPTConfig
from qkv.models.outputs import CausalLMOutput


@pytest.fixture(scope="module")
def gpt2() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny-gpt2")).eval()


@pytest.fixture(scope="module")
def llama() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny-llama")).eval()


def test_output_fields_and_loss_against_cross_entropy(llama):
    """loss = mean over the non-ignored pairs (logits[:, i], labels[:, i + 1])."""
    input_ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[0, 3] = -100
    with torch.no_grad():
        out = llama(input_ids, labels=labels)
    assert isinstance(out, CausalLMOutput)
    assert out.logits.shape == (2, 7, 100) and out.last_hidden_state.shape == (2, 7, 32)
    pairs = [
        (out.logits[b, i], labels[b, i + 1]) for b in range(2) for i in range(6)
        if labels[b, i + 1] != -100
    ]  # fmt: skip
    expected = torch.stack([F.cross_entropy(lg[None], t[None]) for lg, t in pairs]).mean()
    assert len(pairs) == 11
    torch.testing.assert_close(out.loss, expected)


def test_tied_head_shares_storage(gpt2):
    assert gpt2.lm_head.weight is gpt2.token_embedding.weight
    assert gpt2.lm_head.weight.data_ptr() == gpt2.token_embedding.weight.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"input_ids": torch.zeros(2, 3)}, TypeError, "input_ids: expected an integer tensor"),
        ({"input_ids": torch.zeros(3, dtype=torch.long)}, ValueError, r"input_ids: expected shape"),
        ({"input_ids": torch.full((1, 3), 100)}, ValueError, r"token ids in \[0, 100\)"),
        ({"input_ids": torch.full((1, 3), -1)}, ValueError, r"got values in \[-1, -1\]"),
        ({"attention_mask": torch.ones(2, 4)}, ValueError, r"attention_mask: expected shape"),
        ({"attention_mask": torch.ones(2, 3)}, TypeError, "attention_mask: expected a bool or"),
        ({"labels": torch.zeros(2, 2, dtype=torch.long)}, ValueError, "labels: expected shape"),
        ({"labels": torch.zeros(2, 3)}, TypeError, "labels: expected integer token ids"),
        ({"position_ids": torch.zeros(3)}, TypeError, "position_ids: expected an integer"),
        ({"position_ids": torch.zeros(2, 4, dtype=torch.long)}, ValueError, "position_ids:"),
        ({"input_ids": torch.zeros(1, 65, dtype=torch.long)}, ValueError, "max_positions=64"),
    ],
)
def test_bad_input_names_the_argument(gpt2, kwargs, error, message):
    call = {"input_ids": torch.zeros(2, 3, dtype=torch.long), **kwargs}
    with pytest.raises(error, match=message):
        gpt2(**call)


def test_bad_config_type():
    with pytest.raises(TypeError, match="config: expected a GPTConfig, got dict"):
        GPT({"vocab_size": 10})


def test_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny-gpt2", dropout=0.5))
    input_ids = torch.zeros(1, 5, dtype=torch.long)
    model.train()
    assert not torch.equal(model(input_ids).logits, model(input_ids).logits)
    model.eval()
    assert torch.equal(model(input_ids).logits, model(input_ids).logits)
