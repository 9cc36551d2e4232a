# Two set-up commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench install clean

$(BIN)/changefeed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m changefeed.spark.jvm_archive || echo "(no JVM class archive: feeds start a few seconds slower)"
	touch $@

install: $(BIN)/changefeed

demo: install
	$(BIN)/changefeed demo

test: install
	$(BIN)/pytest -q

# Lint: ruff (style, imports), import-linter (the layers and no import circles: pyproject.toml).
lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports

bench: install
	$(BIN)/python bench/replica_throughput.py

clean:
	rm -rf $(VENV) changefeed-demo changefeed-state .pytest_cache
