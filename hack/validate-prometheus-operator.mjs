// Validate Prometheus-operator objects (monitoring.coreos.com/v1 PodMonitor, ServiceMonitor, PrometheusRule)
// with the JSON-schema validators of the npm package @kubernetes-models/prometheus-operator (generated from
// the operator's API types, pkg/apis/monitoring/v1: types, required fields, enums and patterns such as the
// duration format of `interval` and `for`). Installed by hack/fetch-po-schemas.sh.
//
//   node hack/validate-prometheus-operator.mjs MODULES_DIR < docs.json
//
// stdin: a JSON list of objects; stdout: a JSON list, for each object the list of its errors.
// Unknown fields are not reported (the package's schemas allow them, as the API server's pruning would
// drop them silently); hack/validate-manifests.py checks the fields the chart relies on.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const KINDS = ["PodMonitor", "ServiceMonitor", "PrometheusRule"];
const modules = process.argv[2];
if (!modules) {
  console.error("usage: validate-prometheus-operator.mjs MODULES_DIR < docs.json");
  process.exit(2);
}
const base = join(modules, "node_modules", "@kubernetes-models", "prometheus-operator", "monitoring.coreos.com", "v1");
const classes = {};
for (const kind of KINDS) {
  classes[kind] = (await import(pathToFileURL(join(base, `${kind}.js`)).href))[kind];
}
const docs = JSON.parse(readFileSync(0, "utf8"));
const out = docs.map((doc) => {
  if (doc.apiVersion !== "monitoring.coreos.com/v1" || !(doc.kind in classes)) {
    return [`no schema for ${doc.apiVersion} ${doc.kind} (known: monitoring.coreos.com/v1 ${KINDS.join(", ")})`];
  }
  try {
    new classes[doc.kind](doc).validate();
    return [];
  } catch (err) {
    return String(err.message).split(", data").map((m, i) => (i === 0 ? m : `data${m}`));
  }
});
process.stdout.write(JSON.stringify(out));
