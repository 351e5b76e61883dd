# The two set-up commands the README gives: `make test` and `make serve`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test serve lint typecheck check-policies

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

lint: $(BIN)/.installed
	$(BIN)/ruff check .

typecheck: $(BIN)/.installed
	$(BIN)/mypy statemachine

test: lint typecheck
	$(BIN)/pytest -q -p no:cacheprovider

serve: $(BIN)/.installed
	$(BIN)/fairtick serve --host 127.0.0.1 --port 8000
