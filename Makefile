# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-megatron-latest check-gpu-install lint smoke venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q torch==2.13.0
	# megatron-core pinned to the bottom of the supported range: `make test` tests that end on any Python.
	$(PY) -m pip install -q -e ".[test]" megatron-core==0.16.1
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megatron-dapo demo

smoke: $(STAMP)
	$(VENV)/bin/megatron-dapo smoke

# --durations: every CI log says where the time went (benchmarks/RESULTS.md "The test suite in CI").
test: $(STAMP)
	$(PY) -m pytest -q --durations=30

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The top of the supported megatron-core range (runtime/megatron_compat.py), in a second environment with
# the GPU install's transformers (SGLang 0.5.23's pin): the tests that run megatron-core (models, bridge and
# conversion, actor, context parallel, checkpoints, Megatron-LM interop, router replay, CPU mode), and the
# embedded server's, which run transformers' models.
# megatron-core 0.19.2 declares Python >= 3.12; its cp311 wheel runs on 3.11, installed without that check.
VENV_LATEST ?= .venv-mc19
PY_LATEST := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.installed
MCORE_LATEST := 0.19.2
MEGATRON_TESTS := tests/models tests/bridge tests/runtime/test_cpu_runtime.py tests/runtime/test_megatron_compat.py \
	tests/trainer/test_megatron_engine.py tests/trainer/test_dapo_step.py tests/trainer/test_context_parallel.py \
	tests/trainer/test_checkpoint.py tests/trainer/test_routing_replay.py tests/embedded_server

$(STAMP_LATEST): pyproject.toml
	python3 -m venv $(VENV_LATEST)
	$(PY_LATEST) -m pip install -q --upgrade pip
	$(PY_LATEST) -m pip install -q torch==2.13.0
	$(PY_LATEST) -m pip install -q -e ".[test]" transformers==5.19.0 tokenizers==0.23.2
	$(PY_LATEST) -m pip install -q --ignore-requires-python --no-deps megatron-core==$(MCORE_LATEST)
	touch $(STAMP_LATEST)

test-megatron-latest: $(STAMP_LATEST)
	$(PY_LATEST) -c "from importlib.metadata import version as v; assert v('megatron-core') == '$(MCORE_LATEST)', v('megatron-core'); print('megatron-core', v('megatron-core'), 'transformers', v('transformers'))"
	$(PY_LATEST) -m pytest -q --durations=15 $(MEGATRON_TESTS)

# The GPU install (pyproject's `gpu` extra + constraints/gpu.txt) against SGLang 0.5.23's pins, and resolved
# for Python 3.11 and 3.12 from package metadata only (tools/check_gpu_install.py; needs PyPI).
check-gpu-install: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/check_gpu_install.py

# The layering contract (pyproject.toml [tool.importlinter]) and ruff's lint and format checks;
# CI runs them before the tests.
LINT_PATHS := megatron_dapo tests benchmarks tools
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
