#!/usr/bin/env bash
# User-space instructions per proxied HTTP/1.1 keep-alive request, counted by valgrind's
# callgrind: a figure that does not move with the machine's noise (wall-clock CPU figures on a
# shared 2-core VM spread by +-15 % between identical runs), for before/after comparisons of a
# change to the request path. Kernel work (the syscalls) is not counted, and `rep movs`/`stos`
# count one instruction per iteration, so large copies weigh more than they cost.
#
#   scripts/instructions-per-request.sh [BINARY...]    (default: target/release/portico)
#   N=20000 RUNS=3 PORTICO_H1_LOOP=pingora scripts/instructions-per-request.sh
#   CHAIN=istio scripts/instructions-per-request.sh
#
# CHAIN=istio serves the chain of the `vs-envoy` telemetry case instead of the router alone:
# what istiod puts on a gateway (an access log line per request in Istio's format, Zipkin
# tracing at 1 %, gRPC stats, fault, CORS) and istio-proxy's metadata exchange, ALPN and
# `istio.stats`.
#
# Each binary serves N requests from h2load (50 connections) to an nginx backend, after a warm
# up (connections open, pools full); the count covers those N requests only. It prints the
# median of RUNS runs, and the profile of the last run (callgrind_annotate reads it).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${N:-10000}
runs=${RUNS:-3}
port=${PORT:-19380}
for tool in valgrind h2load nginx; do
  if ! command -v "$tool" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$tool" ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    pkg=$tool
    [ "$tool" = h2load ] && pkg=nghttp2-client
    $SUDO apt-get install -y -qq "$pkg" >/dev/null
  fi
done
# shellcheck source=scripts/rig.sh
. scripts/rig.sh
work=$(mktemp -d)
cleanup() {
  rig_stop_backend "$work"
  [ -n "${vg:-}" ] && kill "$vg" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
rig_backend "$work" $((port + 1))
rig_bootstrap "${CHAIN:-router}" "$work/bootstrap.yaml" "$port" $((port + 1)) $((port + 2)) "$work"

url="http://127.0.0.1:$port/"
[ $# -eq 0 ] && set -- target/release/portico
for bin in "$@"; do
  counts=()
  for _ in $(seq 1 "$runs"); do
    rm -f "$work"/cg.*
    valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" "$bin" -c "$work/bootstrap.yaml" \
      >"$work/valgrind.log" 2>&1 &
    vg=$!
    for _ in $(seq 1 200); do
      curl -s -o /dev/null "$url" && break
      sleep 0.3
    done
    h2load -n 3000 -c 50 --h1 "$url" >/dev/null 2>&1
    callgrind_control -d "$vg" >/dev/null 2>&1
    sleep 2
    out=$(h2load -n "$n" -c 50 --h1 "$url" 2>&1)
    if ! grep -q "$n succeeded" <<<"$out"; then
      echo "not every request succeeded:" >&2
      grep -E "^requests:|status codes:" <<<"$out" >&2
      exit 1
    fi
    callgrind_control -d "$vg" >/dev/null 2>&1
    sleep 2
    ir=$(awk '/^summary:/{print $2}' "$work"/cg.*.2)
    counts+=("$((ir / n))")
    kill "$vg" 2>/dev/null || true
    wait "$vg" 2>/dev/null || true
    vg=""
    cp "$work"/cg.*.2 "target/instructions-per-request.callgrind" 2>/dev/null || true
  done
  median=$(printf '%s\n' "${counts[@]}" | sort -n | sed -n "$(((runs + 1) / 2))p")
  echo "$bin: ${median} instructions per request (runs: ${counts[*]})"
done
echo "profile of the last run: target/instructions-per-request.callgrind (callgrind_annotate)"
