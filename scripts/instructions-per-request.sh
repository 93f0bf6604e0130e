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
if [ "${CHAIN:-router}" = istio ]; then
  # The telemetry case's bootstrap (benches/vs-envoy/config.rs, `telemetry_bootstrap`).
  fmt='[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n'
  cat >"$work/bootstrap.yaml" <<EOF
node:
  id: router~10.0.0.1~istio-ingressgateway-5d8f7c9b4-abcde.istio-system~istio-system.svc.cluster.local
  cluster: istio-ingressgateway.istio-system
  metadata:
    NAMESPACE: istio-system
    WORKLOAD_NAME: istio-ingressgateway
    CLUSTER_ID: Kubernetes
    LABELS: { app: istio-ingressgateway, istio: ingressgateway }
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
          stat_prefix: outbound_0.0.0.0_$port
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: $work/access.log
              log_format: { text_format_source: { inline_string: "$fmt" } }
          tracing:
            random_sampling: { value: 1 }
            provider:
              name: envoy.tracers.zipkin
              typed_config:
                "@type": type.googleapis.com/envoy.config.trace.v3.ZipkinConfig
                collector_cluster: zipkin
                collector_endpoint: /api/v2/spans
                collector_endpoint_version: HTTP_JSON
                trace_id_128bit: true
                shared_span_context: false
          http_filters:
          - name: istio.metadata_exchange
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/io.istio.http.peer_metadata.Config
              value:
                upstream_discovery: [ { istio_headers: {} }, { workload_discovery: {} } ]
                upstream_propagation: [ { istio_headers: {} } ]
          - name: envoy.filters.http.grpc_stats
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig
              emit_filter_state: true
              stats_for_all_methods: false
          - name: istio.alpn
            typed_config:
              "@type": type.googleapis.com/istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig
              alpn_override:
              - alpn_override: [ istio-http/1.0, istio, http/1.0 ]
              - upstream_protocol: HTTP11
                alpn_override: [ istio-http/1.1, istio, http/1.1 ]
              - upstream_protocol: HTTP2
                alpn_override: [ istio-h2, istio, h2 ]
          - name: envoy.filters.http.fault
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault }
          - name: envoy.filters.http.cors
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors }
          - name: istio.stats
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/stats.PluginConfig
              value: {}
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
    metadata:
      filter_metadata:
        istio:
          services: [ { host: backend.default.svc.cluster.local, name: backend, namespace: default } ]
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $((port + 1)) } } }
  - name: zipkin
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: zipkin
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $((port + 1)) } } }
EOF
else
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
fi

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
