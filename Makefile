# The two commands of a fresh checkout: `make serve` and `make test` (CI runs `make test`).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PARTS ?= tests conformance

.PHONY: serve test install install-test lint gpu-test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# --no-compile: Python compiles each module when it is first imported, not the whole of torch, ray and
# the rest at install (134 s -> 54 s on 2 cores; docs/decisions.md). That first import must be let
# write its .pyc: `make test` runs with PYTHONDONTWRITEBYTECODE unset (TEST_ENV).
install: $(BIN)/python
	$(BIN)/pip install -q --no-compile -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q --no-compile -e '.[test]'

# Serve the embedded default model (SmolLM2-135M-Instruct) on $(HOST):$(PORT) (127.0.0.1:8000);
# ARGS go to `blink serve` as they are, e.g. make serve PORT=8001 ARGS="--max-num-seqs 8".
# Without a GPU the emulated device runs it on the CPU.
serve: install
	$(BIN)/blink pull
	$(BIN)/blink serve --host $(HOST) --port $(PORT) $(ARGS)

# Every test that can run on this machine (gpu/rdma-marked tests are skipped without the hardware),
# in TEST_WORKERS processes, a test file per process at a time (its servers and rigs stay in one),
# handed out in collection order: the longest files first (tests/conftest.py).
# Its hundreds of Python processes (servers, devices, Ray workers) reuse the bytecode the first one
# wrote, even where the environment says PYTHONDONTWRITEBYTECODE=1 (each compiled ray, aiohttp, numpy
# and blink from source again: 9 minutes of CPU a run), and each runs its BLAS and torch on one thread:
# TEST_WORKERS processes already fill the cores, and BLAS threads spinning beside another busy worker
# made the transformers reference 2.3x slower (docs/decisions.md).
TEST_WORKERS ?= 2
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
test: install-test
	$(TEST_ENV) $(BIN)/blink pull
	$(TEST_ENV) $(BIN)/pytest -m "not gpu and not rdma" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check blink tests bench
	$(BIN)/ruff format --check blink tests bench

# On a machine with an NVIDIA GPU, after `pip install -e '.[cu13,test]'` (or [cu12]): the GPU tests and the
# conformance suite on the CUDA device; benchmarks by name in PARTS (scripts/gpu_check.sh lists them).
#   make gpu-test OUT=dir [PARTS="tests conformance decode models"] [COMMIT=sha]
gpu-test:
	@test -n "$(OUT)" || { echo "usage: make gpu-test OUT=dir [PARTS=...] [COMMIT=sha]"; exit 2; }
	bash scripts/gpu_check.sh $(if $(COMMIT),--commit $(COMMIT)) $(OUT) $(PARTS)
