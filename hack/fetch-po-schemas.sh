#!/usr/bin/env bash
# Install the Prometheus operator's schema validators (npm package @kubernetes-models/prometheus-operator,
# pinned with its dependencies and integrity hashes in hack/prometheus-operator-schemas/package-lock.json)
# into .cache/prometheus-operator-schemas (or $DEST) with `npm ci`, and print that directory.
#
# hack/validate-prometheus-operator.mjs uses them to validate the chart's PodMonitor, ServiceMonitor and
# PrometheusRule (make chart-check). Idempotent: an install made from the same lock file is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=hack/prometheus-operator-schemas
DEST=${DEST:-.cache/prometheus-operator-schemas}
if [ -f "$DEST/.installed" ] && cmp -s "$SRC/package-lock.json" "$DEST/.installed"; then echo "$DEST"; exit 0; fi
command -v node >/dev/null && command -v npm >/dev/null || {
  echo "fetch-po-schemas: node and npm are needed (Debian: apt-get install nodejs npm)" >&2; exit 2; }
rm -rf "$DEST" && mkdir -p "$DEST"
cp "$SRC/package.json" "$SRC/package-lock.json" "$DEST/"
(cd "$DEST" && npm ci --silent --ignore-scripts --no-audit --no-fund) >&2
cp "$SRC/package-lock.json" "$DEST/.installed"
echo "$DEST"
