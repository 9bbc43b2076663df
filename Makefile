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

.PHONY: install lint demo test test-gpu protos soak bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specserve demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m specserve.tools.lint_imports

test: lint
	$(PY) -m pytest -q -x -rs --durations=15 tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

protos: $(STAMP)
	$(PY) -m specserve.protos.generate

soak: $(STAMP)
	$(PY) -m specserve.bench.soak --seconds 60

bench: $(STAMP)
	$(VENV)/bin/specserve bench

clean:
	rm -rf $(VENV) build *.egg-info
