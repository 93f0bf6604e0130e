//! The configurations both proxies get: static bootstraps for the load cases, ADS snapshots for
//! the scale and churn cases.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;

use crate::common::{self, Snapshot};

/// A static bootstrap: one listener whose routes are `routes` prefixes (`/svc0/` ...) and a
/// final `/`, all to one STATIC cluster with the backend's endpoints.
pub fn static_bootstrap(admin: u16, listener: u16, routes: usize, backends: &[u16]) -> String {
    let mut r = String::new();
    for i in 0..routes {
        r.push_str(&format!(
            "              - match: {{ prefix: /svc{i}/ }}\n                route: {{ cluster: backend }}\n"
        ));
    }
    let eps = endpoints_yaml(backends);
    format!(
        r#"node: {{ id: vs-envoy, cluster: vs-envoy }}
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: listener_{listener}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listener} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
          route_config:
            name: bench
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{r}              - match: {{ prefix: / }}
                route: {{ cluster: backend }}
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
{eps}"#
    )
}

/// A STATIC cluster's `lb_endpoints` entries for 127.0.0.1 at each port.
fn endpoints_yaml(ports: &[u16]) -> String {
    ports
        .iter()
        .map(|p| {
            format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"
            )
        })
        .collect()
}

/// The same bootstrap with the listener terminating TLS 1.3 (HTTP/1.1 by ALPN), its
/// certificate and key read from files, as a Gateway `tls.mode: SIMPLE` server.
pub fn tls_bootstrap(admin: u16, listener: u16, backends: &[u16], cert: &str, key: &str) -> String {
    let plain = static_bootstrap(admin, listener, 0, backends);
    let tls = format!(
        r#"    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            alpn_protocols: ["http/1.1"]
            tls_params: {{ tls_minimum_protocol_version: TLSv1_3, tls_maximum_protocol_version: TLSv1_3 }}
            tls_certificates:
            - certificate_chain: {{ filename: "{cert}" }}
              private_key: {{ filename: "{key}" }}
      filters:
"#
    );
    plain.replacen("    filter_chains:\n    - filters:\n", &tls, 1)
}

/// The plain-text listener with the cluster speaking TLS to the backend (no certificate
/// checks, as a cluster without a validation context; SNI set), as Istio's upstream TLS.
pub fn upstream_tls_bootstrap(admin: u16, listener: u16, tls_port: u16) -> String {
    let plain = static_bootstrap(admin, listener, 0, &[tls_port]);
    plain.replacen(
        "    type: STATIC\n",
        r#"    type: STATIC
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: backend.example
"#,
        1,
    )
}

fn addrs(ports: &[u16]) -> Vec<SocketAddr> {
    ports
        .iter()
        .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
        .collect()
}

pub fn cluster_name(i: usize) -> String {
    format!("outbound|80||svc{i}.bench.svc.cluster.local")
}

/// `n` EDS clusters with 10 endpoints each, and one route config of `n` prefix routes
/// (`/svc{i}/` to cluster i) for the listener on `port`.
pub fn scale_snapshot(port: u16, n: usize, backends: &[u16]) -> Snapshot {
    let eps = addrs(backends);
    let mut clusters: Vec<Cluster> = Vec::with_capacity(n);
    let mut endpoints: Vec<ClusterLoadAssignment> = Vec::with_capacity(n);
    let mut routes = Vec::with_capacity(n);
    for i in 0..n {
        let name = cluster_name(i);
        clusters.push(common::eds_cluster(&name));
        endpoints.push(common::cla(&name, &eps));
        routes.push(common::rt(
            common::prefix(&format!("/svc{i}/")),
            common::to_cluster(&name),
        ));
    }
    Snapshot {
        listeners: vec![common::l(port)],
        routes: vec![common::route_config(
            &common::route_name(port),
            vec![common::vhost("all", &["*"], routes)],
        )],
        clusters,
        endpoints,
        ..Default::default()
    }
}

/// The churn case's config, step `k`: two clusters, a route that alternates between them,
/// endpoint sets and cluster settings that change with `k`.
pub fn churn_snapshot(port: u16, k: usize, backends: &[u16]) -> Snapshot {
    let mut s = Snapshot {
        listeners: vec![common::l(port)],
        ..Default::default()
    };
    for (j, name) in ["churn-a", "churn-b"].iter().enumerate() {
        let mut c = common::eds_cluster(name);
        c.connect_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 1 + ((k / 3 + j) % 2) as i64,
            nanos: 0,
        });
        s.clusters.push(c);
        // A different subset of the backend's ports each step, never empty.
        let pick: Vec<u16> = backends
            .iter()
            .enumerate()
            .filter(|(i, _)| !(i + k + j).is_multiple_of(3))
            .map(|(_, p)| *p)
            .collect();
        s.endpoints.push(common::cla(name, &addrs(&pick)));
    }
    let target = if (k / 2).is_multiple_of(2) {
        "churn-a"
    } else {
        "churn-b"
    };
    s.routes.push(common::route_config(
        &common::route_name(port),
        vec![common::vhost(
            "all",
            &["*"],
            vec![common::rt(common::prefix("/"), common::to_cluster(target))],
        )],
    ));
    s
}

/// Istio's default access log format (meshConfig `accessLogFile` with no format): the line
/// every Istio gateway writes per request.
pub const ISTIO_ACCESS_LOG: &str = "[%START_TIME%] \\\"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\\\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \\\"%UPSTREAM_TRANSPORT_FAILURE_REASON%\\\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \\\"%REQ(X-FORWARDED-FOR)%\\\" \\\"%REQ(USER-AGENT)%\\\" \\\"%REQ(X-REQUEST-ID)%\\\" \\\"%REQ(:AUTHORITY)%\\\" \\\"%UPSTREAM_HOST%\\\" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\\n";

/// The telemetry case: the basic bootstrap with Istio's observability on the connection
/// manager: an access log line per request to `log` in Istio's format, Zipkin tracing at 1 %
/// (spans to the backend, which answers any POST), gRPC stats, fault and CORS as istiod puts
/// them on every gateway, and with `istio` (Portico: istio-proxy's own filters) Istio's
/// metadata exchange, ALPN and standard metrics. Upstream Envoy has no `istio.*` filters; it
/// runs the same chain without them.
pub fn telemetry_bootstrap(
    admin: u16,
    listener: u16,
    backends: &[u16],
    log: &str,
    istio: bool,
) -> String {
    let eps = endpoints_yaml(backends);
    let collector = backends.first().copied().unwrap_or(9411);
    let istio_first = if istio {
        r#"          - name: istio.metadata_exchange
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/io.istio.http.peer_metadata.Config
              value:
                upstream_discovery: [ { istio_headers: {} }, { workload_discovery: {} } ]
                upstream_propagation: [ { istio_headers: {} } ]
"#
    } else {
        ""
    };
    let istio_alpn = if istio {
        r#"          - name: istio.alpn
            typed_config:
              "@type": type.googleapis.com/istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig
              alpn_override:
              - alpn_override: [ istio-http/1.0, istio, http/1.0 ]
              - upstream_protocol: HTTP11
                alpn_override: [ istio-http/1.1, istio, http/1.1 ]
              - upstream_protocol: HTTP2
                alpn_override: [ istio-h2, istio, h2 ]
"#
    } else {
        ""
    };
    let istio_stats = if istio {
        r#"          - name: istio.stats
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/stats.PluginConfig
              value: {}
"#
    } else {
        ""
    };
    format!(
        r#"node:
  id: router~10.0.0.1~istio-ingressgateway-5d8f7c9b4-abcde.istio-system~istio-system.svc.cluster.local
  cluster: istio-ingressgateway.istio-system
  metadata:
    NAMESPACE: istio-system
    WORKLOAD_NAME: istio-ingressgateway
    CLUSTER_ID: Kubernetes
    LABELS: {{ app: istio-ingressgateway, istio: ingressgateway }}
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: listener_{listener}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listener} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: outbound_0.0.0.0_{listener}
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {log}
              log_format: {{ text_format_source: {{ inline_string: "{fmt}" }} }}
          tracing:
            random_sampling: {{ value: 1 }}
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
{istio_first}          - name: envoy.filters.http.grpc_stats
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig
              emit_filter_state: true
              stats_for_all_methods: false
{istio_alpn}          - name: envoy.filters.http.fault
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault }}
          - name: envoy.filters.http.cors
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors }}
{istio_stats}          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
          route_config:
            name: bench
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: / }}
                route: {{ cluster: backend }}
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    metadata:
      filter_metadata:
        istio:
          services: [ {{ host: backend.default.svc.cluster.local, name: backend, namespace: default }} ]
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
{eps}  - name: zipkin
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: zipkin
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {collector} }} }} }}
"#,
        fmt = ISTIO_ACCESS_LOG,
    )
}

/// The JWT issuer of the policy case.
pub const ISSUER: &str = "https://issuer.example";

/// The basic bootstrap with `filters` (YAML list entries at the http_filters indent) before
/// the router.
pub fn policy_bootstrap(admin: u16, listener: u16, backends: &[u16], filters: &str) -> String {
    static_bootstrap(admin, listener, 0, backends).replacen(
        "          http_filters:\n",
        &format!("          http_filters:\n{filters}"),
        1,
    )
}

/// An RBAC filter that allows what none of its `n` DENY policies matches: each policy names
/// one path prefix and a header, so a request to `/` is checked against all of them.
pub fn rbac_filter_yaml(n: usize) -> String {
    let mut policies = String::new();
    for i in 0..n {
        policies.push_str(&format!(
            "                  deny-{i:04}:\n                    permissions:\n                    - and_rules:\n                        rules:\n                        - url_path: {{ path: {{ prefix: /blocked/{i}/ }} }}\n                        - header: {{ name: x-tenant, string_match: {{ exact: t{i} }} }}\n                    principals: [ {{ any: true }} ]\n"
        ));
    }
    format!(
        r#"          - name: envoy.filters.http.rbac
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
              rules:
                action: DENY
                policies:
{policies}"#
    )
}

/// A jwt_authn filter requiring a token from one provider with the key inline.
pub fn jwt_filter_yaml(jwks: &str) -> String {
    format!(
        r#"          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                origins:
                  issuer: {ISSUER}
                  audiences: [ api ]
                  payload_in_metadata: {ISSUER}
                  local_jwks: {{ inline_string: '{jwks}' }}
              rules:
              - match: {{ prefix: / }}
                requires: {{ provider_name: origins }}
"#
    )
}

/// nginx as the reverse proxy for the HTTP/1.1 keep-alive case: one listener on `port`,
/// everything to `backends` round robin (the Envoy bootstrap's cluster), with kept-alive
/// upstream connections. No access log, as the Envoy bootstrap has none.
///
/// `master_process off`: the one nginx process accepts and proxies, as `worker_processes 1`
/// would have its single worker do; the master would only sit idle beside it. One process
/// means its /proc/<pid>/stat is all of nginx's CPU, and its VmRSS all of its memory, read as
/// Portico's and Envoy's are (a master and a worker would need summing, and summed RSS would
/// count the pages they share twice).
///
/// No per-connection request limit on either side (nginx's default closes a connection after
/// 1,000 requests), and idle timeouts longer than any run, as Envoy's defaults.
pub fn nginx_proxy_conf(dir: &str, port: u16, backends: &[u16]) -> String {
    let servers: String = backends
        .iter()
        .map(|p| format!("    server 127.0.0.1:{p};\n"))
        .collect();
    format!(
        r#"worker_processes 1;
master_process off;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  client_body_temp_path {dir}; proxy_temp_path {dir}; fastcgi_temp_path {dir};
  uwsgi_temp_path {dir}; scgi_temp_path {dir};
  upstream backend {{
{servers}    keepalive 64;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"#
    )
}

/// HAProxy for the HTTP/1.1 keep-alive case: one thread, HTTP mode, keep-alive on both sides
/// with server connections shared between clients (`http-reuse always`), round robin over
/// `backends`, no logging (no `log` line). Run in the foreground with `-db`, one process.
pub fn haproxy_conf(port: u16, backends: &[u16]) -> String {
    let servers: String = backends
        .iter()
        .enumerate()
        .map(|(i, p)| format!("  server s{i} 127.0.0.1:{p}\n"))
        .collect();
    format!(
        r#"global
  nbthread 1
  maxconn 8192

defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 1s
  timeout client 300s
  timeout server 300s
  timeout http-keep-alive 300s

frontend bench
  bind 127.0.0.1:{port}
  default_backend backend

backend backend
  balance roundrobin
{servers}"#
    )
}
