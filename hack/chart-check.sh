#!/usr/bin/env bash
# `make chart-check`: everything about the chart that needs no cluster.
#   1. the chart's CRD templates are what hack/sync-chart-crds.py generates from crds/
#   2. helm lint --strict, with the default and each tests/chart/values/*.yaml (but invalid*.yaml)
#   3. helm template with those values; every manifest validated offline against the Kubernetes schemas
#      (kubernetes-validate, strict) and our CRDs, plus the chart's promises (hack/validate-manifests.py)
#   4. the monitoring options (tests/chart/values/monitoring.yaml and variants): PodMonitor and PrometheusRule
#      validated against the Prometheus operator's schemas (npm @kubernetes-models/prometheus-operator, see
#      hack/fetch-po-schemas.sh), the rules with `promtool check rules`, the PodDisruptionBudget and dashboard
#      ConfigMap against the Kubernetes schemas, and all of them against the maintainer pods they serve
#   5. values.schema.json rejects tests/chart/values/invalid*.yaml
#   6. every CRD (crds/ and rendered) passes controller/apiserver/crdcheck.py: what a real API server
#      refuses at CRD create, or accepts and then refuses every object of (the int64 maximum bug)
# HELM: a helm v3 binary (default: fetched by hack/fetch-helm.py into .cache/bin/helm).
# KUBE_VERSION: the Kubernetes schemas to validate against.
# PROMTOOL: promtool (default: Debian's, unpacked by hack/fetch-prometheus.sh into .cache/prometheus/bin).
# PO_SCHEMAS: the installed npm package (default: hack/fetch-po-schemas.sh installs it into .cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
KUBE_VERSION=${KUBE_VERSION:-1.33.0}
CHART=charts/changefeed-maintainer
OUT=.cache/chart-check
HELM=${HELM:-$("$PY" hack/fetch-helm.py)}
PROMTOOL=${PROMTOOL:-$(hack/fetch-prometheus.sh)/promtool}
PO_SCHEMAS=${PO_SCHEMAS:-$(hack/fetch-po-schemas.sh)}
validate() { "$PY" hack/validate-manifests.py --kube-version "$KUBE_VERSION" --po-schemas "$PO_SCHEMAS" --promtool "$PROMTOOL" "$@"; }
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
validate --chart --expect-crds 6 "$OUT/default.yaml"
echo "== CRD schemas as a real API server judges them (int64 bounds, structure, CEL compile and cost)"
"$PY" -m controller.apiserver.crdcheck crds/*.yaml "$OUT/default.yaml"
render ha -f tests/chart/values/ha.yaml
validate --chart --expect-crds 0 "$OUT/ha.yaml"
render minimal -f tests/chart/values/minimal.yaml
validate --chart --expect-crds 6 "$OUT/minimal.yaml"
render set --set maintainer.replicas=3 --set capture.replicas=1 --set crds.enabled=true \
  --set-string maintainer.resources.limits.memory=1Gi
validate --chart --expect-crds 6 "$OUT/set.yaml"
render dataplane -f tests/chart/values/dataplane.yaml
validate --chart --expect-crds 6 "$OUT/dataplane.yaml"
grep -q 'dsn: "host=pg.db port=5432 dbname=cdc user=cdc password=not-a-real-password sslmode=require"' "$OUT/dataplane.yaml" \
  || { echo "the sink Secret's dsn lacks its sslmode" >&2; exit 1; }
grep -q 'endpoints: "http://etcd-0.etcd:2379,etcd-1.etcd:2379"' "$OUT/dataplane.yaml" \
  || { echo "the source Secret's endpoints are not joined" >&2; exit 1; }
for tls in 'ca.crt: "-----BEGIN CERTIFICATE-----\nnot-a-real-ca' 'tls.crt: "-----BEGIN CERTIFICATE-----\nnot-a-real-cert' \
           'tls.key: "-----BEGIN PRIVATE KEY-----\nnot-a-real-key'; do
  grep -qF "$tls" "$OUT/dataplane.yaml" || { echo "the TLS source Secret lacks: $tls" >&2; exit 1; }
done
# A MySQL sink from fields: the DSN built with its credentials percent-encoded, its ssl-mode, its CA; or given whole.
grep -qF 'dsn: "mysql://cdc:not%2Fa%3Areal%40password@tidb.db:4000/?ssl-mode=VERIFY_IDENTITY"' "$OUT/dataplane.yaml" \
  || { echo "the MySQL sink Secret's dsn is not built from its fields" >&2; exit 1; }
grep -qF 'dsn: "mysql://cdc:not-a-real-password@mariadb.db:3306/"' "$OUT/dataplane.yaml" \
  || { echo "the MySQL sink Secret's dsn is not taken whole" >&2; exit 1; }
# A MySQL sink with a PostgreSQL sink's keys: refused.
if "$HELM" template cfm charts/changefeed-maintainer --kube-version "$KUBE_VERSION" \
     --set 'dataplane.sinks[0].name=s' --set 'dataplane.sinks[0].dsn=host=x' \
     --set 'dataplane.sinks[0].mysql.host=db' >/dev/null 2>"$OUT/mysql-dsn.err"; then
  echo "a sink with both dsn and mysql rendered" >&2; exit 1
fi
grep -q "dataplane.sinks.0" "$OUT/mysql-dsn.err" || { cat "$OUT/mysql-dsn.err" >&2; exit 1; }
# TLS material for http:// endpoints (most likely a forgotten https://): the chart refuses to render.
if "$HELM" template cfm charts/changefeed-maintainer --kube-version "$KUBE_VERSION" \
     --set 'dataplane.sources[0].name=s' --set 'dataplane.sources[0].endpoints[0]=http://etcd:2379' \
     --set 'dataplane.sources[0].ca=PEM' >/dev/null 2>"$OUT/tls-http.err"; then
  echo "a source with a ca and http:// endpoints rendered" >&2; exit 1
fi
grep -q "use https:// endpoints" "$OUT/tls-http.err" || { cat "$OUT/tls-http.err" >&2; exit 1; }
render monitoring -f tests/chart/values/monitoring.yaml
validate --chart --expect-crds 6 --expect-monitoring PodMonitor,PrometheusRule,ConfigMap,PodDisruptionBudget \
  "$OUT/monitoring.yaml"
# Defaults of every monitoring option; one replica: no PodDisruptionBudget.
render monitoring-defaults --set monitoring.podMonitor.enabled=true --set monitoring.prometheusRule.enabled=true \
  --set monitoring.grafanaDashboard.create=true --set podDisruptionBudget.enabled=true
validate --chart --expect-crds 6 --expect-monitoring PodMonitor,PrometheusRule,ConfigMap "$OUT/monitoring-defaults.yaml"
render monitoring-ha -f tests/chart/values/ha.yaml --set podDisruptionBudget.enabled=true \
  --set monitoring.prometheusRule.enabled=true --set monitoring.prometheusRule.selector=
validate --chart --expect-crds 0 --expect-monitoring PrometheusRule,PodDisruptionBudget "$OUT/monitoring-ha.yaml"
echo "== the chart refuses a PodMonitor without a metrics port"
if "$HELM" template cfm "$CHART" --set monitoring.podMonitor.enabled=true --set metrics.port=0 > /dev/null 2> "$OUT/pm.err"; then
  echo "helm rendered a PodMonitor with metrics.port=0" >&2; exit 1
fi
grep -q "metrics.port is 0" "$OUT/pm.err" || { cat "$OUT/pm.err" >&2; exit 1; }
echo "== our examples against our CRDs"
validate examples/*.yaml

for invalid in tests/chart/values/invalid*.yaml; do
  echo "== values.schema.json rejects $invalid"
  if "$HELM" template cfm "$CHART" -f "$invalid" > /dev/null 2> "$OUT/invalid.err"; then
    echo "helm accepted invalid values $invalid" >&2; exit 1
  fi
  grep -q "values don't meet the specifications of the schema" "$OUT/invalid.err" || { cat "$OUT/invalid.err" >&2; exit 1; }
done

echo "chart-check: OK in $(( $(date +%s) - start ))s ($("$HELM" version --short), Kubernetes $KUBE_VERSION schemas)"
