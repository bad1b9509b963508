"""GGUF files: every size and offset checked against the file, then read with the gguf package.

GGUF is ggml's single-file model format (the GGUF specification in ggml's docs/gguf.md):

    header      magic "GGUF", version (2 or 3), tensor count, key/value count (little-endian)
    metadata    key/value pairs: a string key, a value type, a value (scalar, string or array)
    tensors     per tensor: name, number of dims, dims (innermost first), ggml type, offset
    data        the tensors' bytes, each at its offset from the (aligned) start of this section

The `gguf` package (the format's own reader) maps the file and trusts its numbers: a key/value
count, an array length or a tensor shape past the end of the file makes it loop over the whole
file, building objects, or fail with an IndexError far from the cause. So `check_gguf` walks
the header first, with nothing but `struct`, and refuses by name the first number that does not
fit in the file, before anything large is allocated or anything is read. Only then does
`read_gguf` hand the file to the gguf package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "check_gguf", "read_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays of scalars at most
DEFAULT_ALIGNMENT = 32
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class GGUFError(ValueError):
    """A GGUF file qkv cannot read: the message names the file, the field and what was wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, not yet dequantized.

    kind: the ggml type's name ("F32", "Q4_1", ...). shape: PyTorch order, outermost first (GGUF
    lists dims innermost first). raw: the bytes (or typed values, for F32/F16) as the gguf
    reader maps them from the file, without a copy.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    raw: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A checked GGUF file: metadata as plain Python values, tensors by name."""

    path: Path
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf(path: str | Path) -> GGUFFile:
    """Check `path` (`check_gguf`), then read its metadata and map its tensors."""
    path = check_gguf(path)
    from gguf import GGUFReader  # the optional dependency, needed only from here on

    try:
        reader = GGUFReader(path, mode="r")
    except (ValueError, KeyError, IndexError) as error:  # what check_gguf does not cover
        raise GGUFError(f"path: {path} is not a readable GGUF file: {error}") from error
    metadata = {
        name: _plain(field.contents())
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    tensors = {
        t.name: GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                           t.data)
        for t in reader.tensors
    }  # fmt: skip
    return GGUFFile(path, metadata, tensors)


def _plain(value: object) -> object:
    """numpy scalars -> Python numbers (contents() gives numpy scalars for numeric fields)."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value.item() if isinstance(value, np.generic) else value


def check_gguf(path: str | Path) -> Path:
    """Walk the header of the GGUF file at `path` and raise GGUFError, naming the field, for the
    first count, length, type, shape or offset that the file cannot hold. Returns the path."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"path: no GGUF file at {path}")
    try:
        data = path.read_bytes() if path.stat().st_size < 1 << 16 else None
        data = data if data is not None else _mapped(path)
    except OSError as error:
        raise GGUFError(f"path: cannot read {path}: {error.strerror}") from error
    _Walker(data, path).walk()
    return path


def _mapped(path: Path) -> memoryview:
    """The file's bytes without reading them all: a read-only memory map."""
    return memoryview(np.memmap(path, dtype=np.uint8, mode="r"))


class _Walker:
    """Reads the header front to back; every read is bounds-checked against the file size."""

    def __init__(self, data: bytes | memoryview, path: Path):
        self.data, self.path, self.offset = data, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"path: {self.path} is not a valid GGUF file: {what}")

    def take(self, size: int, what: str) -> bytes | memoryview:
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

    def walk(self) -> None:
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
        alignment = DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key = self.string("a metadata key")
            value = self.value(self.number("I", f"the type of {key!r}"), key, depth=0)
            if key == "general.alignment":
                alignment = _check_alignment(value, self.fail)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        self.check_tensor_data(infos, alignment)

    def value(self, kind: int, key: str, depth: int) -> object:
        if kind in _SCALAR_SIZES:
            size = _SCALAR_SIZES[kind]
            return self.take(size, f"the value of {key!r}") if kind != _UINT32 else \
                self.number("I", f"the value of {key!r}")  # fmt: skip
        if kind == _STRING:
            return self.string(f"the value of {key!r}")
        if kind != _ARRAY or depth >= MAX_NESTING:
            raise self.fail(f"{key!r} has value type {kind} (expected 0-12, arrays nested "
                            f"{MAX_NESTING} deep at most)")  # fmt: skip
        item_kind = self.number("I", f"the item type of {key!r}")
        length = self.number("Q", f"the length of {key!r}")
        if item_kind in _SCALAR_SIZES:  # fixed size: one bounds check for the whole array
            self.take(length * _SCALAR_SIZES[item_kind], f"the {length} items of {key!r}")
            return None
        if length * 8 > len(self.data) - self.offset:  # a string or array takes 8 bytes at least
            raise self.fail(f"{key!r} claims {length} items, more than the file can hold")
        for index in range(length):
            self.value(item_kind, f"{key}[{index}]", depth + 1)
        return None

    def tensor_info(self) -> tuple[str, int, int]:
        """(name, data offset, byte count) of the next tensor, its dims and type checked."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self.string("a tensor name")
        num_dims = self.number("I", f"the dim count of tensor {name!r}")
        if not 1 <= num_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {num_dims} dims (expected 1-{MAX_DIMS})")
        dims = [self.number("Q", f"a dim of tensor {name!r}") for _ in range(num_dims)]
        kind = self.number("I", f"the type of tensor {name!r}")
        offset = self.number("Q", f"the offset of tensor {name!r}")
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError) as error:
            raise self.fail(f"tensor {name!r} has unknown ggml type {kind}") from error
        if dims[0] % block:
            raise self.fail(f"tensor {name!r}: its innermost dim {dims[0]} is not a multiple "
                            f"of its type's block of {block}")  # fmt: skip
        return name, offset, int(np.prod(dims, dtype=object)) // block * block_bytes

    def check_tensor_data(self, infos: list[tuple[str, int, int]], alignment: int) -> None:
        start = -(-self.offset // alignment) * alignment  # the data section, aligned
        for name, offset, size in infos:
            if offset % alignment:
                raise self.fail(f"tensor {name!r} at offset {offset}, not a multiple of the "
                                f"alignment {alignment}")  # fmt: skip
            if start + offset + size > len(self.data):
                raise self.fail(f"tensor {name!r} needs {size} bytes at {start + offset}, "
                                f"past the end of the file ({len(self.data)} bytes)")  # fmt: skip


def _check_alignment(value: object, fail) -> int:
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise fail(f"general.alignment {value!r} (expected a power of two, as a uint32)")
    return value
