#!/usr/bin/env bash
# Put Debian's `prometheus` and `promtool` at .cache/prometheus/bin/ (or $DEST) and print that directory.
#
# Both come from Debian's `prometheus` package (bookworm: 2.42.0+ds), fetched with `apt-get download` and
# unpacked with `dpkg-deb -x`: nothing is installed system-wide and no service is started (installing the
# package with apt-get would create a user and try to start prometheus.service). The binaries need only libc.
# `promtool check rules` / `promtool test rules` and the live-Prometheus integration test use them
# (docs/operations.md, "How the monitoring is tested").
#
# Idempotent: binaries that are already there and report a usable version are reused (no network).
# `apt-get download` needs apt's package lists; when they are missing and we are root, `apt-get update`
# is run once (CI); otherwise it says what to do.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.cache/prometheus}
BIN="$DEST/bin"
MIN_MINOR=42  # 2.42 (bookworm) or later: promtool test rules as tests/monitoring uses it

usable() {
  [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ] || return 1
  local v
  v=$("$BIN/promtool" --version 2>&1 | sed -n 's/^promtool, version \([0-9]*\)\.\([0-9]*\)\..*/\1 \2/p')
  [ -n "$v" ] || return 1
  set -- $v
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge "$MIN_MINOR" ]; }
}

if usable; then echo "$BIN"; exit 0; fi

for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || {
    echo "fetch-prometheus: $tool not found. On a non-Debian machine put prometheus and promtool (2.$MIN_MINOR or" \
         "later) in $BIN yourself." >&2
    exit 2
  }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sandbox=()  # as root, apt would drop to user _apt, who cannot write into our private temporary directory
[ "$(id -u)" = 0 ] && sandbox=(-o APT::Sandbox::User=root)
download() { (cd "$tmp" && apt-get download -qq "${sandbox[@]}" prometheus) >&2; }
if ! download; then
  if [ "$(id -u)" = 0 ]; then
    echo "fetch-prometheus: apt-get download failed; running apt-get update once" >&2
    apt-get update -qq >&2
    download
  else
    echo "fetch-prometheus: apt-get download prometheus failed: run 'sudo apt-get update' and try again" >&2
    exit 2
  fi
fi
deb=$(ls "$tmp"/prometheus_*.deb)
dpkg-deb -x "$deb" "$tmp/root"
mkdir -p "$BIN"
for tool in prometheus promtool; do
  install -m 0755 "$tmp/root/usr/bin/$tool" "$BIN/$tool.tmp"
  mv "$BIN/$tool.tmp" "$BIN/$tool"
done
usable || { echo "fetch-prometheus: $BIN/promtool is older than 2.$MIN_MINOR: $("$BIN/promtool" --version 2>&1 | head -1)" >&2; exit 2; }
echo "fetch-prometheus: $(basename "$deb") unpacked into $BIN ($("$BIN/prometheus" --version 2>&1 | head -1))" >&2
echo "$BIN"
