# The two set-up commands the README gives: `make test` and `make serve`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test serve lint typecheck

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Ray Serve for `fairtick cluster` and its tests; `make serve` does not need it.
$(BIN)/.installed-cluster: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e '.[dev,cluster]'
	touch $@

lint: $(BIN)/.installed
	$(BIN)/ruff check .

typecheck: $(BIN)/.installed
	$(BIN)/mypy statemachine

test: lint typecheck $(BIN)/.installed-cluster
	$(BIN)/pytest -q -p no:cacheprovider

serve: $(BIN)/.installed
	$(BIN)/fairtick serve --host 127.0.0.1 --port 8000
