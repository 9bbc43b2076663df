# specserve: two commands on a fresh machine.
#   make demo   installs what is needed and runs the shipped demo through gateway, draft and target
#   make test   installs what is needed and runs the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The torch requirement pip resolves with this machine's configuration (README: which build that is);
# e.g. make install TORCH="torch==2.13.0 --index-url URL" for a build from another wheel index.
TORCH ?= torch==2.13.0

.PHONY: install lint demo test test-gpu protos soak bench bench-h200 clean

$(STAMP): pyproject.toml
	@echo "make install: 1/3 a virtual environment in $(VENV), pip upgraded"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "make install: 2/3 $(TORCH) (a few minutes on a first install; pip's own lines follow)"
	$(PY) -m pip install --progress-bar off $(TORCH) | grep -E '^(Collecting|Successfully)' || true
	@echo "make install: 3/3 specserve and its test and bench extras"
	$(PY) -m pip install --progress-bar off -e '.[test,bench]' | grep -E '^(Collecting|Successfully)' || true
	$(PY) -c "import specserve, torch"  # the install's check (the grep above hides pip's exit status)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specserve demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m specserve.tools.lint_imports

test: lint
	$(PY) -m pytest -q -x -rs --durations=15 tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

protos: $(STAMP)
	$(PY) -m specserve.protos.generate

soak: $(STAMP)
	$(PY) -m specserve.tools.soak --seconds 60

bench: $(STAMP)
	$(VENV)/bin/specserve bench

# BENCHMARKS.md's GPU headline table, every row, on one H200 (~6 min; 329 s on 2026-12-03): artifacts in $(HEADLINE_OUT), the table
# printed last. Needs no .venv: where the project is installed into the system python (the GPU machine), that is
# the interpreter it runs (or name one: make bench-h200 BENCH_PY=python3).
HEADLINE_OUT ?= bench_out/headline
BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
bench-h200:
	$(BENCH_PY) -m specserve.cli.main bench headline --out $(HEADLINE_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
