# Two entry points: `make demo` and `make test`. Both create .venv and provision the embedded model if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtrim-installed

.PHONY: demo test lint model install clean bench

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

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

bench: model
	$(PY) benchmarks/bench_speed_memory.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
