#!/usr/bin/env bash
# User-space instructions per proxied HTTP/1.1 keep-alive request, counted by valgrind's
# callgrind: a figure that does not move with the machine's noise (wall-clock CPU figures on a
# shared 2-core VM spread by +-15 % between identical runs), for before/after comparisons of a
# change to the request path. Kernel work (the syscalls) is not counted, and `rep movs`/`stos`
# count one instruction per iteration, so large copies weigh more than they cost.
#
#   scripts/instructions-per-request.sh [BINARY...]    (default: target/release/portico)
#   N=20000 RUNS=3 PORTICO_H1_LOOP=pingora scripts/instructions-per-request.sh
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
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
work=$(mktemp -d)
cleanup() {
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  [ -n "${vg:-}" ] && kill "$vg" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
cat >"$work/nginx.conf" <<EOF
worker_processes 1;
pid $work/nginx.pid;
error_log $work/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 100000000;
  client_body_temp_path $work; proxy_temp_path $work; fastcgi_temp_path $work;
  uwsgi_temp_path $work; scgi_temp_path $work;
  server {
    listen 127.0.0.1:$((port + 1));
    location / { return 200 "hello from the backend\n"; }
  }
}
EOF
"$nginx_bin" -c "$work/nginx.conf"
cat >"$work/bootstrap.yaml" <<EOF
node: { id: ir, cluster: ir }
admin: { address: { socket_address: { address: 127.0.0.1, port_value: $((port + 2)) } } }
static_resources:
  listeners:
  - name: ir
    address: { socket_address: { address: 127.0.0.1, port_value: $port } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ir
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
          route_config:
            name: ir
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [ { match: { prefix: / }, route: { cluster: backend } } ] }
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $((port + 1)) } } }
EOF

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
