"""GGUF files, read with every size and offset checked against the file: `read_gguf`.

GGUF is ggml's single-file model format (the GGUF specification in ggml's docs/gguf.md):

    header      magic "GGUF", version (2 or 3), tensor count, key/value count (little-endian)
    metadata    key/value pairs: a string key, a value type, a value (scalar, string or array)
    tensors     per tensor: name, number of dims, dims (innermost first), ggml type, offset
    data        the tensors' bytes, each at its offset from the (aligned) start of this section

A file is untrusted input: a key/value count, an array length or a tensor shape may claim more
than the file holds (a reader that believes it loops over the whole file, building objects, or
allocates the claimed size). So the header is read front to back with `struct`, and the first
number that does not fit in the file is refused by name, before anything large is allocated.
The tensors are then mapped from the file, not read: a 10^12-element shape costs nothing until
it is refused. The mapping is private (copy-on-write): the arrays are writable, so tensors can
be made from them without a copy, and a write changes this process's pages, never the file.
The gguf package (the format's own reader) is the reference the tests hold this reader to;
qkv reads a file without it, several times faster (its reader makes an object of every string
of a 49k-token vocabulary).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["GGML_TYPES", "GGUFError", "GGUFFile", "GGUFTensor", "check_gguf", "read_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays of scalars at most
DEFAULT_ALIGNMENT = 32
# ggml's tensor types: id -> (name, values per block, bytes per block)  (ggml.h, ggml.c)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip
# the types mapped as typed values (the others as bytes: whole blocks per row)
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip
# metadata value types: id -> struct code of a scalar; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class GGUFError(ValueError):
    """A GGUF file qkv cannot read: the message names the file, the field and what was wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, not yet dequantized.

    kind: the ggml type's name ("F32", "Q4_1", ...). shape: PyTorch order, outermost first (GGUF
    lists dims innermost first). raw: mapped from the file, no copy: typed values for F32, F16,
    F64 and the integer types, else bytes of shape (*shape[:-1], bytes per row).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    raw: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A checked GGUF file: metadata as plain Python values, tensors by name (`mapping`: the
    file's private memory map, None for a file small enough to have been read)."""

    path: Path
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def release(self, values) -> None:
        """Let the pages of `values` (an array or tensor whose bytes lie in this file's
        mapping; anything else is left alone) leave this process's memory: they are read back
        from the file when touched again. Only for bytes nothing has written since the file
        was mapped (a write would be lost): a loader calls it once it has decoded a tensor or
        laid it out elsewhere, so that the file is not resident on top of the model. Only
        whole pages inside `values` are released, never a neighbour's."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):  # Windows has none
            return
        base = np.frombuffer(self.mapping, dtype=np.uint8)
        if isinstance(values, np.ndarray):
            start, size = values.ctypes.data - base.ctypes.data, values.nbytes
        else:  # a torch tensor, contiguous
            start = values.data_ptr() - base.ctypes.data
            size = values.numel() * values.element_size()
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # page-aligned, inside values
        end = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if start >= 0 and start + size <= len(self.mapping) and first < end:
            self.mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as in the file
    kind: str
    offset: int  # from the start of the data section
    row_bytes: int  # bytes per row of the innermost dim
    nbytes: int


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and the (mapped, not copied) tensors of the GGUF file at `path`; GGUFError
    naming the field for anything the file cannot hold."""
    path, data = _open(path)
    metadata, infos, start = _Walker(memoryview(data), path).walk()
    mapped = np.frombuffer(data, dtype=np.uint8)  # writable where `data` is the mapping
    tensors = {info.name: _tensor(mapped, start, info) for info in infos}
    return GGUFFile(path, metadata, tensors, data if isinstance(data, mmap.mmap) else None)


def check_gguf(path: str | Path) -> Path:
    """Walk the header of the GGUF file at `path` and raise GGUFError, naming the field, for the
    first count, length, type, shape or offset that the file cannot hold. Returns the path."""
    path, data = _open(path)
    _Walker(memoryview(data), path).walk()
    return path


def _open(path: str | Path) -> tuple[Path, mmap.mmap | bytes]:
    """The file's bytes: read when small, else memory-mapped copy-on-write (nothing is read
    yet, and nothing is ever written to the file)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"path: no GGUF file at {path}")
    try:
        if path.stat().st_size < 1 << 16:
            return path, path.read_bytes()
        with open(path, "rb") as file:  # the mapping outlives the descriptor
            return path, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as error:
        raise GGUFError(f"path: cannot read {path}: {error.strerror}") from error


def _tensor(mapped: np.ndarray, start: int, info: _TensorInfo) -> GGUFTensor:
    shape = tuple(reversed(info.dims))  # outermost first
    raw = mapped[start + info.offset : start + info.offset + info.nbytes]
    if info.kind in _TYPED:
        raw = raw.view(_TYPED[info.kind]).reshape(shape)
    else:
        raw = raw.reshape(*shape[:-1], info.row_bytes)  # (*outer, bytes per row)
    return GGUFTensor(info.name, info.kind, shape, raw)


class _Walker:
    """Reads the header front to back; every read is bounds-checked against the file size."""

    def __init__(self, data: memoryview, path: Path):
        self.data, self.path, self.offset = data, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"path: {self.path} is not a valid GGUF file: {what}")

    def take(self, size: int, what: str) -> memoryview:
        end = self.offset + size
        if size < 0 or end > len(self.data):
            raise self.fail(f"{what} needs {size} bytes at offset {self.offset}, past the end "
                            f"of the file ({len(self.data)} bytes)")  # fmt: skip
        chunk, self.offset = self.data[self.offset : end], end
        return chunk

    def number(self, code: str, what: str) -> int | float:
        return struct.unpack("<" + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        length = self.number("Q", f"the length of {what}")
        raw = bytes(self.take(length, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"{what} is not UTF-8 ({error.reason})") from error

    def walk(self) -> tuple[dict[str, object], list[_TensorInfo], int]:
        """(metadata, tensor infos, start of the data section), every number checked."""
        magic = bytes(self.take(4, "the magic"))
        if magic != MAGIC:
            raise self.fail(f"magic {magic!r} (expected {MAGIC!r})")
        version = self.number("I", "the version")
        if version not in VERSIONS:
            raise self.fail(f"version {version} (expected one of {VERSIONS}, little-endian)")
        tensor_count = self.number("Q", "the tensor count")
        kv_count = self.number("Q", "the key/value count")
        remaining = len(self.data) - self.offset
        for count, what, least in ((kv_count, "key/value", 13), (tensor_count, "tensor", 28)):
            if count * least > remaining:
                raise self.fail(f"{what} count {count}: the file has room for "
                                f"{remaining // least} at most")  # fmt: skip
        metadata = {}
        for _ in range(kv_count):
            key = self.string("a metadata key")
            if key in metadata:
                raise self.fail(f"the key {key!r} appears twice")
            kind = self.number("I", f"the type of {key!r}")
            metadata[key] = self.value(kind, key, depth=0)
            if key == "general.alignment" and kind != _UINT32:
                raise self.fail(f"general.alignment has value type {kind} (expected a uint32)")
        alignment = _check_alignment(metadata.get("general.alignment", DEFAULT_ALIGNMENT), self)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        start = -(-self.offset // alignment) * alignment  # the data section, aligned
        self.check_tensor_data(infos, start, alignment)
        return metadata, infos, start

    def value(self, kind: int, key: str, depth: int) -> object:
        if kind in _SCALARS:
            return self.number(_SCALARS[kind], f"the value of {key!r}")
        if kind == _STRING:
            return self.string(f"the value of {key!r}")
        if kind != _ARRAY or depth >= MAX_NESTING:
            raise self.fail(f"{key!r} has value type {kind} (expected 0-12, arrays nested "
                            f"{MAX_NESTING} deep at most)")  # fmt: skip
        item_kind = self.number("I", f"the item type of {key!r}")
        length = self.number("Q", f"the length of {key!r}")
        if item_kind in _SCALARS:  # fixed size: one bounds check for the whole array
            code = "<" + _SCALARS[item_kind]
            items = self.take(length * struct.calcsize(code), f"the {length} items of {key!r}")
            return np.frombuffer(items, dtype=np.dtype(code.replace("?", "b1"))).tolist()
        if length * 8 > len(self.data) - self.offset:  # a string or array takes 8 bytes at least
            raise self.fail(f"{key!r} claims {length} items, more than the file can hold")
        return [self.value(item_kind, f"{key}[{index}]", depth + 1) for index in range(length)]

    def tensor_info(self) -> _TensorInfo:
        """The next tensor's name, dims, type and offset, its dims and type checked."""
        name = self.string("a tensor name")
        num_dims = self.number("I", f"the dim count of tensor {name!r}")
        if not 1 <= num_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {num_dims} dims (expected 1-{MAX_DIMS})")
        dims = tuple(self.number("Q", f"a dim of tensor {name!r}") for _ in range(num_dims))
        kind = self.number("I", f"the type of tensor {name!r}")
        offset = self.number("Q", f"the offset of tensor {name!r}")
        if kind not in GGML_TYPES:
            raise self.fail(f"tensor {name!r} has unknown ggml type {kind}")
        kind_name, block, block_bytes = GGML_TYPES[kind]
        if dims[0] % block:
            raise self.fail(f"tensor {name!r}: its innermost dim {dims[0]} is not a multiple "
                            f"of its type's block of {block}")  # fmt: skip
        row_bytes = dims[0] // block * block_bytes
        nbytes = int(np.prod(dims[1:], dtype=object)) * row_bytes
        return _TensorInfo(name, dims, kind_name, offset, row_bytes, nbytes)

    def check_tensor_data(self, infos: list[_TensorInfo], start: int, alignment: int) -> None:
        names = set()
        for info in infos:
            if info.name in names:
                raise self.fail(f"tensor {info.name!r} appears twice")
            names.add(info.name)
            if info.offset % alignment:
                raise self.fail(f"tensor {info.name!r} at offset {info.offset}, not a multiple "
                                f"of the alignment {alignment}")  # fmt: skip
            if start + info.offset + info.nbytes > len(self.data):
                raise self.fail(f"tensor {info.name!r} needs {info.nbytes} bytes at "
                                f"{start + info.offset}, past the end of the file "
                                f"({len(self.data)} bytes)")  # fmt: skip


def _check_alignment(value: object, walker: _Walker) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise walker.fail(f"general.alignment {value!r} (expected a power of two)")
    return value
