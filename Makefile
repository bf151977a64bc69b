# Each target does its own set-up: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast test-llamacpp demo bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to the local CPU wheel; install it first so nothing pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# the engines' tests run in their own environments (test-llamacpp, ...)
test: install
	$(PY) -m pytest -q -m "not llamacpp and not vllm"

test-fast: install
	$(PY) -m pytest -q -m "not slow and not llamacpp and not vllm"

# llama.cpp through llama-cpp-python, in a venv of its own (its bench methods join every run
# where it is installed). pip builds llama.cpp from source, ~10-30 min on 2 cores; its multimodal
# library is left out (nothing here uses it).
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed

$(LLAMACPP_STAMP): pyproject.toml
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LLAMACPP_VENV)/bin/python -m pip install --quiet torch==2.13.0
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(LLAMACPP_VENV)/bin/python -m pip install --quiet -e '.[dev,llamacpp]'
	touch $(LLAMACPP_STAMP)

test-llamacpp: $(LLAMACPP_STAMP)
	$(LLAMACPP_VENV)/bin/python -m pytest -q -m llamacpp

demo: install
	$(VENV)/bin/cllm demo

bench: install
	$(VENV)/bin/cllm bench

lint: install
	$(VENV)/bin/ruff check src tests scripts

clean:
	rm -rf $(VENV) $(LLAMACPP_VENV) build *.egg-info src/*.egg-info .pytest_cache
