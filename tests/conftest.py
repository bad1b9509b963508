"""Test-wide set-up. Triton reads TRITON_INTERPRET when it is first imported (by any module,
torch's own checks included), so it is decided here, before anything else: without a CUDA
device the Triton kernels run in Triton's interpreter on the CPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
