//! HTTP/2 to the upstream when the cluster asks for it (`typed_extension_protocol_options`
//! with `explicit_http_config.http2_protocol_options`, as istiod renders `h2UpgradePolicy` and
//! gRPC ports): an h2c backend sees HTTP/2 requests, concurrent requests share one connection,
//! and an HTTP/1 client still gets its answer. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;

const HOST: &str = "h2.example.com";

/// An h2c (prior knowledge) backend: answers 200 with `x-backend` and records each request's
/// HTTP version; counts connections.
struct H2Backend {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    versions: Arc<Mutex<Vec<http::Version>>>,
}

async fn h2_backend() -> H2Backend {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = Arc::new(AtomicUsize::new(0));
    let versions = Arc::new(Mutex::new(Vec::new()));
    let (cx, vs) = (connections.clone(), versions.clone());
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            cx.fetch_add(1, Ordering::SeqCst);
            let vs = vs.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let vs = vs.clone();
                        async move {
                            vs.lock().expect("lock").push(req.version());
                            // A little latency, so concurrent requests overlap on the connection.
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            let resp = http::Response::builder()
                                .header("x-backend", "h2")
                                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"h2")))
                                .expect("response");
                            Ok::<_, Infallible>(resp)
                        }
                    });
                let io = hyper_util::rt::TokioIo::new(sock);
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(io, service)
                        .await;
            });
        }
    });
    H2Backend {
        addr,
        connections,
        versions,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clusters_speak_h2_to_the_upstream() {
    let backend = h2_backend().await;
    let mesh = Mesh::start(|port| {
        let mut c = eds_cluster("grpc");
        let opts = HttpProtocolOptions {
            upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(Default::default())),
                },
            )),
            ..Default::default()
        };
        c.typed_extension_protocol_options.insert(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
            any(opts),
        );
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "h",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster("grpc"))],
                )],
            )],
            clusters: vec![c],
            endpoints: vec![cla("grpc", &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "h2").await;
    let before = backend.connections.load(Ordering::SeqCst);
    // Ten at once from one client connection (HTTP/1 downstream: one each on ten connections).
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let url = mesh.url("/");
        tasks.push(tokio::spawn(
            async move { get(&url, Some(HOST), &[]).await },
        ));
    }
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!((r.status, r.body.as_str()), (200, "h2"), "{r:?}");
    }
    let versions = backend.versions.lock().expect("lock").clone();
    assert!(
        versions.iter().all(|v| *v == http::Version::HTTP_2),
        "{versions:?}"
    );
    let opened = backend.connections.load(Ordering::SeqCst) - before;
    // Envoy multiplexes them on the connection it already has (per worker thread).
    assert!(
        opened <= 1,
        "{opened} new upstream connections for 10 concurrent requests"
    );
}
