#!/usr/bin/env bash
# `make chart-check`: everything about the chart that needs no cluster.
#   1. the chart's CRD templates are what hack/sync-chart-crds.py generates from crds/
#   2. helm lint --strict, with the default and each tests/chart/values/*.yaml (but invalid.yaml)
#   3. helm template with those values; every manifest validated offline against the Kubernetes schemas
#      (kubernetes-validate, strict) and our CRDs, plus the chart's promises (hack/validate-manifests.py)
#   4. values.schema.json rejects tests/chart/values/invalid.yaml
#   5. every CRD (crds/ and rendered) passes controller/apiserver/crdcheck.py: what a real API server
#      refuses at CRD create, or accepts and then refuses every object of (the int64 maximum bug)
# HELM: a helm v3 binary (default: fetched by hack/fetch-helm.py into .cache/bin/helm).
# KUBE_VERSION: the Kubernetes schemas to validate against.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
KUBE_VERSION=${KUBE_VERSION:-1.33.0}
CHART=charts/changefeed-maintainer
OUT=.cache/chart-check
HELM=${HELM:-$("$PY" hack/fetch-helm.py)}
start=$(date +%s)
rm -rf "$OUT" && mkdir -p "$OUT"

echo "== CRDs: chart templates vs crds/"
"$PY" hack/sync-chart-crds.py --check

render() {  # render NAME [helm args...]: lint and template with these values, then validate
  local name=$1; shift
  echo "== $name: helm lint, helm template, validate"
  "$HELM" lint --strict --quiet "$CHART" "$@" --kube-version "$KUBE_VERSION"
  "$HELM" template cfm "$CHART" --namespace cfm-system --kube-version "$KUBE_VERSION" "$@" > "$OUT/$name.yaml"
}
render default
"$PY" hack/validate-manifests.py --chart --expect-crds 6 --kube-version "$KUBE_VERSION" "$OUT/default.yaml"
echo "== CRD schemas as a real API server judges them (int64 bounds, structure, CEL compile and cost)"
"$PY" -m controller.apiserver.crdcheck crds/*.yaml "$OUT/default.yaml"
render ha -f tests/chart/values/ha.yaml
"$PY" hack/validate-manifests.py --chart --expect-crds 0 --kube-version "$KUBE_VERSION" "$OUT/ha.yaml"
render minimal -f tests/chart/values/minimal.yaml
"$PY" hack/validate-manifests.py --chart --expect-crds 6 --kube-version "$KUBE_VERSION" "$OUT/minimal.yaml"
render set --set maintainer.replicas=3 --set capture.replicas=1 --set crds.enabled=true \
  --set-string maintainer.resources.limits.memory=1Gi
"$PY" hack/validate-manifests.py --chart --expect-crds 6 --kube-version "$KUBE_VERSION" "$OUT/set.yaml"
echo "== our examples against our CRDs"
"$PY" hack/validate-manifests.py --kube-version "$KUBE_VERSION" examples/*.yaml

echo "== values.schema.json rejects tests/chart/values/invalid.yaml"
if "$HELM" template cfm "$CHART" -f tests/chart/values/invalid.yaml > /dev/null 2> "$OUT/invalid.err"; then
  echo "helm accepted invalid values" >&2; exit 1
fi
grep -q "values don't meet the specifications of the schema" "$OUT/invalid.err" || { cat "$OUT/invalid.err" >&2; exit 1; }

echo "chart-check: OK in $(( $(date +%s) - start ))s ($("$HELM" version --short), Kubernetes $KUBE_VERSION schemas)"
