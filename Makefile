# One entry point for developers and CI. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test unit multiprocess lint typecheck clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/smddp-launch -np 4 --local-nodes 2 -- $(BIN)/python examples/mlp_numpy.py

lint: $(STAMP)
	$(BIN)/ruff check smddp tests examples
	$(BIN)/ruff format --check smddp tests examples

typecheck: $(STAMP)
	$(BIN)/mypy smddp

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

multiprocess: $(STAMP)
	$(BIN)/pytest -q tests/multiprocess

test: lint typecheck $(STAMP)
	$(BIN)/pytest -q -ra tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
