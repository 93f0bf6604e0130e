//! Stream and connection-pool timeouts against backends that hang: route `idle_timeout` and the
//! connection manager's `stream_idle_timeout`, `max_stream_duration` (which switches the route
//! timeout off, as in Envoy), gRPC timeouts from the `grpc-timeout` header,
//! `x-envoy-upstream-rq-timeout-ms` (honoured only for internal clients), and the upstream
//! pool's `max_requests_per_connection` and idle timeout. Runs against Envoy too
//! (PORTICO_GATEWAY_BIN).

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::core::v3::{CidrRange, HttpProtocolOptions as CommonOptions};
use envoy_types::pb::envoy::config::route::v3::{route, route_action, RouteAction};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::InternalAddressConfig;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::google::protobuf::{BoolValue, Duration as PDuration, UInt32Value};

const HOST: &str = "timeouts.example.com";

fn ms(n: i64) -> Option<PDuration> {
    Some(PDuration {
        seconds: n / 1000,
        nanos: (n % 1000) as i32 * 1_000_000,
    })
}

/// A route to `pool` with its action changed by `f`.
fn route_with(
    f: impl FnOnce(&mut RouteAction),
) -> envoy_types::pb::envoy::config::route::v3::Route {
    let mut r = rt(prefix("/"), to_cluster("pool"));
    if let Some(route::Action::Route(ra)) = r.action.as_mut() {
        f(ra);
    }
    r
}

async fn mesh_with(
    backend: &Scripted,
    r: envoy_types::pb::envoy::config::route::v3::Route,
    cluster: impl FnOnce(&mut envoy_types::pb::envoy::config::cluster::v3::Cluster),
    hcm_change: impl FnOnce(&mut HttpConnectionManager),
) -> Mesh {
    let mesh = Mesh::start_raw(|port| {
        let mut c = eds_cluster("pool");
        cluster(&mut c);
        let mut h = hcm(port);
        hcm_change(&mut h);
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("t", &[HOST], vec![r])],
            )],
            clusters: vec![c],
            endpoints: vec![cla("pool", &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

async fn plain(backend: &Scripted, r: envoy_types::pb::envoy::config::route::v3::Route) -> Mesh {
    mesh_with(backend, r, |_| {}, |_| {}).await
}

/// The request and how long the gateway took to answer it.
async fn timed(mesh: &Mesh, headers: &[(&str, &str)]) -> (Resp, Duration) {
    let start = Instant::now();
    let r = mesh.get("/", HOST, headers).await;
    (r, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_idle_timeout_answers_504_stream_timeout() {
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_secs(5))]).await;
    let mesh = plain(
        &backend,
        route_with(|ra| {
            ra.idle_timeout = ms(400);
            ra.timeout = ms(3000);
        }),
    )
    .await;
    let (r, took) = timed(&mesh, &[]).await;
    assert_eq!(r.status, 504, "{r:?}");
    assert_eq!(r.body, "stream timeout");
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_millis(2500),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_manager_stream_idle_timeout_and_route_override() {
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_millis(900))]).await;
    let mesh = mesh_with(
        &backend,
        route_with(|ra| ra.timeout = ms(0)),
        |_| {},
        |h| h.stream_idle_timeout = ms(300),
    )
    .await;
    let (r, took) = timed(&mesh, &[]).await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (504, "stream timeout"),
        "{r:?}"
    );
    assert!(took < Duration::from_millis(850), "{took:?}");

    // A route idle timeout of zero switches the connection manager's off for that route.
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_millis(900))]).await;
    let mesh = mesh_with(
        &backend,
        route_with(|ra| {
            ra.timeout = ms(0);
            ra.idle_timeout = ms(0);
        }),
        |_| {},
        |h| h.stream_idle_timeout = ms(300),
    )
    .await;
    let (r, _) = timed(&mesh, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_stream_duration_replaces_the_route_timeout() {
    // The route timeout (200 ms) would cut this 600 ms answer; with max_stream_duration on
    // the route Envoy ignores it.
    let backend = Scripted::start(
        "slow",
        vec![
            Step::Hang(Duration::from_millis(600)),
            Step::Hang(Duration::from_secs(5)),
        ],
    )
    .await;
    let mesh = plain(
        &backend,
        route_with(|ra| {
            ra.timeout = ms(200);
            ra.max_stream_duration = Some(route_action::MaxStreamDuration {
                max_stream_duration: ms(1500),
                ..Default::default()
            });
        }),
    )
    .await;
    let (r, _) = timed(&mesh, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    let head = backend.heads.lock().expect("lock")[0].clone();
    assert!(
        !head.contains("x-envoy-expected-rq-timeout-ms"),
        "no route timeout is announced: {head}"
    );
    let (r, took) = timed(&mesh, &[]).await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (504, "downstream duration timeout"),
        "{r:?}"
    );
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_millis(4000),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_timeout_header_bounds_grpc_requests() {
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_secs(5))]).await;
    // istiod's rendering: no route timeout, max_grpc_timeout 0s (no cap on the header).
    #[allow(deprecated)]
    let mesh = plain(
        &backend,
        route_with(|ra| {
            ra.timeout = ms(0);
            ra.max_grpc_timeout = ms(0);
        }),
    )
    .await;
    let grpc = [
        ("content-type", "application/grpc"),
        ("grpc-timeout", "300m"),
    ];
    let (r, took) = timed(&mesh, &grpc).await;
    assert_eq!(r.status, 200, "gRPC local replies are trailers-only: {r:?}");
    assert_eq!(r.header("grpc-status"), Some("14"), "{r:?}");
    assert_eq!(r.header("grpc-message"), Some("upstream request timeout"));
    assert!(took < Duration::from_millis(2500), "{took:?}");
    let head = backend.heads.lock().expect("lock")[0].clone();
    assert!(head.contains("grpc-timeout: 300m"), "{head}");
    assert!(
        head.contains("x-envoy-expected-rq-timeout-ms: 300"),
        "{head}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_timeout_header_max_sets_the_stream_limit() {
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_secs(5))]).await;
    let mesh = plain(
        &backend,
        route_with(|ra| {
            ra.max_stream_duration = Some(route_action::MaxStreamDuration {
                grpc_timeout_header_max: ms(400),
                ..Default::default()
            });
        }),
    )
    .await;
    // The header asks for 10 s; the route caps it at 400 ms and tells the upstream so.
    let grpc = [
        ("content-type", "application/grpc"),
        ("grpc-timeout", "10S"),
    ];
    let (r, took) = timed(&mesh, &grpc).await;
    assert_eq!(
        r.header("grpc-message"),
        Some("downstream duration timeout"),
        "{r:?}"
    );
    assert!(took < Duration::from_millis(2500), "{took:?}");
    let head = backend.heads.lock().expect("lock")[0].clone();
    assert!(head.contains("grpc-timeout: 400m"), "{head}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeout_header_only_from_internal_clients() {
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_millis(700))]).await;
    // No internal_address_config: every client is external and the header is dropped.
    let mesh = plain(&backend, rt(prefix("/"), to_cluster("pool"))).await;
    let (r, _) = timed(&mesh, &[("x-envoy-upstream-rq-timeout-ms", "100")]).await;
    assert_eq!(r.status, 200, "{r:?}");
    let head = backend.heads.lock().expect("lock")[0].clone();
    assert!(!head.contains("x-envoy-upstream-rq-timeout-ms"), "{head}");
    assert!(
        head.contains("x-envoy-expected-rq-timeout-ms: 15000"),
        "{head}"
    );
    assert!(!head.contains("x-envoy-internal"), "{head}");

    // Loopback declared internal: the header sets the route timeout.
    let backend = Scripted::start("slow", vec![Step::Hang(Duration::from_millis(700))]).await;
    let mesh = mesh_with(
        &backend,
        rt(prefix("/"), to_cluster("pool")),
        |_| {},
        |h| {
            h.use_remote_address = Some(BoolValue { value: true });
            h.internal_address_config = Some(InternalAddressConfig {
                cidr_ranges: vec![CidrRange {
                    address_prefix: "127.0.0.0".into(),
                    prefix_len: Some(UInt32Value { value: 8 }),
                }],
                ..Default::default()
            });
        },
    )
    .await;
    let (r, took) = timed(&mesh, &[("x-envoy-upstream-rq-timeout-ms", "200")]).await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (504, "upstream request timeout"),
        "{r:?}"
    );
    assert!(took < Duration::from_millis(650), "{took:?}");
    let head = backend.heads.lock().expect("lock")[0].clone();
    assert!(head.contains("x-envoy-internal: true"), "{head}");
    assert!(
        head.contains("x-envoy-expected-rq-timeout-ms: 200"),
        "{head}"
    );
    assert!(!head.contains("x-envoy-upstream-rq-timeout-ms"), "{head}");
    assert!(!head.contains("x-envoy-external-address"), "{head}");
}

fn pool_options(
    o: CommonOptions,
) -> impl FnOnce(&mut envoy_types::pb::envoy::config::cluster::v3::Cluster) {
    move |c| {
        let opts = HttpProtocolOptions {
            common_http_protocol_options: Some(o),
            upstream_protocol_options: Some(
                envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                    envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::ExplicitHttpConfig {
                        protocol_config: Some(envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::explicit_http_config::ProtocolConfig::HttpProtocolOptions(Default::default())),
                    },
                ),
            ),
            ..Default::default()
        };
        c.typed_extension_protocol_options.insert(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
            any(opts),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_requests_per_connection_opens_new_connections() {
    let backend = Scripted::start("b", vec![Step::Status(200)]).await;
    let mesh = mesh_with(
        &backend,
        rt(prefix("/"), to_cluster("pool")),
        pool_options(CommonOptions {
            max_requests_per_connection: Some(UInt32Value { value: 2 }),
            ..Default::default()
        }),
        |_| {},
    )
    .await;
    // One request at a time, so the pool never needs a second connection for concurrency.
    for _ in 0..6 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert_eq!(backend.served(), 6);
    assert_eq!(backend.connections(), 3, "two requests per connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_the_idle_timeout() {
    let backend = Scripted::start("b", vec![Step::Status(200)]).await;
    let mesh = mesh_with(
        &backend,
        rt(prefix("/"), to_cluster("pool")),
        pool_options(CommonOptions {
            idle_timeout: ms(300),
            ..Default::default()
        }),
        |_| {},
    )
    .await;
    for _ in 0..3 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(r.status, 200, "{r:?}");
    }
    let busy = backend.connections();
    tokio::time::sleep(Duration::from_millis(900)).await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        backend.connections(),
        busy + 1,
        "the idle connection was closed, so a new one was opened"
    );

    // With the default (one hour) the connection stays for the next request.
    let backend = Scripted::start("b", vec![Step::Status(200)]).await;
    let mesh = plain(&backend, rt(prefix("/"), to_cluster("pool"))).await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    let busy = backend.connections();
    tokio::time::sleep(Duration::from_millis(900)).await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(backend.connections(), busy);
}
