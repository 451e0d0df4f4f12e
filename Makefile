# The two commands of a fresh checkout: `make serve` and `make test` (CI runs `make test`).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: serve test install install-test lint gpu-test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

# Serve the embedded default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000.
# Without a GPU the emulated device runs it on the CPU.
serve: install
	$(BIN)/blink pull
	$(BIN)/blink serve

# Every test that can run on this machine (gpu/rdma-marked tests are skipped without the hardware).
test: install-test
	$(BIN)/blink pull
	$(BIN)/pytest -m "not gpu and not rdma" $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check blink tests bench
	$(BIN)/ruff format --check blink tests bench

# On a machine with an NVIDIA GPU (the H200): every GPU test and benchmark.
gpu-test:
	bash bench/run_gpu.sh
