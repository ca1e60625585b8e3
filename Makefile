# Set-up on a fresh machine is `make serve` or `make test`: both create .venv and install from pyproject.toml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install serve test test-slow clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/jaxserve serve

# Two processes: the HTTP server tests compile their engines in a fresh one. After ~650 tests in one process an XLA
# compile on the server's engine thread segfaulted once (not reproduced alone; cause not found yet).
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) --ignore-glob='tests/test_server*'
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/test_server*.py

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
