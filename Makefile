# The two quick-start commands: `make up` (set up what serving needs, then serve profiles/default.toml)
# and `make test` (set up serving plus the test tools, then run the test suite). scripts/bootstrap.sh
# skips pip when pyproject.toml has not changed since the last install.
PROFILE ?= profiles/default.toml
PYTEST_ARGS ?=

.PHONY: setup setup-dev up test lint

setup:
	@scripts/bootstrap.sh serve

setup-dev:
	@scripts/bootstrap.sh dev

up: setup
	.venv/bin/blink-appliance up $(PROFILE)

test: setup-dev
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

lint: setup-dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
