//! gRPC end to end: a tonic client (h2c prior knowledge) through the gateway to a tonic backend
//! on an HTTP/2 cluster. Unary, server, client and bidi streaming; `grpc-timeout` under the
//! route's `max_stream_duration.grpc_timeout_header_max` and deprecated `max_grpc_timeout`; a
//! backend's error status, message and trailers passed through; the gateway's own errors (no
//! route, no healthy upstream, upstream timeout) as trailers-only gRPC statuses. Runs against
//! Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::convert::Infallible;
use std::pin::Pin;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::route::v3::{route, route_action, RouteAction};
use futures::{Stream, StreamExt};
use tonic::codegen::{http as thttp, BoxFuture, Service};
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

const HOST: &str = "grpc.example.com";

/// The test service's one message, written by hand (no protoc here).
#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(string, tag = "1")]
    text: String,
    /// Server streaming: how many replies.
    #[prost(uint32, tag = "2")]
    count: u32,
    /// How long the backend waits before it answers.
    #[prost(uint64, tag = "3")]
    delay_ms: u64,
    /// Non-zero: the backend fails with this gRPC code (after `count` replies when streaming).
    #[prost(int32, tag = "4")]
    fail: i32,
}

type EchoStream = Pin<Box<dyn Stream<Item = Result<Echo, Status>> + Send>>;

fn failure(m: &Echo) -> Status {
    let mut s = Status::new(Code::from(m.fail), format!("backend says no: {} ✓", m.text));
    s.metadata_mut()
        .insert("x-backend-trailer", "t1".parse().expect("ascii"));
    s
}

struct Unary;
impl tonic::server::UnaryService<Echo> for Unary {
    type Response = Echo;
    type Future = BoxFuture<Response<Echo>, Status>;
    fn call(&mut self, req: Request<Echo>) -> Self::Future {
        Box::pin(async move {
            let m = req.into_inner();
            tokio::time::sleep(Duration::from_millis(m.delay_ms)).await;
            if m.fail != 0 {
                return Err(failure(&m));
            }
            let mut r = Response::new(Echo {
                text: format!("unary {}", m.text),
                ..Default::default()
            });
            r.metadata_mut()
                .insert("x-backend", "grpc".parse().expect("ascii"));
            Ok(r)
        })
    }
}

struct ServerStream;
impl tonic::server::ServerStreamingService<Echo> for ServerStream {
    type Response = Echo;
    type ResponseStream = EchoStream;
    type Future = BoxFuture<Response<EchoStream>, Status>;
    fn call(&mut self, req: Request<Echo>) -> Self::Future {
        Box::pin(async move {
            let m = req.into_inner();
            let n = m.count;
            let tail = (m.fail != 0).then(|| Err(failure(&m)));
            let items = (0..n).map(move |i| {
                Ok(Echo {
                    text: format!("{} {i}", m.text),
                    ..Default::default()
                })
            });
            let s = futures::stream::iter(items.chain(tail)).then(|x| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                x
            });
            Ok(Response::new(Box::pin(s) as EchoStream))
        })
    }
}

struct ClientStream;
impl tonic::server::ClientStreamingService<Echo> for ClientStream {
    type Response = Echo;
    type Future = BoxFuture<Response<Echo>, Status>;
    fn call(&mut self, req: Request<Streaming<Echo>>) -> Self::Future {
        Box::pin(async move {
            let mut s = req.into_inner();
            let mut all = Vec::new();
            while let Some(m) = s.message().await? {
                all.push(m.text);
            }
            Ok(Response::new(Echo {
                text: all.join(","),
                count: all.len() as u32,
                ..Default::default()
            }))
        })
    }
}

struct Bidi;
impl tonic::server::StreamingService<Echo> for Bidi {
    type Response = Echo;
    type ResponseStream = EchoStream;
    type Future = BoxFuture<Response<EchoStream>, Status>;
    fn call(&mut self, req: Request<Streaming<Echo>>) -> Self::Future {
        Box::pin(async move {
            let s = req.into_inner().map(|m| {
                m.map(|m| Echo {
                    text: format!("bidi {}", m.text),
                    ..Default::default()
                })
            });
            Ok(Response::new(Box::pin(s) as EchoStream))
        })
    }
}

/// The backend's service, routed by method path as generated code would.
#[derive(Clone)]
struct EchoService;

impl tonic::server::NamedService for EchoService {
    const NAME: &'static str = "test.Echo";
}

impl<B> Service<thttp::Request<B>> for EchoService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = thttp::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: thttp::Request<B>) -> Self::Future {
        let path = req.uri().path().to_string();
        Box::pin(async move {
            let mut g = tonic::server::Grpc::new(ProstCodec::<Echo, Echo>::default());
            Ok(match path.as_str() {
                "/test.Echo/Unary" => g.unary(Unary, req).await,
                "/test.Echo/ServerStream" => g.server_streaming(ServerStream, req).await,
                "/test.Echo/ClientStream" => g.client_streaming(ClientStream, req).await,
                "/test.Echo/Bidi" => g.streaming(Bidi, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

/// The backend, served by hyper directly: tonic's own server would enforce `grpc-timeout`
/// itself and race the gateway's timers.
async fn grpc_backend() -> std::net::SocketAddr {
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
                let svc =
                    hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| {
                        EchoService.call(req)
                    });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                        .await;
            });
        }
    });
    addr
}

fn pb_duration(ms: u64) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

fn route_to(
    m: envoy_types::pb::envoy::config::route::v3::RouteMatch,
    cluster: &str,
    f: impl FnOnce(&mut RouteAction),
) -> envoy_types::pb::envoy::config::route::v3::Route {
    let mut r = rt(m, to_cluster(cluster));
    if let Some(route::Action::Route(ra)) = r.action.as_mut() {
        f(ra);
    }
    r
}

/// Services by package prefix: `/test.Echo/` on the backend; `/deadline.Echo/` (rewritten to
/// `/test.Echo/`) with `grpc_timeout_header_max`; `/legacy.Echo/` with `max_grpc_timeout`;
/// `/short.Echo/` with a 300 ms route timeout; `/empty.Echo/` to a cluster without endpoints.
async fn mesh(backend: std::net::SocketAddr) -> Mesh {
    let mesh = Mesh::start(|port| {
        let rewrite = |ra: &mut RouteAction| ra.prefix_rewrite = "/test.Echo/".into();
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "grpc",
                    &[HOST],
                    vec![
                        route_to(prefix("/deadline.Echo/"), "grpc", |ra| {
                            rewrite(ra);
                            ra.max_stream_duration = Some(route_action::MaxStreamDuration {
                                grpc_timeout_header_max: Some(pb_duration(300)),
                                ..Default::default()
                            });
                        }),
                        #[allow(deprecated)]
                        route_to(prefix("/legacy.Echo/"), "grpc", |ra| {
                            rewrite(ra);
                            ra.max_grpc_timeout = Some(pb_duration(300));
                        }),
                        route_to(prefix("/short.Echo/"), "grpc", |ra| {
                            rewrite(ra);
                            ra.timeout = Some(pb_duration(300));
                        }),
                        route_to(prefix("/empty.Echo/"), "empty", rewrite),
                        // Streams stay open for as long as a test needs.
                        route_to(prefix("/"), "grpc", |ra| ra.timeout = Some(pb_duration(0))),
                    ],
                )],
            )],
            clusters: vec![h2_cluster("grpc"), h2_cluster("empty")],
            endpoints: vec![cla("grpc", &[backend]), cla("empty", &[])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

type Client = tonic::client::Grpc<tonic::transport::Channel>;

async fn client(port: u16, host: &str) -> Client {
    let origin: thttp::Uri = format!("http://{host}").parse().expect("uri");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("endpoint")
        .origin(origin)
        .connect()
        .await
        .expect("connect to the gateway");
    tonic::client::Grpc::new(channel)
}

fn codec() -> ProstCodec<Echo, Echo> {
    ProstCodec::default()
}

fn msg(text: &str) -> Echo {
    Echo {
        text: text.into(),
        ..Default::default()
    }
}

async fn unary(
    c: &mut Client,
    path: &'static str,
    req: Request<Echo>,
) -> Result<Response<Echo>, Status> {
    c.ready()
        .await
        .map_err(|e| Status::unknown(e.to_string()))?;
    c.unary(req, thttp::uri::PathAndQuery::from_static(path), codec())
        .await
}

/// Waits until the route and the backend answer (clusters warm after routes).
async fn wait_ready(port: u16) {
    eventually("grpc unary through the gateway", PROPAGATION, || async {
        let mut c = client(port, HOST).await;
        unary(&mut c, "/test.Echo/Unary", Request::new(msg("ready")))
            .await
            .map(|_| ())
            .map_err(|s| format!("{s:?}"))
    })
    .await;
}

const GAPS: &[(&str, &str)] = &[];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_of_every_kind_pass_through() {
    let backend = grpc_backend().await;
    let mesh = mesh(backend).await;
    wait_ready(mesh.port).await;
    let mut c = client(mesh.port, HOST).await;
    let mut checks = Checks::with_gaps(GAPS);

    let r = unary(&mut c, "/test.Echo/Unary", Request::new(msg("hi")))
        .await
        .expect("unary");
    checks.eq("unary reply", r.get_ref().text.as_str(), "unary hi");
    checks.eq(
        "unary response metadata",
        r.metadata().get("x-backend").and_then(|v| v.to_str().ok()),
        Some("grpc"),
    );

    c.ready().await.expect("ready");
    let req = Request::new(Echo {
        text: "s".into(),
        count: 5,
        ..Default::default()
    });
    let mut s = c
        .server_streaming(
            req,
            thttp::uri::PathAndQuery::from_static("/test.Echo/ServerStream"),
            codec(),
        )
        .await
        .expect("server streaming")
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.message().await.expect("stream item") {
        got.push(m.text);
    }
    checks.eq(
        "server streaming replies",
        got,
        (0..5).map(|i| format!("s {i}")).collect::<Vec<_>>(),
    );

    c.ready().await.expect("ready");
    let items = futures::stream::iter((0..4).map(|i| msg(&format!("c{i}"))));
    let r = c
        .client_streaming(
            Request::new(items),
            thttp::uri::PathAndQuery::from_static("/test.Echo/ClientStream"),
            codec(),
        )
        .await
        .expect("client streaming");
    checks.eq(
        "client streaming reply",
        (r.get_ref().text.as_str(), r.get_ref().count),
        ("c0,c1,c2,c3", 4),
    );

    // Bidi, one message at a time: each reply comes back before the next request is sent.
    c.ready().await.expect("ready");
    let (tx, rx) = tokio::sync::mpsc::channel::<Echo>(1);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    tx.send(msg("b0")).await.expect("send");
    let mut inbound = c
        .streaming(
            Request::new(outbound),
            thttp::uri::PathAndQuery::from_static("/test.Echo/Bidi"),
            codec(),
        )
        .await
        .expect("bidi")
        .into_inner();
    let mut got = Vec::new();
    for i in 1..=3 {
        let m = tokio::time::timeout(Duration::from_secs(5), inbound.message())
            .await
            .expect("bidi reply in time")
            .expect("bidi item");
        got.push(m.map(|m| m.text).unwrap_or_default());
        if i < 3 {
            tx.send(msg(&format!("b{i}"))).await.expect("send");
        }
    }
    drop(tx);
    let end = tokio::time::timeout(Duration::from_secs(5), inbound.message())
        .await
        .expect("bidi end in time");
    checks.eq(
        "bidi replies",
        got,
        vec!["bidi b0".to_string(), "bidi b1".into(), "bidi b2".into()],
    );
    checks.ok("bidi ends cleanly", matches!(end, Ok(None)), &end);
    checks.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_errors_keep_their_status_message_and_trailers() {
    let backend = grpc_backend().await;
    let mesh = mesh(backend).await;
    wait_ready(mesh.port).await;
    let mut c = client(mesh.port, HOST).await;
    let mut checks = Checks::with_gaps(GAPS);
    let req = Request::new(Echo {
        text: "x".into(),
        fail: Code::NotFound as i32,
        ..Default::default()
    });
    let e = unary(&mut c, "/test.Echo/Unary", req)
        .await
        .expect_err("backend error");
    checks.eq("unary error code", e.code(), Code::NotFound);
    checks.eq("unary error message", e.message(), "backend says no: x ✓");
    checks.eq(
        "unary error trailer",
        e.metadata()
            .get("x-backend-trailer")
            .and_then(|v| v.to_str().ok()),
        Some("t1"),
    );
    // An error after some replies: the status arrives in trailers after the data.
    c.ready().await.expect("ready");
    let req = Request::new(Echo {
        text: "y".into(),
        count: 2,
        fail: Code::ResourceExhausted as i32,
        ..Default::default()
    });
    let mut s = c
        .server_streaming(
            req,
            thttp::uri::PathAndQuery::from_static("/test.Echo/ServerStream"),
            codec(),
        )
        .await
        .expect("server streaming")
        .into_inner();
    let mut got = Vec::new();
    let status = loop {
        match s.message().await {
            Ok(Some(m)) => got.push(m.text),
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };
    checks.eq(
        "replies before the error",
        got,
        vec!["y 0".to_string(), "y 1".into()],
    );
    checks.eq(
        "trailer status",
        status.as_ref().map(|s| s.code()),
        Some(Code::ResourceExhausted),
    );
    checks.eq(
        "trailer message",
        status.as_ref().map(|s| s.message().to_string()),
        Some("backend says no: y ✓".into()),
    );
    checks.eq(
        "trailer metadata",
        status.as_ref().and_then(|s| {
            s.metadata()
                .get("x-backend-trailer")?
                .to_str()
                .ok()
                .map(str::to_string)
        }),
        Some("t1".into()),
    );
    checks.finish();
}

/// A unary call on `path` to a backend that takes 2 s; with `grpc-timeout` 10S, which the
/// route caps at 300 ms (tonic enforces the header itself, so the gateway must be first).
async fn slow_call(c: &mut Client, path: &'static str, timeout: bool) -> Status {
    let mut req = Request::new(Echo {
        text: "slow".into(),
        delay_ms: 2000,
        ..Default::default()
    });
    if timeout {
        req.metadata_mut()
            .insert("grpc-timeout", "10S".parse().expect("ascii"));
    }
    let started = std::time::Instant::now();
    let r = unary(c, path, req).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "{path}: took {took:?}: {r:?}"
    );
    r.expect_err("timed out")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_and_gateway_errors_are_grpc_statuses() {
    let backend = grpc_backend().await;
    let mesh = mesh(backend).await;
    wait_ready(mesh.port).await;
    let mut c = client(mesh.port, HOST).await;
    let mut checks = Checks::with_gaps(GAPS);
    let mut status = |what: &str, s: &Status, code: Code, message: &str| {
        checks.eq(format!("{what}: code"), s.code(), code);
        checks.eq(format!("{what}: message"), s.message(), message);
    };
    let s = slow_call(&mut c, "/deadline.Echo/Unary", true).await;
    status(
        "grpc_timeout_header_max",
        &s,
        Code::DeadlineExceeded,
        "downstream duration timeout",
    );
    let s = slow_call(&mut c, "/legacy.Echo/Unary", true).await;
    status(
        "max_grpc_timeout",
        &s,
        Code::Unavailable,
        "upstream request timeout",
    );
    let s = slow_call(&mut c, "/short.Echo/Unary", false).await;
    status(
        "route timeout",
        &s,
        Code::Unavailable,
        "upstream request timeout",
    );
    let s = unary(&mut c, "/empty.Echo/Unary", Request::new(msg("e")))
        .await
        .expect_err("no endpoints");
    status(
        "no healthy upstream",
        &s,
        Code::Unavailable,
        "no healthy upstream",
    );
    let mut other = client(mesh.port, "nowhere.example").await;
    let s = unary(&mut other, "/test.Echo/Unary", Request::new(msg("n")))
        .await
        .expect_err("no route");
    status("no route", &s, Code::Unimplemented, "");
    // The backend still answers fast calls after all that.
    let r = unary(&mut c, "/test.Echo/Unary", Request::new(msg("ok"))).await;
    checks.eq(
        "afterwards",
        r.map(|r| r.into_inner().text).ok(),
        Some("unary ok".into()),
    );
    checks.finish();
}

/// The gateway's own replies to gRPC requests are trailers-only: HTTP 200, `content-type:
/// application/grpc`, `grpc-status` in the headers, no body. Read with a raw h2 client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_replies_are_trailers_only() {
    let backend = grpc_backend().await;
    let mesh = mesh(backend).await;
    wait_ready(mesh.port).await;
    let mut checks = Checks::with_gaps(GAPS);
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    let (mut h2, conn) = h2::client::handshake(sock).await.expect("h2 handshake");
    tokio::spawn(conn);
    let slow = {
        use prost::Message;
        let m = Echo {
            delay_ms: 2000,
            ..Default::default()
        }
        .encode_to_vec();
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(m.len() as u32).to_be_bytes());
        frame.extend_from_slice(&m);
        bytes::Bytes::from(frame)
    };
    for (what, host, path, grpc_status) in [
        ("no route", "nowhere.example", "/test.Echo/Unary", "12"),
        ("no healthy upstream", HOST, "/empty.Echo/Unary", "14"),
        ("route timeout", HOST, "/short.Echo/Unary", "14"),
    ] {
        let req = http::Request::post(format!("http://{host}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (resp, mut send) = h2.send_request(req, false).expect("send");
        // The gateway answers from the headers alone and may reset the stream (RFC 9113
        // 8.1) before this thread gets to send the body: the body is then refused locally.
        let _ = send.send_data(slow.clone(), true);
        let resp = resp.await.expect("response");
        let h = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        checks.eq(format!("{what}: http status"), resp.status().as_u16(), 200);
        checks.eq(
            format!("{what}: content-type"),
            h("content-type"),
            Some("application/grpc".into()),
        );
        checks.eq(
            format!("{what}: grpc-status"),
            h("grpc-status"),
            Some(grpc_status.into()),
        );
        checks.eq(
            format!("{what}: end of stream on headers"),
            resp.body().is_end_stream(),
            true,
        );
    }
    checks.finish();
}

/// `envoy.filters.http.grpc_stats` on two listeners: one counting every method (with the
/// message counts), one with an allowlist (other methods counted without their names).
fn grpc_stats_hcm(port: u16, routes: &str, config: serde_json::Value) -> Listener {
    let mut h = hcm(port);
    let cfg = envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::FilterConfig {
        emit_filter_state: config["emit_filter_state"].as_bool().unwrap_or(false),
        per_method_stat_specifier: if config["all"].as_bool() == Some(true) {
            Some(PerMethodStatSpecifier::StatsForAllMethods(
                envoy_types::pb::google::protobuf::BoolValue { value: true },
            ))
        } else {
            Some(PerMethodStatSpecifier::IndividualMethodStatsAllowlist(
                envoy_types::pb::envoy::config::core::v3::GrpcMethodList {
                    services: vec![
                        envoy_types::pb::envoy::config::core::v3::grpc_method_list::Service {
                            name: "test.Echo".into(),
                            method_names: vec!["Unary".into()],
                        },
                    ],
                },
            ))
        },
        ..Default::default()
    };
    h.http_filters.insert(
        0,
        envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter {
            name: "envoy.filters.http.grpc_stats".into(),
            config_type: Some(
                envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter::ConfigType::TypedConfig(any(cfg)),
            ),
            ..Default::default()
        },
    );
    h.route_specifier = Some(
        envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::RouteSpecifier::Rds(
            envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::Rds {
                config_source: Some(ads_source()),
                route_config_name: routes.into(),
            },
        ),
    );
    listener_with(port, h)
}

use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::filter_config::PerMethodStatSpecifier;

/// The `cluster.*.grpc.*` counters of `/stats` (text), as name -> value.
async fn grpc_counters(mesh: &Mesh) -> std::collections::BTreeMap<String, u64> {
    let r = mesh
        .gw
        .admin_get("/stats?filter=%5Ecluster%5C..*%5C.grpc%5C.")
        .await;
    let mut out = std::collections::BTreeMap::new();
    for l in r.body.lines() {
        if let Some((k, v)) = l.split_once(": ") {
            if let Ok(v) = v.trim().parse::<u64>() {
                *out.entry(k.to_string()).or_default() += v;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_stats_count_calls_statuses_and_messages() {
    let backend = grpc_backend().await;
    let second = free_port();
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![
            grpc_stats_hcm(
                port,
                "grpc-routes",
                serde_json::json!({"all": true, "emit_filter_state": true}),
            ),
            grpc_stats_hcm(second, "allowlist-routes", serde_json::json!({})),
        ],
        // The allowlist listener's calls go to a cluster of their own: Envoy keeps an
        // allowlisted method's counters apart from the same method's dynamically named ones
        // and `/stats` then shows only one of the two same-named lines.
        routes: vec![
            route_config(
                "allowlist-routes",
                vec![vhost(
                    "grpc",
                    &[HOST],
                    vec![
                        route_to(prefix("/other.Echo/"), "listed", |ra| {
                            ra.prefix_rewrite = "/test.Echo/".into()
                        }),
                        route_to(prefix("/"), "listed", |_| {}),
                    ],
                )],
            ),
            route_config(
                "grpc-routes",
                vec![vhost(
                    "grpc",
                    &[HOST],
                    vec![
                        route_to(prefix("/empty.Echo/"), "empty", |ra| {
                            ra.prefix_rewrite = "/test.Echo/".into()
                        }),
                        route_to(prefix("/other.Echo/"), "grpc", |ra| {
                            ra.prefix_rewrite = "/test.Echo/".into()
                        }),
                        route_to(prefix("/"), "grpc", |ra| ra.timeout = Some(pb_duration(0))),
                    ],
                )],
            ),
        ],
        clusters: vec![
            h2_cluster("grpc"),
            h2_cluster("empty"),
            h2_cluster("listed"),
        ],
        endpoints: vec![
            cla("grpc", &[backend]),
            cla("empty", &[]),
            cla("listed", &[backend]),
        ],
        ..Default::default()
    })
    .await;
    wait_ready(mesh.port).await;
    wait_ready(second).await;
    let before = grpc_counters(&mesh).await;

    let mut c = client(mesh.port, HOST).await;
    for _ in 0..2 {
        unary(&mut c, "/test.Echo/Unary", Request::new(msg("ok")))
            .await
            .expect("unary");
    }
    let failed = unary(
        &mut c,
        "/test.Echo/Unary",
        Request::new(Echo {
            fail: 5,
            ..msg("x")
        }),
    )
    .await
    .expect_err("the backend fails it");
    assert_eq!(failed.code(), Code::NotFound);
    c.ready().await.expect("ready");
    let mut s = c
        .server_streaming(
            Request::new(Echo {
                count: 3,
                ..msg("s")
            }),
            thttp::uri::PathAndQuery::from_static("/test.Echo/ServerStream"),
            codec(),
        )
        .await
        .expect("server streaming")
        .into_inner();
    while s.message().await.expect("stream item").is_some() {}
    let unavailable = unary(&mut c, "/empty.Echo/Unary", Request::new(msg("x")))
        .await
        .expect_err("no endpoints");
    assert_eq!(unavailable.code(), Code::Unavailable);

    // The allowlist listener: test.Echo/Unary by name, anything else without.
    let mut c2 = client(second, HOST).await;
    unary(&mut c2, "/test.Echo/Unary", Request::new(msg("ok")))
        .await
        .expect("unary");
    unary(&mut c2, "/other.Echo/Unary", Request::new(msg("ok")))
        .await
        .expect("unary");

    let expected: &[(&str, u64)] = &[
        ("cluster.grpc.grpc.test.Echo.Unary.0", 2),
        ("cluster.grpc.grpc.test.Echo.Unary.5", 1),
        ("cluster.grpc.grpc.test.Echo.Unary.success", 2),
        ("cluster.grpc.grpc.test.Echo.Unary.failure", 1),
        ("cluster.grpc.grpc.test.Echo.Unary.total", 3),
        ("cluster.grpc.grpc.test.Echo.Unary.request_message_count", 3),
        (
            "cluster.grpc.grpc.test.Echo.Unary.response_message_count",
            2,
        ),
        ("cluster.grpc.grpc.test.Echo.ServerStream.0", 1),
        ("cluster.grpc.grpc.test.Echo.ServerStream.success", 1),
        ("cluster.grpc.grpc.test.Echo.ServerStream.total", 1),
        (
            "cluster.grpc.grpc.test.Echo.ServerStream.request_message_count",
            1,
        ),
        (
            "cluster.grpc.grpc.test.Echo.ServerStream.response_message_count",
            3,
        ),
        ("cluster.empty.grpc.empty.Echo.Unary.14", 1),
        ("cluster.empty.grpc.empty.Echo.Unary.failure", 1),
        ("cluster.empty.grpc.empty.Echo.Unary.total", 1),
        ("cluster.listed.grpc.test.Echo.Unary.0", 1),
        ("cluster.listed.grpc.test.Echo.Unary.total", 1),
        ("cluster.listed.grpc.0", 1),
        ("cluster.listed.grpc.success", 1),
        ("cluster.listed.grpc.total", 1),
        ("cluster.listed.grpc.request_message_count", 1),
        ("cluster.listed.grpc.response_message_count", 1),
    ];
    let after = eventually("gRPC counters", PROPAGATION, || async {
        let now = grpc_counters(&mesh).await;
        let delta =
            |k: &str| now.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
        if expected.iter().all(|(k, v)| delta(k) == *v) {
            Ok(now)
        } else {
            Err(format!("{now:#?}"))
        }
    })
    .await;
    eprintln!("observed: {after:#?}");
    let prom = mesh.gw.admin_get("/stats/prometheus").await;
    let grpc_lines: Vec<&str> = prom.body.lines().filter(|l| l.contains("grpc")).collect();
    eprintln!("observed prometheus: {grpc_lines:#?}");
    // Envoy's tag extraction takes one dot-separated token each for the service and the
    // method (`test`, `Echo`); the rest of the name stays in the metric's.
    let samples = prom_samples(&prom.body, "envoy_cluster_grpc_Unary_success");
    assert!(
        samples.iter().any(|(labels, v)| {
            labels.get("envoy_cluster_name").map(String::as_str) == Some("grpc")
                && labels.get("envoy_grpc_bridge_service").map(String::as_str) == Some("test")
                && labels.get("envoy_grpc_bridge_method").map(String::as_str) == Some("Echo")
                && *v >= 2.0
        }),
        "{grpc_lines:#?}"
    );
    let unnamed = prom_samples(&prom.body, "envoy_cluster_grpc_0");
    assert!(
        unnamed.iter().any(|(labels, v)| {
            labels.get("envoy_cluster_name").map(String::as_str) == Some("listed")
                && labels.len() == 1
                && *v == 1.0
        }),
        "{grpc_lines:#?}"
    );
}
