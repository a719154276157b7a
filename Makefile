# Two commands: `make demo` and `make test`. Both create and reuse .venv by themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PACKAGES := mg-parallel mg-models mg-data mg-ckpt mg-cli
INSTALL_INPUTS := constraints.txt requirements-dev.txt $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml)

.PHONY: demo test test-fast lint test-packages test-e2e test-smoke venv clean

venv: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements-dev.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(MAKE) lint
	$(MAKE) test-packages
	$(MAKE) test-e2e

# Style and size (ruff), import contracts (import-linter, pyproject.toml) and the architecture rules
# read from the source (tests/architecture): a few seconds in all.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/architecture

# Each package alone: its wheel in a fresh venv with only its declared dependencies.
test-packages: $(STAMP)
	@for p in $(PACKAGES); do bash .ci/test_package.sh $$p || exit 1; done

test-e2e: $(STAMP)
	@mkdir -p .ci-reports
	$(VENV)/bin/pytest tests/e2e --durations=15 --junitxml=.ci-reports/e2e.xml

# The inner loop (under 5 minutes): lint, the package suites, and the end-to-end tests marked smoke.
test-fast: $(STAMP)
	$(MAKE) lint
	$(MAKE) test-packages
	$(MAKE) test-smoke

test-smoke: $(STAMP)
	$(VENV)/bin/pytest tests/e2e -m smoke --durations=5

clean:
	rm -rf $(VENV) .venvs dist build .ci-reports
