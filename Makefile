# Developer entry points. `make test` is what CI runs (see .ci/run and README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
SIM_SEEDS ?= 2000

.PHONY: venv lint typecheck unit sim mutants test demo

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# The whole system on an embedded Kubernetes API: maintainer + 3 captures as processes, the examples
# applied, then the maintainer SIGKILLed with a Move, a Split and a Merge in flight, and the recovery.
demo: venv
	$(PY) -m controller.demo --scenario failover

lint:
	$(PY) -m ruff check controller tests
	$(VENV)/bin/lint-imports

typecheck:
	$(PY) -m mypy

unit:
	$(PY) -m pytest tests/unit -q

sim:
	$(PY) -m pytest tests/sim -q

mutants:
	$(PY) -m controller.sim --mutants

# Everything CI checks: lint, layering, types, then the whole test suite.
test: lint typecheck
	$(PY) -m pytest -q
