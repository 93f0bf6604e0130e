//! Istio's standard metrics (`istio.stats`) and peer metadata exchange
//! (`istio.metadata_exchange`) at a gateway, with the filter chain istiod renders for a gateway
//! listener (metadata exchange, grpc_stats, fault, cors, stats, router; both Istio filters as
//! `TypedStruct`s) and a tcp_proxy chain behind the network `istio.stats`.
//!
//! Portico only: upstream Envoy has no `istio.*` filters (they are istio-proxy's), so against
//! `PORTICO_GATEWAY_BIN=<envoy>` the test returns early (`common::is_envoy`).

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::Cors;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::FilterConfig as GrpcStats;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::google::protobuf::{value::Kind, Any, ListValue, Struct, Value};
use http_body_util::Full;
use hyper::body::Bytes;
use portico::telemetry::istio_stats::{PeerInfo, TypedStruct};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const REVIEWS: &str = "outbound|9080||reviews.default.svc.cluster.local";
const RATINGS: &str = "outbound|9080||ratings.default.svc.cluster.local";
const PEER: &str = "outbound|80||peer.default.svc.cluster.local";
const TCP: &str = "outbound|3306||mysql.db.svc.cluster.local";

fn s(v: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(v.into())),
    }
}

fn st(fields: &[(&str, Value)]) -> Struct {
    Struct {
        fields: fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    }
}

fn sv(fields: &[(&str, Value)]) -> Value {
    Value {
        kind: Some(Kind::StructValue(st(fields))),
    }
}

fn list(values: Vec<Value>) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    }
}

/// A TypedStruct, as istiod wraps Istio's own filter configs.
fn typed_struct(type_url: &str, value: Struct) -> Any {
    Any {
        type_url: "type.googleapis.com/udpa.type.v1.TypedStruct".into(),
        value: TypedStruct {
            type_url: type_url.into(),
            value: Some(value),
        }
        .encode_to_vec(),
    }
}

fn istio_stats() -> Any {
    typed_struct(
        "type.googleapis.com/stats.PluginConfig",
        st(&[(
            "disable_host_header_fallback",
            Value {
                kind: Some(Kind::BoolValue(true)),
            },
        )]),
    )
}

fn http_filter(name: &str, config: Any) -> HttpFilter {
    HttpFilter {
        name: name.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    }
}

/// istiod's gateway chain: `istio.metadata_exchange`, grpc_stats, fault, cors, `istio.stats`,
/// router.
fn gateway_listener(port: u16) -> Listener {
    let mut h = hcm(port);
    let router = h.http_filters.pop().expect("router");
    let mx = typed_struct(
        "type.googleapis.com/io.istio.http.peer_metadata.Config",
        st(&[
            (
                "upstream_discovery",
                list(vec![
                    sv(&[("istio_headers", sv(&[]))]),
                    sv(&[("workload_discovery", sv(&[]))]),
                ]),
            ),
            (
                "upstream_propagation",
                list(vec![sv(&[("istio_headers", sv(&[]))])]),
            ),
        ]),
    );
    h.http_filters = vec![
        http_filter("istio.metadata_exchange", mx),
        http_filter(
            "envoy.filters.http.grpc_stats",
            any(GrpcStats {
                emit_filter_state: true,
                ..Default::default()
            }),
        ),
        http_filter("envoy.filters.http.fault", any(HttpFault::default())),
        http_filter("envoy.filters.http.cors", any(Cors::default())),
        http_filter("istio.stats", istio_stats()),
        router,
    ];
    listener_with(port, h)
}

fn tcp_listener(port: u16) -> Listener {
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        filter_chains: vec![FilterChain {
            filters: vec![
                Filter {
                    name: "istio.stats".into(),
                    config_type: Some(filter::ConfigType::TypedConfig(istio_stats())),
                },
                Filter {
                    name: "envoy.filters.network.tcp_proxy".into(),
                    config_type: Some(filter::ConfigType::TypedConfig(any(TcpProxy {
                        stat_prefix: TCP.into(),
                        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(TCP.into())),
                        ..Default::default()
                    }))),
                },
            ],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// An EDS cluster with istiod's `istio` metadata (`services`).
fn istio_cluster(name: &str, host: &str, svc: &str, ns: &str) -> Cluster {
    let mut c = eds_cluster(name);
    c.metadata = Some(Metadata {
        filter_metadata: [(
            "istio".to_string(),
            st(&[(
                "services",
                list(vec![sv(&[
                    ("host", s(host)),
                    ("name", s(svc)),
                    ("namespace", s(ns)),
                ])]),
            )]),
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    });
    c
}

/// Endpoints with istiod's `istio` metadata `workload`.
fn workload_cla(cluster: &str, eps: &[(SocketAddr, &str)]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster.into(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: eps
                .iter()
                .map(|(a, w)| LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket_addr(&a.ip().to_string(), a.port())),
                        ..Default::default()
                    })),
                    metadata: Some(Metadata {
                        filter_metadata: [("istio".to_string(), st(&[("workload", s(w))]))]
                            .into_iter()
                            .collect(),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The gateway's bootstrap node metadata as istio-agent writes it.
fn bootstrap(admin: u16, ads: u16) -> String {
    let b = bootstrap_yaml(admin, ads);
    let metadata = r#"  metadata:
    WORKLOAD_NAME: istio-ingressgateway
    NAMESPACE: istio-system
    CLUSTER_ID: Kubernetes
    NAME: istio-ingressgateway-7d4f9-abcde
    OWNER: kubernetes://apis/apps/v1/namespaces/istio-system/deployments/istio-ingressgateway
    ISTIO_VERSION: 1.22.1
    LABELS:
      app: istio-ingressgateway
      istio: ingressgateway
      service.istio.io/canonical-name: istio-ingressgateway
      service.istio.io/canonical-revision: latest
"#;
    b.replacen("admin:\n", &format!("{metadata}admin:\n"), 1)
}

/// A backend in the mesh: answers with its own peer metadata headers, and tells what peer
/// metadata the request carried (`x-echo-peer-id`, `x-echo-peer-workload`).
async fn peer_backend() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut me = PeerInfo::from_endpoint("peer-v1;default;peer;v1;Kubernetes").expect("peer");
    me.app = "peer".into();
    me.version = "v1".into();
    let header = me.header_value();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let header = header.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let header = header.clone();
                        async move {
                            let h = req.headers();
                            let id = h
                                .get("x-envoy-peer-metadata-id")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            let workload = h
                                .get("x-envoy-peer-metadata")
                                .and_then(|v| PeerInfo::from_header(v.as_bytes(), &[]))
                                .map(|p| p.workload)
                                .unwrap_or_default();
                            let resp = hyper::Response::builder()
                                .status(200)
                                .header("x-backend", "peer")
                                .header("x-echo-peer-id", id)
                                .header("x-echo-peer-workload", workload)
                                .header(
                                    "x-envoy-peer-metadata-id",
                                    "sidecar~10.0.0.9~peer-v1.default~default.svc.cluster.local",
                                )
                                .header("x-envoy-peer-metadata", header)
                                .body(Full::new(Bytes::from_static(b"peer")))
                                .expect("response");
                            Ok::<_, Infallible>(resp)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, task)
}

/// A TCP echo server.
async fn tcp_echo() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                loop {
                    match c.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if c.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, task)
}

fn find<'a>(
    samples: &'a [(HashMap<String, String>, f64)],
    want: &[(&str, &str)],
) -> Vec<&'a (HashMap<String, String>, f64)> {
    samples
        .iter()
        .filter(|(l, _)| {
            want.iter()
                .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .collect()
}

const SOURCE: [(&str, &str); 9] = [
    ("reporter", "source"),
    ("source_workload", "istio-ingressgateway"),
    ("source_canonical_service", "istio-ingressgateway"),
    ("source_canonical_revision", "latest"),
    ("source_workload_namespace", "istio-system"),
    ("source_principal", "unknown"),
    ("source_app", "istio-ingressgateway"),
    ("source_version", ""),
    ("source_cluster", "Kubernetes"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_metrics_for_http_and_tcp_chains() {
    if is_envoy(&gateway_bin()) {
        // Upstream Envoy has no istio.* filters: it refuses the listener.
        return;
    }
    let reviews = Backend::start("reviews").await;
    let (peer_addr, _peer) = peer_backend().await;
    let (echo_addr, _echo) = tcp_echo().await;
    let port = free_port();
    let tcp_port = free_port();
    let snapshot = Snapshot {
        listeners: vec![gateway_listener(port), tcp_listener(tcp_port)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "gw",
                &["*"],
                vec![
                    rt(prefix("/ok"), to_cluster(REVIEWS)),
                    rt(prefix("/down"), to_cluster(RATINGS)),
                    rt(prefix("/peer"), to_cluster(PEER)),
                ],
            )],
        )],
        clusters: vec![
            istio_cluster(
                REVIEWS,
                "reviews.default.svc.cluster.local",
                "reviews",
                "default",
            ),
            istio_cluster(
                RATINGS,
                "ratings.default.svc.cluster.local",
                "ratings",
                "default",
            ),
            istio_cluster(PEER, "peer.default.svc.cluster.local", "peer", "default"),
            istio_cluster(TCP, "mysql.db.svc.cluster.local", "mysql", "db"),
        ],
        endpoints: vec![
            workload_cla(
                REVIEWS,
                &[(reviews.addr, "reviews-v1;default;reviews;v1;Kubernetes")],
            ),
            // No endpoint at all: no healthy upstream (UH).
            workload_cla(RATINGS, &[]),
            workload_cla(PEER, &[(peer_addr, "peer-v1;default;peer;v1;Kubernetes")]),
            workload_cla(TCP, &[(echo_addr, "mysql-0;db;mysql;v8;Kubernetes")]),
        ],
        ..Default::default()
    };
    let ads = AdsServer::start_any("1", &snapshot).await;
    let ads_port = ads.port;
    let gw = Gateway::start_bootstrap(|admin| bootstrap(admin, ads_port)).await;
    let client = HttpClient::new();
    let url = |p: &str| format!("http://127.0.0.1:{port}{p}");
    let host = Some("gw.example.com");

    eventually("the listener serves", PROPAGATION, || async {
        let st = client.get(&url("/ok"), host, &[]).await.status;
        if st == 200 {
            Ok(())
        } else {
            Err(format!("status {st}"))
        }
    })
    .await;
    let r = client.get(&url("/ok"), host, &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(client.get(&url("/nowhere"), host, &[]).await.status, 404);
    assert_eq!(client.get(&url("/down"), host, &[]).await.status, 503);
    // The peer metadata exchange: the gateway announces itself upstream, and the upstream's
    // answer is read and removed from what the client gets.
    let r = client.get(&url("/peer"), host, &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-echo-peer-id"), Some(NODE_ID));
    assert_eq!(
        r.header("x-echo-peer-workload"),
        Some("istio-ingressgateway")
    );
    assert_eq!(r.header("x-envoy-peer-metadata"), None);
    assert_eq!(r.header("x-envoy-peer-metadata-id"), None);

    // The TCP chain: 5 bytes each way.
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", tcp_port))
        .await
        .expect("connect tcp chain");
    c.write_all(b"hello").await.expect("write");
    let mut buf = [0u8; 5];
    c.read_exact(&mut buf).await.expect("echo");
    assert_eq!(&buf, b"hello");
    drop(c);

    let text = eventually(
        "the TCP connection is reported",
        Duration::from_secs(5),
        || async {
            let text = gw.prometheus().await;
            if prom_samples(&text, "istio_tcp_connections_closed_total").is_empty() {
                Err("no istio_tcp_connections_closed_total yet".to_string())
            } else {
                Ok(text)
            }
        },
    )
    .await;

    let requests = prom_samples(&text, "istio_requests_total");
    // 200 (the first request of `eventually` plus one more), with every label.
    let ok = find(
        &requests,
        &[
            ("response_code", "200"),
            ("destination_workload", "reviews-v1"),
        ],
    );
    assert_eq!(ok.len(), 1, "{requests:?}");
    assert!(ok[0].1 >= 2.0, "{:?}", ok[0]);
    let want_ok = [
        ("destination_workload", "reviews-v1"),
        ("destination_workload_namespace", "default"),
        ("destination_principal", "unknown"),
        ("destination_app", "unknown"),
        ("destination_version", "unknown"),
        ("destination_service", "reviews.default.svc.cluster.local"),
        ("destination_canonical_service", "reviews"),
        ("destination_canonical_revision", "v1"),
        ("destination_service_name", "reviews"),
        ("destination_service_namespace", "default"),
        ("destination_cluster", "Kubernetes"),
        ("request_protocol", "http"),
        ("response_code", "200"),
        ("grpc_response_status", ""),
        ("response_flags", "-"),
        ("connection_security_policy", "unknown"),
    ];
    for (k, v) in SOURCE.iter().chain(want_ok.iter()) {
        assert_eq!(
            ok[0].0.get(*k).map(String::as_str),
            Some(*v),
            "{k} in {:?}",
            ok[0].0
        );
    }
    assert_eq!(
        ok[0].0.len(),
        25,
        "exactly istio-proxy's labels: {:?}",
        ok[0].0
    );
    // 404: no route, NR; nothing known of the destination.
    let nr = find(&requests, &[("response_code", "404")]);
    assert_eq!(nr.len(), 1, "{requests:?}");
    assert_eq!(nr[0].1, 1.0);
    for (k, v) in [
        ("response_flags", "NR"),
        ("destination_service", "unknown"),
        ("destination_service_name", "unknown"),
        ("destination_workload", "unknown"),
        ("destination_canonical_revision", "latest"),
    ] {
        assert_eq!(
            nr[0].0.get(k).map(String::as_str),
            Some(v),
            "{k} in {:?}",
            nr[0].0
        );
    }
    // 503: no healthy upstream, UH; the service from the cluster's metadata.
    let uh = find(&requests, &[("response_code", "503")]);
    assert_eq!(uh.len(), 1, "{requests:?}");
    assert_eq!(uh[0].1, 1.0);
    for (k, v) in [
        ("response_flags", "UH"),
        ("destination_service", "ratings.default.svc.cluster.local"),
        ("destination_service_name", "ratings"),
        ("destination_workload", "unknown"),
    ] {
        assert_eq!(
            uh[0].0.get(k).map(String::as_str),
            Some(v),
            "{k} in {:?}",
            uh[0].0
        );
    }
    // The exchanged metadata names the destination (with its app and version, which the
    // endpoint metadata lacks).
    let peer = find(&requests, &[("destination_workload", "peer-v1")]);
    assert_eq!(peer.len(), 1, "{requests:?}");
    assert_eq!(peer[0].0["destination_app"], "peer");
    assert_eq!(peer[0].0["destination_version"], "v1");
    assert_eq!(
        peer[0].0["destination_service"],
        "peer.default.svc.cluster.local"
    );

    // Histograms, with Istio's (Envoy's default) buckets.
    let le: Vec<String> = find(
        &prom_samples(&text, "istio_request_duration_milliseconds_bucket"),
        &[("response_code", "404")],
    )
    .iter()
    .map(|(l, _)| l["le"].clone())
    .collect();
    assert_eq!(
        le,
        [
            "0.5", "1", "5", "10", "25", "50", "100", "250", "500", "1000", "2500", "5000",
            "10000", "30000", "60000", "300000", "600000", "1800000", "3600000", "+Inf"
        ]
    );
    let buckets = prom_samples(&text, "istio_request_duration_milliseconds_bucket");
    let inf = find(&buckets, &[("response_code", "404"), ("le", "+Inf")]);
    assert_eq!(inf[0].1, 1.0);
    assert_eq!(
        find(
            &prom_samples(&text, "istio_request_duration_milliseconds_count"),
            &[("response_code", "503")]
        )[0]
        .1,
        1.0
    );
    for m in ["istio_request_bytes_count", "istio_response_bytes_count"] {
        assert_eq!(
            find(&prom_samples(&text, m), &[("response_code", "404")])[0].1,
            1.0,
            "{m}"
        );
    }
    assert!(text.contains("# TYPE istio_request_duration_milliseconds histogram"));
    assert!(text.contains("# TYPE istio_requests_total counter"));
    assert_eq!(
        prom_value(&text, "istio_build", "tag", "1.22.1"),
        1.0,
        "istio_build{{component=\"proxy\",tag=\"1.22.1\"}}"
    );

    // TCP: one connection, 5 bytes each way, the destination from the endpoint's metadata.
    for (m, v) in [
        ("istio_tcp_connections_opened_total", 1.0),
        ("istio_tcp_connections_closed_total", 1.0),
        ("istio_tcp_received_bytes_total", 5.0),
        ("istio_tcp_sent_bytes_total", 5.0),
    ] {
        let samples = prom_samples(&text, m);
        assert_eq!(samples.len(), 1, "{m}: {samples:?}");
        let (l, n) = &samples[0];
        assert_eq!(*n, v, "{m}");
        for (k, want) in SOURCE.iter().chain(
            [
                ("destination_workload", "mysql-0"),
                ("destination_workload_namespace", "db"),
                ("destination_service", "mysql.db.svc.cluster.local"),
                ("destination_service_name", "mysql"),
                ("destination_canonical_revision", "v8"),
                ("request_protocol", "tcp"),
                ("response_flags", "-"),
                ("connection_security_policy", "unknown"),
            ]
            .iter(),
        ) {
            assert_eq!(
                l.get(*k).map(String::as_str),
                Some(*want),
                "{m}: {k} in {l:?}"
            );
        }
        assert!(!l.contains_key("response_code"), "{m}: {l:?}");
        assert_eq!(l.len(), 23, "{m}: {l:?}");
    }

    // `/stats` names them as Envoy names a tagged stat.
    let stats = get(&gw.admin_url("/stats"), None, &[]).await.body;
    assert!(
        stats.contains("istiocustom.istio_requests_total.reporter.source.source_workload.istio-ingressgateway."),
        "{stats}"
    );

    // `POST /reset_counters` zeroes Istio's counters too (Envoy keeps them in its store).
    let r = raw_http1(
        gw.admin_port,
        b"POST /reset_counters HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    let text = gw.prometheus().await;
    let requests = prom_samples(&text, "istio_requests_total");
    assert!(
        !requests.is_empty() && requests.iter().all(|(_, v)| *v == 0.0),
        "{requests:?}"
    );
    drop(ads);
}
