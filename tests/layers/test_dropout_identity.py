"""Dropout with p = 0 is built as nn.Identity, which does no work per call: the blocks must
still compute what PyTorch's layers with dropout=0 compute, in train mode too, and the modules
keep their names, so state dicts (and checkpoint key maps) do not depend on p."""

import pytest
import torch
from torch import nn

from qkv.layers import DecoderBlock, EncoderBlock
from qkv.models import GPT, BertConfig, BertModel, GPTConfig
from tests.layers.helpers import randomize_

E, H, FFN = 16, 4, 32


def _torch_layer(cls, dropout):
    layer = cls(E, H, dim_feedforward=FFN, dropout=dropout, batch_first=True, norm_first=True)
    return randomize_(layer, seed=3)


@pytest.mark.parametrize(
    ("torch_cls", "qkv_cls"),
    [(nn.TransformerEncoderLayer, EncoderBlock), (nn.TransformerDecoderLayer, DecoderBlock)],
)
def test_p_zero_blocks_match_torch_layers_in_train_mode(torch_cls, qkv_cls):
    reference = _torch_layer(torch_cls, dropout=0.0).train()
    block = qkv_cls.from_torch(reference).train()
    assert isinstance(block.dropout, nn.Identity) and isinstance(block.ffn.dropout, nn.Identity)
    x, memory = torch.randn(2, 5, E), torch.randn(2, 7, E)
    if qkv_cls is EncoderBlock:
        torch.testing.assert_close(block(x), reference(x))
    else:  # PyTorch's decoder layer is causal only when given a mask
        torch.testing.assert_close(block(x, memory, causal=False), reference(x, memory))


def test_positive_p_is_still_dropout():
    block = EncoderBlock.from_torch(_torch_layer(nn.TransformerEncoderLayer, dropout=0.2))
    assert isinstance(block.dropout, nn.Dropout) and block.dropout.p == 0.2
    assert isinstance(block.ffn.dropout, nn.Dropout) and block.ffn.dropout.p == 0.2


@pytest.mark.parametrize(
    "build",
    [
        lambda p: GPT(GPTConfig.from_name("tiny-gpt2", dropout=p)),
        lambda p: BertModel(BertConfig.from_name("tiny", dropout=p)),
    ],
)
def test_state_dict_keys_do_not_depend_on_p(build):
    with_dropout, without = build(0.1), build(0.0)
    assert any(isinstance(m, nn.Dropout) for m in with_dropout.modules())
    assert not any(isinstance(m, nn.Dropout) for m in without.modules())
    assert list(without.state_dict()) == list(with_dropout.state_dict())
    assert [n for n, _ in without.named_modules()] == [n for n, _ in with_dropout.named_modules()]
