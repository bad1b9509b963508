"""Hostile GGUF files: each is refused with a GGUFError that names what is wrong, before anything
large is allocated (the header is walked with struct, never trusted), and a file holds no code
to run (GGUF is data only: no pickle is ever read)."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from qkv.models import GPT, GPTConfig, from_gguf
from qkv.models.gguf import GGUFError, check_gguf, read_gguf
from qkv.models.gguf.writer import save_gguf

CONFIG = GPTConfig(
    vocab_size=64, embed_dim=32, num_layers=1, num_heads=2, ffn_dim=64, max_positions=32
)
MEGABYTE = 1 << 20


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    save_gguf(GPT(CONFIG), path, extra_metadata={"general.name": "tiny"})
    return path.read_bytes()


def _tensor_info_at(data: bytes, name: str) -> int:
    """The offset of tensor `name`'s info record (its name's length field)."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded)


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    size = struct.calcsize("<" + fmt)
    return data[:offset] + struct.pack("<" + fmt, value) + data[offset + size :]


def _dims_offset(data: bytes, name: str) -> int:
    return _tensor_info_at(data, name) + 8 + len(name) + 4  # past the name and the dim count


def _refused(tmp_path: Path, data: bytes, match: str) -> GGUFError:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match=match) as caught:
            from_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * MEGABYTE, f"{peak / MEGABYTE:.0f} MB allocated before the refusal"
    assert str(path) in str(caught.value)
    return caught.value


def test_the_valid_file_loads(tmp_path, valid):
    path = tmp_path / "valid.gguf"
    path.write_bytes(valid)
    assert check_gguf(path) == path
    assert from_gguf(path).config.embed_dim == 32


def test_wrong_magic(tmp_path, valid):
    _refused(tmp_path, b"GGML" + valid[4:], "magic b'GGML'")


def test_unknown_version(tmp_path, valid):
    _refused(tmp_path, _patched(valid, 4, "I", 7), "version 7")


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3, 0.7, 0.999])
def test_truncated_anywhere(tmp_path, valid, fraction):
    _refused(tmp_path, valid[: max(1, int(len(valid) * fraction))], "past the end|count")


def test_empty_file(tmp_path):
    _refused(tmp_path, b"", "the magic needs 4 bytes")


def test_tensor_count_past_the_file(tmp_path, valid):
    _refused(tmp_path, _patched(valid, 8, "Q", 10**15), "tensor count 1000000000000000")


def test_key_value_count_past_the_file(tmp_path, valid):
    _refused(tmp_path, _patched(valid, 16, "Q", 2**63), "key/value count")


def test_string_length_past_the_file(tmp_path, valid):
    _refused(tmp_path, _patched(valid, 24, "Q", 2**60), "a metadata key needs")


def test_array_length_past_the_file(tmp_path, valid):
    # save_gguf writes no array: add one, then claim 10^12 items
    key = b"tokenizer.ggml.scores"
    array = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 6, 10**12)
    data = _patched(valid, 16, "Q", struct.unpack_from("<Q", valid, 16)[0] + 1)
    data = data[:24] + array + data[24:]
    _refused(tmp_path, data, "the 1000000000000 items of 'tokenizer.ggml.scores'")


def test_a_shape_of_a_trillion_elements(tmp_path, valid):
    data = _patched(valid, _dims_offset(valid, "blk.0.ffn_up.weight"), "Q", 10**12)
    _refused(
        tmp_path, data, "tensor 'blk.0.ffn_up.weight' needs 256000000000000 bytes"
    )  # 10^12 x 64 x 4


def test_a_tensor_offset_out_of_range(tmp_path, valid):
    name = "output_norm.weight"
    offset = _dims_offset(valid, name) + 8 + 4  # one dim, then the type
    _refused(tmp_path, _patched(valid, offset, "Q", 2**40), f"tensor '{name}' needs")


def test_a_misaligned_tensor_offset(tmp_path, valid):
    name = "output_norm.weight"
    offset = _dims_offset(valid, name) + 8 + 4
    _refused(tmp_path, _patched(valid, offset, "Q", 3), "not a multiple of the alignment")


def test_an_unknown_ggml_type(tmp_path, valid):
    name = "output_norm.weight"
    _refused(tmp_path, _patched(valid, _dims_offset(valid, name) + 8, "I", 999), "ggml type 999")


def test_too_many_dims(tmp_path, valid):
    name = "output_norm.weight"
    offset = _tensor_info_at(valid, name) + 8 + len(name)
    _refused(tmp_path, _patched(valid, offset, "I", 9), "9 dims")


def test_another_architecture_is_named(tmp_path, valid):
    data = valid.replace(b"llama", b"bloom")  # the architecture value and its key prefixes
    error = _refused(tmp_path, data, "general.architecture is 'bloom'")
    assert "llama" in str(error)


def test_a_missing_key_is_named(tmp_path, valid):
    data = valid.replace(b"llama.block_count", b"llama.block_xxxxx")
    _refused(tmp_path, data, "llama.block_count")


def test_an_unexpected_tensor_is_named(tmp_path, valid):
    data = valid.replace(b"output_norm.weight", b"output_nrrm.weight")
    _refused(tmp_path, data, "output_nrrm.weight")


def test_a_missing_file_and_a_folder(tmp_path):
    with pytest.raises(GGUFError, match="no GGUF file"):
        read_gguf(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="no GGUF file"):
        read_gguf(tmp_path)


def test_a_bias_the_model_has_no_place_for_is_named(tmp_path):
    model = GPT(CONFIG)  # no biases; one given to out_proj is written as blk.0.attn_output.bias
    model.blocks[0].self_attn.out_proj.bias = torch.nn.Parameter(torch.zeros(32))
    data = save_gguf(model, tmp_path / "bias.gguf").read_bytes()
    _refused(tmp_path, data, r"unexpected \['blk.0.attn_output.bias'\]")
