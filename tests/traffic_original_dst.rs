//! ORIGINAL_DST clusters as Envoy's original_dst cluster serves them at a gateway: the request's
//! `x-envoy-original-dst-host` (or the configured header) names the host; a missing or
//! malformed header (no listener filter restores the connection's destination) answers 503
//! `no healthy upstream` with `upstream_cx_none_healthy` (and `original_dst_host_invalid`)
//! counted. istiod's shapes (PassthroughCluster, BlackHoleCluster) are ACKed; a cluster with
//! `upstream_bind_config` connects from its source address, and one with istiod's
//! `use_downstream_protocol_config` speaks HTTP/2 upstream to HTTP/2 clients only. Runs against
//! Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::net::SocketAddr;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers, cluster, CircuitBreakers, Cluster,
};
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    UpstreamProtocolOptions, UseDownstreamHttpConfig,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};

const HOST: &str = "od.example.com";
const NO_HOST: &str = "no healthy upstream";

fn original_dst(name: &str, lb: Option<cluster::OriginalDstLbConfig>) -> Cluster {
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: cluster::LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(PbDuration {
            seconds: 1,
            nanos: 0,
        }),
        lb_config: lb.map(cluster::LbConfig::OriginalDstLbConfig),
        ..Default::default()
    }
}

fn use_header(name: &str, port_override: Option<u16>) -> Option<cluster::OriginalDstLbConfig> {
    Some(cluster::OriginalDstLbConfig {
        use_http_header: true,
        http_header_name: name.into(),
        upstream_port_override: port_override.map(|p| UInt32Value { value: p.into() }),
        ..Default::default()
    })
}

/// istiod's PassthroughCluster (without its Istio-only `istio.metadata_exchange` filter,
/// which stock Envoy does not know): ORIGINAL_DST, no header, max circuit breakers, the
/// client's protocol upstream, idle timeout 300 s.
fn istio_passthrough() -> Cluster {
    let max = Some(UInt32Value { value: u32::MAX });
    let mut c = original_dst("PassthroughCluster", None);
    c.connect_timeout = Some(PbDuration {
        seconds: 10,
        nanos: 0,
    });
    c.circuit_breakers = Some(CircuitBreakers {
        thresholds: vec![circuit_breakers::Thresholds {
            max_connections: max,
            max_pending_requests: max,
            max_requests: max,
            max_retries: max,
            track_remaining: true,
            ..Default::default()
        }],
        ..Default::default()
    });
    let options = HttpProtocolOptions {
        common_http_protocol_options: Some(corepb::HttpProtocolOptions {
            idle_timeout: Some(PbDuration {
                seconds: 300,
                nanos: 0,
            }),
            ..Default::default()
        }),
        upstream_protocol_options: Some(UpstreamProtocolOptions::UseDownstreamProtocolConfig(
            UseDownstreamHttpConfig {
                http_protocol_options: Some(Default::default()),
                http2_protocol_options: Some(Default::default()),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    c.typed_extension_protocol_options.insert(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
        any(options),
    );
    c
}

/// istiod's BlackHoleCluster: STATIC with no endpoints.
fn istio_black_hole() -> Cluster {
    Cluster {
        name: "BlackHoleCluster".into(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Static as i32,
        )),
        connect_timeout: Some(PbDuration {
            seconds: 10,
            nanos: 0,
        }),
        ..Default::default()
    }
}

/// A backend that answers with the address the connection came from (`x-peer`).
async fn peer_echo() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, peer)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = vec![0u8; 4096];
                let mut seen = Vec::new();
                // One request per connection: read the head, answer, close.
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nx-backend: peer-echo\r\nx-peer: {}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    peer.ip()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

async fn stat(mesh: &Mesh, cluster: &str, stat: &str) -> f64 {
    let (metric, label) = envoy_cluster_metric(cluster, stat);
    prom_value(
        &mesh.gw.prometheus().await,
        &metric,
        "envoy_cluster_name",
        &label,
    )
}

/// `upstream_rq_<code>`: Envoy's Prometheus output puts the code in a label.
async fn code(mesh: &Mesh, cluster: &str, code: u16) -> f64 {
    let (metric, label) = envoy_cluster_metric(cluster, "upstream_rq");
    prom_samples(&mesh.gw.prometheus().await, &metric)
        .into_iter()
        .filter(|(l, _)| {
            l.get("envoy_cluster_name") == Some(&label)
                && l.get("envoy_response_code") == Some(&code.to_string())
        })
        .map(|(_, v)| v)
        .sum()
}

async fn mesh(clusters: Vec<Cluster>, routes: Vec<(&str, &str)>) -> Mesh {
    let routes: Vec<_> = routes
        .into_iter()
        .map(|(p, c)| rt(prefix(p), to_cluster(c)))
        .collect();
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            // With the port too, for HTTP/2 clients, whose authority carries it.
            vec![vhost("od", &[HOST, &format!("{HOST}:{port}")], routes)],
        )],
        clusters,
        ..Default::default()
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_names_the_host() {
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    let mesh = mesh(
        vec![
            original_dst("od", use_header("", None)),
            original_dst("od-custom", use_header("X-Target", None)),
            original_dst("od-port", use_header("", Some(b.addr.port()))),
        ],
        vec![("/custom", "od-custom"), ("/port", "od-port"), ("/", "od")],
    )
    .await;
    for backend in [&a, &b] {
        let target = backend.addr.to_string();
        let r = mesh
            .get("/", HOST, &[("x-envoy-original-dst-host", &target)])
            .await;
        assert_eq!(
            (r.status, r.backend()),
            (200, Some(backend.name.as_str())),
            "{r:?}"
        );
    }
    // http_header_name replaces the default header, which then counts for nothing.
    let r = mesh
        .get("/custom", HOST, &[("x-target", &a.addr.to_string())])
        .await;
    assert_eq!((r.status, r.backend()), (200, Some("a")), "{r:?}");
    let r = mesh
        .get(
            "/custom",
            HOST,
            &[("x-envoy-original-dst-host", &a.addr.to_string())],
        )
        .await;
    assert_eq!((r.status, r.body.as_str()), (503, NO_HOST), "{r:?}");
    // upstream_port_override keeps the header's address and replaces its port.
    let r = mesh
        .get(
            "/port",
            HOST,
            &[("x-envoy-original-dst-host", "127.0.0.1:1")],
        )
        .await;
    assert_eq!((r.status, r.backend()), (200, Some("b")), "{r:?}");
    assert_eq!(code(&mesh, "od", 200).await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_malformed_header_answers_no_healthy_upstream() {
    let a = Backend::start("a").await;
    let mesh = mesh(
        vec![original_dst("od", use_header("", None))],
        vec![("/", "od")],
    )
    .await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!((r.status, r.body.as_str()), (503, NO_HOST), "{r:?}");
    // Not `ip:port`: a name, no port, a port out of range. Envoy parses only literals.
    let port = a.addr.port().to_string();
    for bad in [
        format!("localhost:{port}"),
        "127.0.0.1".to_string(),
        "127.0.0.1:70000".to_string(),
        "bogus".to_string(),
    ] {
        let r = mesh
            .get("/", HOST, &[("x-envoy-original-dst-host", &bad)])
            .await;
        assert_eq!((r.status, r.body.as_str()), (503, NO_HOST), "{bad}: {r:?}");
    }
    assert_eq!(a.served(), 0);
    assert_eq!(stat(&mesh, "od", "upstream_cx_none_healthy").await, 5.0);
    assert_eq!(stat(&mesh, "od", "original_dst_host_invalid").await, 4.0);
    assert_eq!(code(&mesh, "od", 503).await, 5.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_passthrough_and_black_hole_are_accepted_and_answer_503() {
    let a = Backend::start("a").await;
    let mesh = mesh(
        vec![istio_passthrough(), istio_black_hole()],
        vec![("/pass", "PassthroughCluster"), ("/", "BlackHoleCluster")],
    )
    .await;
    assert!(
        !mesh
            .ads
            .log()
            .iter()
            .any(|r| r.type_url == CDS && r.is_nack()),
        "istiod's clusters are ACKed"
    );
    // No header option and no listener filter restoring the destination: a gateway's
    // PassthroughCluster has no host, whatever the request carries.
    let r = mesh
        .get(
            "/pass",
            HOST,
            &[("x-envoy-original-dst-host", &a.addr.to_string())],
        )
        .await;
    assert_eq!((r.status, r.body.as_str()), (503, NO_HOST), "{r:?}");
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!((r.status, r.body.as_str()), (503, NO_HOST), "{r:?}");
    assert_eq!(a.served(), 0);
    for c in ["PassthroughCluster", "BlackHoleCluster"] {
        assert_eq!(stat(&mesh, c, "upstream_cx_none_healthy").await, 1.0, "{c}");
        assert_eq!(code(&mesh, c, 503).await, 1.0, "{c}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_bind_config_sets_the_source_address() {
    let echo = peer_echo().await;
    let mut bound = original_dst("od-bound", use_header("", None));
    bound.upstream_bind_config = Some(corepb::BindConfig {
        source_address: Some(corepb::SocketAddress {
            address: "127.0.0.6".into(),
            port_specifier: Some(corepb::socket_address::PortSpecifier::PortValue(0)),
            ..Default::default()
        }),
        ..Default::default()
    });
    let mesh = mesh(
        vec![bound, original_dst("od", use_header("", None))],
        vec![("/bound", "od-bound"), ("/", "od")],
    )
    .await;
    let target = echo.to_string();
    let r = mesh
        .get("/bound", HOST, &[("x-envoy-original-dst-host", &target)])
        .await;
    assert_eq!(
        (r.status, r.header("x-peer")),
        (200, Some("127.0.0.6")),
        "{r:?}"
    );
    let r = mesh
        .get("/", HOST, &[("x-envoy-original-dst-host", &target)])
        .await;
    assert_eq!(
        (r.status, r.header("x-peer")),
        (200, Some("127.0.0.1")),
        "{r:?}"
    );
}

/// A backend speaking HTTP/1.1 and h2c (told apart by the HTTP/2 preface), answering with the
/// request's HTTP version in `x-version`.
async fn either_protocol() -> SocketAddr {
    use std::convert::Infallible;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let resp = http::Response::builder()
                            .header("x-backend", "either")
                            .header("x-version", format!("{:?}", req.version()))
                            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"ok")))
                            .expect("response");
                        Ok::<_, Infallible>(resp)
                    },
                );
                let mut preface = [0u8; 3];
                let h2 = matches!(sock.peek(&mut preface).await, Ok(3) if &preface == b"PRI");
                let io = hyper_util::rt::TokioIo::new(sock);
                if h2 {
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(io, service)
                    .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn use_downstream_protocol_config_speaks_the_clients_protocol() {
    let backend = either_protocol().await;
    let mut c = istio_passthrough();
    c.name = "client-protocol".into();
    c.lb_config = use_header("", None).map(cluster::LbConfig::OriginalDstLbConfig);
    let mesh = mesh(vec![c], vec![("/", "client-protocol")]).await;
    let target = backend.to_string();
    let r = mesh
        .get("/", HOST, &[("x-envoy-original-dst-host", &target)])
        .await;
    assert_eq!(
        (r.status, r.header("x-version")),
        (200, Some("HTTP/1.1")),
        "{r:?}"
    );
    // HTTP/2 has no Host header: the URL's authority names the virtual host.
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .resolve(HOST, SocketAddr::from(([127, 0, 0, 1], mesh.port)))
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("h2c client");
    let r = h2
        .get(format!("http://{HOST}:{}/", mesh.port))
        .header("x-envoy-original-dst-host", &target)
        .send()
        .await
        .expect("h2c request");
    assert_eq!(r.version(), http::Version::HTTP_2);
    assert_eq!(
        (
            r.status().as_u16(),
            r.headers().get("x-version").and_then(|v| v.to_str().ok())
        ),
        (200, Some("HTTP/2.0"))
    );
}
