# The two quick-start commands: `make up` (set up what serving needs, then serve profiles/default.toml)
# and `make test` (set up serving plus the test tools, then run the test suite). scripts/bootstrap.sh
# skips pip when pyproject.toml has not changed since the last install.
PROFILE ?= profiles/default.toml
PYTEST_ARGS ?=
# Test files spread over up to 4 workers, each file whole on one (its module fixtures start once, its
# tests keep their order): 18:07 -> 14:17 on the 2-core CI machine. PYTEST_WORKERS= runs serially.
PYTEST_WORKERS ?= -n auto --maxprocesses 4 --dist loadfile

.PHONY: setup setup-dev up test lint

setup:
	@scripts/bootstrap.sh serve

setup-dev:
	@scripts/bootstrap.sh dev

up: setup
	.venv/bin/blink-appliance up $(PROFILE)

test: setup-dev
	.venv/bin/python -m pytest -q $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: setup-dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
