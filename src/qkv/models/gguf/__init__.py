"""GGUF files (llama.cpp's model format) <-> qkv models.

- `file`: `check_gguf` walks a file's header and refuses, by name, any number the file cannot
  hold; `read_gguf` then reads it with the gguf package.
- `quants`: ggml's block formats (Q8_0, Q4_0, Q4_1, the K-quants, ...) dequantized in PyTorch.
- `config`: GGUF metadata -> `GPTConfig` (llama and GPT-2 families).
- `model`: GGUF tensor names -> qkv's, dequantized and loaded: `from_gguf(path)`.

The gguf package is an optional dependency (`pip install gguf`); only reading a file needs it.
"""

from qkv.models.gguf.config import gguf_config
from qkv.models.gguf.file import GGUFError, GGUFFile, GGUFTensor, check_gguf, read_gguf
from qkv.models.gguf.model import from_gguf
from qkv.models.gguf.quants import dequantize

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "check_gguf",
    "dequantize",
    "from_gguf",
    "gguf_config",
    "read_gguf",
]
