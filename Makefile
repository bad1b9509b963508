# Two commands set everything up on a fresh machine: `make run` and `make test`.
# torch is pinned to 2.13.0, which pip takes from the local CPU build (an unpinned torch would
# pull gigabytes of CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qkv-installed

.PHONY: install run test lint browser bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/qkv check

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

# The `qkv viz` page is tested in a real headless browser: Debian's chromium, driven by Playwright
# (pip's playwright, without its own browser download, which cannot work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium for the viewer's browser test"; \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

test: lint browser
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
