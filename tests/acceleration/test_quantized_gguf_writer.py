"""`save_gguf` of a model whose layers are quantized already (`qkv.quantize`,
`quantized_from_gguf`): each layer's blocks are written as they are, in its own kind, and read
back (by the gguf package, the outside reference, and by qkv) as the same blocks, the same
weights and the same logits. SmolLM2's file read by `quantized_from_gguf` and written again
holds the shipped file's tensors byte for byte."""

import gguf
import numpy as np
import pytest
import torch

from qkv.acceleration import quantize, quantized_from_gguf
from qkv.acceleration.quantized import QuantizedLinear
from qkv.models import GPT, GPTConfig
from qkv.models.gguf import read_gguf
from qkv.models.gguf.writer import save_gguf
from qkv.positional import half_split_to_interleaved

TINY = GPTConfig(vocab_size=96, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 ffn_dim=128, max_positions=64, position="rope", norm="rmsnorm", ffn="swiglu",
                 bias=False, tie_embeddings=False)  # fmt: skip


def _quantized_tiny(kind: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return quantize(model, kind)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_layers_are_written_as_their_own_blocks(tmp_path, kind):
    """Every quantized linear's blocks in the file (q/k rows in llama.cpp's RoPE order), its
    kind as the tensor's type, the output layer in Q8_0 (`quantize`'s head_kind); what the gguf
    package dequantizes is the layer's weight; read back by `quantized_from_gguf`, the model
    gives the same logits."""
    model = _quantized_tiny(kind)
    path = save_gguf(model, tmp_path / f"tiny-{kind}.gguf")
    stored = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    layers = {
        "blk.1.attn_q.weight": (model.blocks[1].self_attn.q_proj, TINY.num_heads),
        "blk.1.attn_k.weight": (model.blocks[1].self_attn.k_proj, TINY.num_kv_heads),
        "blk.1.ffn_down.weight": (model.blocks[1].ffn.down_proj, None),
        "output.weight": (model.lm_head, None),
    }
    for name, (layer, heads) in layers.items():
        assert isinstance(layer, QuantizedLinear)
        blocks, weight = layer.row_blocks(), layer.dequantized_weight()
        if heads is not None:  # the file's rows in llama.cpp's adjacent-pair order
            blocks, weight = (half_split_to_interleaved(t, heads) for t in (blocks, weight))
        tensor = stored[name]
        assert tensor.tensor_type.name == ("Q8_0" if name == "output.weight" else kind)
        assert np.array_equal(np.asarray(tensor.data), blocks.numpy())
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert torch.equal(torch.from_numpy(np.array(theirs, dtype=np.float32)), weight)
    assert stored["token_embd.weight"].tensor_type.name == "F32"  # the float embedding
    assert gguf.GGUFReader(path).fields["general.file_type"].contents() == {
        "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}[kind]  # fmt: skip
    again = quantized_from_gguf(path)
    ids = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_smollm2_read_quantized_and_written_again_is_the_shipped_file(smollm2_file, tmp_path):
    """Every tensor of the shipped Q4_1 file (its Q8_0 embedding tied to the output layer, its
    F32 norms), byte for byte, under the same names and types; the tokenizer's keys passed on."""
    model = quantized_from_gguf(smollm2_file)
    keys = {k: v for k, v in smollm2_file.metadata.items() if k.startswith("tokenizer.")}
    written = read_gguf(save_gguf(model, tmp_path / "again.gguf", extra_metadata=keys))
    assert set(written.tensors) == set(smollm2_file.tensors)
    for name, shipped in smollm2_file.tensors.items():
        ours = written.tensors[name]
        assert (ours.kind, ours.shape) == (shipped.kind, shipped.shape), name
        assert np.array_equal(ours.raw, shipped.raw), name
    for key in ("general.file_type", "tokenizer.ggml.tokens", "tokenizer.chat_template"):
        assert written.metadata[key] == smollm2_file.metadata[key], key


def test_gpt2s_fused_attention_is_one_kind_of_blocks(tmp_path):
    """GPT-2's files fuse q, k and v into one attn_qkv: their blocks, rows [q | k | v], where
    the three are of one kind; refused by name where they are not."""
    config = GPTConfig(vocab_size=64, embed_dim=64, num_layers=1, num_heads=2, ffn_dim=128,
                       max_positions=32, position="learned", norm="layernorm",
                       ffn="gelu_tanh", bias=True)  # fmt: skip
    model = quantize(GPT(config).eval(), "Q4_1")
    attention = model.blocks[0].self_attn
    stored = {t.name: t for t in gguf.GGUFReader(save_gguf(model, tmp_path / "a.gguf")).tensors}
    fused = stored["blk.0.attn_qkv.weight"]
    assert fused.tensor_type.name == "Q4_1"
    parts = [getattr(attention, f"{p}_proj").blocks for p in "qkv"]
    assert np.array_equal(np.asarray(fused.data), torch.cat(parts).numpy())
    attention.k_proj = QuantizedLinear.from_linear(torch.nn.Linear(64, 64), "Q8_0")
    with pytest.raises(ValueError, match="model: GPT-2's fused attn_qkv needs q, k and v of one"):
        save_gguf(model, tmp_path / "mixed.gguf")
