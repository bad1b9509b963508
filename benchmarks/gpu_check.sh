#!/usr/bin/env bash
# Everything in qkv that needs a CUDA GPU, in one run (`make gpu-check`, or this script with a
# Python that has a CUDA build of torch and Triton): the Triton kernels' self-check on the
# device (what `auto` waits for before it routes CUDA tensors to them), their tests on CUDA
# (with no TRITON_INTERPRET, tests/ run them on the GPU), then benchmarks/flash_gpu.py.
# Each step runs even where one before it failed; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
status=0
fail() { [ "$status" -ne 0 ] || status=$1; }  # keep the first failure

echo "== the Triton kernels' self-check on cuda:0, and what auto then chooses"
"$PYTHON" - <<'PY' || fail $?
import torch

import qkv
from qkv.attention.triton import selfcheck

print(torch.__version__, torch.cuda.get_device_name(0))
verdict = selfcheck.self_check(torch.device("cuda", 0))
print("self-check:", "passed" if verdict is None else verdict)
q = torch.randn(1, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
print(qkv.explain(q, q, q, causal=True))
raise SystemExit(0 if verdict is None else 1)
PY

echo "== the kernels' tests on CUDA"
"$PYTHON" -m pytest -q tests/attention/test_triton.py tests/attention/test_triton_offset_bias.py \
	tests/attention/test_triton_selfcheck.py || fail $?

echo "== benchmarks/flash_gpu.py --quick"
"$PYTHON" benchmarks/flash_gpu.py --quick || fail $?
exit "$status"
