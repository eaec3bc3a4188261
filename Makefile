# tfx: the two set-up commands are `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: quickstart test test-fast install install-dev clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/activate pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Trains configs/quickstart.py (a small decoder on the Python standard library's own source)
# on the CPU, evaluates, samples, and prints where the run is.
quickstart: install
	$(PY) -m tfx.quickstart --workdir runs/quickstart

# The whole suite on CPU; the sharding tests fake 8 devices themselves.
test: install-dev
	$(PY) -m pytest -q tests

test-fast: install-dev
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf runs .pytest_cache
