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
