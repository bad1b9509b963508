"""What a GGUF load leaves in memory: the file is mapped privately (copy-on-write), a loader
releases the pages of what it has laid out elsewhere (`GGUFFile.release`), the quantized model's
blocks are views of the mapping rather than copies, and the temporaries of the load go back to
the system (`return_freed_heap`). Resident pages are read from /proc/self/smaps (Linux)."""

from __future__ import annotations

import ctypes.util
import platform
import sys

import numpy as np
import pytest
import torch

from qkv.acceleration import quantized_from_gguf
from qkv.acceleration.quantized import QuantizedLinear
from qkv.models import GPT, GPTConfig
from qkv.models.building import _malloc_trim, return_freed_heap
from qkv.models.gguf import read_gguf
from qkv.models.gguf.writer import save_gguf

linux = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def _resident_kib(file) -> int:
    """KiB resident of `file`'s own mapping (not of other mappings of the same path)."""
    low, high = _address_range(file)
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(part, 16) for part in head[0].split("-"))
                inside = start < high and low < end
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def _address_range(file) -> tuple[int, int]:
    base = np.frombuffer(file.mapping, dtype=np.uint8).ctypes.data
    return base, base + len(file.mapping)


@linux
def test_a_released_tensor_leaves_memory_and_reads_back_the_same(smollm2_path):
    """Reading the 28 MB embedding table makes its pages resident; releasing them takes them
    out of the process (but for the partial pages at its ends: 99% of it at least), and the
    values read again from the file are the same bytes. Nothing outside the tensor goes."""
    file = read_gguf(smollm2_path)
    assert file.mapping is not None and file.tensors["token_embd.weight"].raw.flags.writeable
    table = file.tensors["token_embd.weight"].raw  # (49152, 612) Q8_0 blocks
    neighbour = file.tensors["blk.0.ffn_up.weight"].raw
    before = int(table.sum(dtype=np.int64)), int(neighbour.sum(dtype=np.int64))
    touched = _resident_kib(file)
    assert touched >= table.nbytes // 1024  # every page of the table was read
    file.release(table)
    released = touched - _resident_kib(file)
    assert 0.99 * table.nbytes / 1024 <= released <= table.nbytes / 1024  # its whole pages
    assert (int(table.sum(dtype=np.int64)), int(neighbour.sum(dtype=np.int64))) == before
    file.release(torch.zeros(8))  # memory outside the mapping: left alone
    file.release(torch.from_numpy(table[:1]))  # less than a page: nothing whole to release


def test_a_small_file_is_read_whole_and_release_leaves_it_alone(tmp_path):
    """Under 64 KiB the file is read, not mapped: `mapping` is None and release does nothing."""
    config = GPTConfig(vocab_size=32, embed_dim=32, num_layers=1, num_heads=2, ffn_dim=32)
    path = save_gguf(GPT(config), tmp_path / "small.gguf", weight_type="F32")
    file = read_gguf(path)
    assert file.mapping is None
    raw = file.tensors["token_embd.weight"].raw
    expected = raw.copy()
    file.release(raw)
    assert np.array_equal(raw, expected)


@linux
def test_the_quantized_loader_keeps_views_of_the_file_and_releases_what_it_read(smollm2_path):
    """The Q4_1 and Q8_0 blocks of quantized_from_gguf's model are views of the file's mapping
    (q/k too: their rows are reordered to qkv's RoPE order as they are laid out, `rope_heads`),
    and once loaded the file's pages are no longer resident: the kernels read their own
    layouts of the blocks, the rest was decoded."""
    file = read_gguf(smollm2_path)
    model = quantized_from_gguf(file)
    low, high = _address_range(file)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert all(low <= m.blocks.data_ptr() < high for m in linears.values())
    reordered = {n for n, m in linears.items() if m.rope_heads is not None}
    assert reordered == {n for n in linears if n.endswith(("q_proj", "k_proj"))}
    assert low <= model.token_embedding.blocks.data_ptr() < high
    # of a 94 MiB file: the header read (~1.8 MiB) and the partial pages at tensors' ends
    assert _resident_kib(file) < 4 * 1024


def test_freed_heap_goes_back_where_the_c_library_can_give_it():
    """On glibc (Linux) `return_freed_heap` calls malloc_trim; elsewhere it does nothing."""
    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    if glibc:
        assert _malloc_trim() is not None
    elif ctypes.util.find_library("c") is None:
        assert _malloc_trim() is None
    assert return_freed_heap() is None
