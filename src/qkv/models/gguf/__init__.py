"""GGUF files (llama.cpp's model format) <-> qkv models.

- `file`: `read_gguf` reads a file's header with every number checked against the file, and
  maps its tensors (`check_gguf` only checks).
- `quants`: ggml's block formats (Q8_0, Q4_0, Q4_1, the K-quants, ...) dequantized in PyTorch.
- `config`: GGUF metadata -> `GPTConfig` (llama and GPT-2 families).
- `model`: GGUF tensor names -> qkv's, dequantized and loaded: `from_gguf(path)`.
- `writer`: a GPT -> a GGUF file: `save_gguf` (needs the gguf package, the format's own writer).

Reading needs no package beyond numpy; the tests hold the reader to the gguf package's.
"""

from qkv.models.gguf.config import gguf_config
from qkv.models.gguf.file import GGML_TYPES, GGUFError, GGUFFile, GGUFTensor, check_gguf, read_gguf
from qkv.models.gguf.model import from_gguf
from qkv.models.gguf.quants import dequantize

__all__ = [
    "GGML_TYPES",
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "check_gguf",
    "dequantize",
    "from_gguf",
    "gguf_config",
    "read_gguf",
]
