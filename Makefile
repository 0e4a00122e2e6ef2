# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint smoke venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megatron-dapo demo

smoke: $(STAMP)
	$(VENV)/bin/megatron-dapo smoke

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The layering contract (pyproject.toml [tool.importlinter]) and ruff's lint and format checks;
# CI runs them before the tests.
LINT_PATHS := megatron_dapo tests benchmarks tools
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
