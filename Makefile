# The two quick-start commands: `make up` (set up, then serve profiles/default.toml)
# and `make test` (set up, then run the test suite). Both bootstrap .venv first.
PROFILE ?= profiles/default.toml
PYTEST_ARGS ?=

.PHONY: setup up test lint

setup:
	@scripts/bootstrap.sh

up: setup
	.venv/bin/blink-appliance up $(PROFILE)

test: setup
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
