# The load rig the request-path scripts share (sourced, not run): an nginx backend and the
# bootstraps that put Portico in front of it. `instructions-per-request.sh` counts a request
# on it; `pgo-build.sh` trains the profile-guided build on it.

# rig_backend WORK PORT [TLS_PORT CERT KEY]: starts nginx (one worker) answering every request
# with a 23-byte body on PORT (and with TLS on TLS_PORT); its pid file is WORK/nginx.pid.
rig_backend() {
  local work=$1 port=$2 tls=""
  if [ $# -ge 5 ]; then
    tls="server { listen 127.0.0.1:$3 ssl; ssl_certificate $4; ssl_certificate_key $5;
    location / { return 200 \"hello from the backend\\n\"; } }"
  fi
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
    listen 127.0.0.1:$port;
    location / { return 200 "hello from the backend\n"; }
  }
  $tls
}
EOF
  "$(command -v nginx || echo /usr/sbin/nginx)" -c "$work/nginx.conf"
}

# rig_cert WORK: a throwaway self-signed certificate for `backend.example`, WORK/cert.pem and
# WORK/key.pem (the TLS listener's and the TLS backend's).
rig_cert() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=backend.example -addext subjectAltName=DNS:backend.example \
    -keyout "$1/key.pem" -out "$1/cert.pem" 2>/dev/null
}

# rig_stop_backend WORK
rig_stop_backend() {
  [ -f "$1/nginx.pid" ] && kill "$(cat "$1/nginx.pid")" 2>/dev/null || true
}

# rig_bootstrap CHAIN FILE LISTENER BACKEND ADMIN WORK [CERT KEY]: a static bootstrap, one
# listener on LISTENER routing every request to BACKEND. CHAIN:
#   router  the router alone;
#   istio   what istiod puts on a gateway (an access log line per request in Istio's format into
#           WORK/access.log, Zipkin tracing at 1 %, gRPC stats, fault, CORS) and istio-proxy's
#           metadata exchange, ALPN and `istio.stats` (the `vs-envoy` telemetry case's chain);
#   tls     the router behind a TLS 1.3 listener (CERT, KEY; h2 and http/1.1 by ALPN);
#   upstream-tls  the router, the cluster speaking TLS to BACKEND (no certificate checks).
rig_bootstrap() {
  local chain=$1 file=$2 port=$3 backend=$4 admin=$5 work=$6 cert=${7:-} key=${8:-}
  local node="{ id: ir, cluster: ir }" prefix=ir tls_socket="" upstream_tls="" filters extra="" zipkin=""
  filters='          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }'
  case "$chain" in
    router) ;;
    tls)
      tls_socket="
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            alpn_protocols: [h2, http/1.1]
            tls_params: { tls_minimum_protocol_version: TLSv1_3, tls_maximum_protocol_version: TLSv1_3 }
            tls_certificates:
            - certificate_chain: { filename: \"$cert\" }
              private_key: { filename: \"$key\" }"
      ;;
    upstream-tls)
      upstream_tls="
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: backend.example"
      ;;
    istio)
      prefix=outbound_0.0.0.0_$port
      node='
  id: router~10.0.0.1~istio-ingressgateway-5d8f7c9b4-abcde.istio-system~istio-system.svc.cluster.local
  cluster: istio-ingressgateway.istio-system
  metadata:
    NAMESPACE: istio-system
    WORKLOAD_NAME: istio-ingressgateway
    CLUSTER_ID: Kubernetes
    LABELS: { app: istio-ingressgateway, istio: ingressgateway }'
      local fmt='[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n'
      extra="
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: $work/access.log
              log_format: { text_format_source: { inline_string: \"$fmt\" } }
          tracing:
            random_sampling: { value: 1 }
            provider:
              name: envoy.tracers.zipkin
              typed_config:
                \"@type\": type.googleapis.com/envoy.config.trace.v3.ZipkinConfig
                collector_cluster: zipkin
                collector_endpoint: /api/v2/spans
                collector_endpoint_version: HTTP_JSON
                trace_id_128bit: true
                shared_span_context: false"
      filters='          - name: istio.metadata_exchange
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
'"$filters"
      zipkin="
    metadata:
      filter_metadata:
        istio:
          services: [ { host: backend.default.svc.cluster.local, name: backend, namespace: default } ]
  - name: zipkin
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: zipkin
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $backend } } }"
      ;;
    *)
      echo "rig_bootstrap: unknown chain $chain" >&2
      return 1
      ;;
  esac
  cat >"$file" <<EOF
node: $node
admin: { address: { socket_address: { address: 127.0.0.1, port_value: $admin } } }
static_resources:
  listeners:
  - name: ir
    address: { socket_address: { address: 127.0.0.1, port_value: $port } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: $prefix$extra
          http_filters:
$filters
          route_config:
            name: ir
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [ { match: { prefix: / }, route: { cluster: backend } } ] }$tls_socket
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s$upstream_tls
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $backend } } }$zipkin
EOF
}
