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

.PHONY: demo test test-oldest lint model install clean bench

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
	$(PY) -m pytest -q

$(OLDEST_STAMP): $(STAMP)
	$(PY) .ci/overlay_venv.py $(VENV) $(OLDEST)
	$(OLDEST_PY) -m pip install -q "transformers==$(TRANSFORMERS_OLDEST)"
	$(OLDEST_PY) -c "import transformers as t; assert t.__version__ == '$(TRANSFORMERS_OLDEST)', t.__version__"
	touch $(OLDEST_STAMP)

test-oldest: model $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import transformers, kvtrim; print('transformers', transformers.__version__, 'kvtrim', kvtrim.__file__)"
	$(OLDEST_PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

bench: model
	$(PY) benchmarks/bench_speed_memory.py

clean:
	rm -rf $(VENV) $(OLDEST) build dist src/*.egg-info
