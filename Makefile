# Two set-up commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint bench install clean

$(BIN)/changefeed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m changefeed.spark.jvm_archive || echo "(no JVM class archive: feeds start a few seconds slower)"
	touch $@

install: $(BIN)/changefeed

demo: install
	$(BIN)/changefeed demo

# Two workers (pytest-xdist): a feed's test waits on its servers and processes much of the time.
test: install
	$(BIN)/pytest -q -n 2 --dist worksteal --durations=40

# The inner loop: every test that needs no Spark (pure units, real PostgreSQL and broker servers).
test-fast: install
	$(BIN)/pytest -q -n 2 -m "pure or server"

# Lint: ruff (style, imports), import-linter (the layers, no import circles), mypy --strict
# (settings of all three in pyproject.toml); test files need unique names (the tests folders are not packages).
lint: install
	@dups=$$(find tests -name 'test_*.py' -printf '%f\n' | sort | uniq -d); \
	  if [ -n "$$dups" ]; then echo "test files share a name (pytest cannot import both): $$dups"; exit 1; fi
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: install
	$(BIN)/python bench/replica_throughput.py

clean:
	rm -rf $(VENV) changefeed-demo changefeed-state .pytest_cache
