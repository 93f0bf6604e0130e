//! The connection manager's tracing as Envoy 1.40 does it: Envoy's sampling decision packed
//! into `x-request-id`, B3 (Zipkin) and W3C (OpenTelemetry) context propagated to the backend
//! (continued when the client sent one, started otherwise), and the gateway's span exported
//! to a collector: Zipkin JSON v2 over HTTP, OTLP over gRPC. Every case runs against Envoy
//! too (PORTICO_GATEWAY_BIN) and asserts the same fields for both.
//!
//! Both gateways batch spans; the bootstrap's static runtime layer sets Envoy's
//! `tracing.*.min_flush_spans` to 1 so each span is sent when it ends.

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use envoy_types::pb::envoy::config::core::v3::{grpc_service, GrpcService, TrafficDirection};
use envoy_types::pb::envoy::config::trace::v3::{
    tracing::http::ConfigType, tracing::Http as TracingHttp, zipkin_config, OpenTelemetryConfig,
    ZipkinConfig,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::Tracing;
use envoy_types::pb::envoy::r#type::tracing::v3::{custom_tag, CustomTag};
use envoy_types::pb::envoy::r#type::v3::Percent;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use portico::telemetry::trace::otlp;
use serde_json::Value;
use tonic::codegen::{http as thttp, BoxFuture};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

const HOST: &str = "trace.example.com";

// ---------------------------------------------------------------------------
// The backend: answers with every request header it received, one per line.
// ---------------------------------------------------------------------------

async fn header_backend() -> SocketAddr {
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
                let svc = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let mut body = String::new();
                        for (k, v) in req.headers() {
                            body.push_str(&format!("{}: {}\n", k, v.to_str().unwrap_or("?")));
                        }
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(body))))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    addr
}

/// The headers the backend saw, from its answer.
fn seen(r: &Resp) -> HashMap<String, String> {
    assert_eq!(r.status, 200, "{r:?}");
    r.body
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

// ---------------------------------------------------------------------------
// The collectors.
// ---------------------------------------------------------------------------

/// One POST to the Zipkin collector: (path, host, content-type, spans).
type Post = (String, String, String, Vec<Value>);

/// What a Zipkin collector received.
#[derive(Clone, Default)]
struct Zipkin(Arc<Mutex<Vec<Post>>>);

impl Zipkin {
    async fn start() -> (Zipkin, SocketAddr) {
        let z = Zipkin::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let store = z.clone();
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let store = store.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let store = store.clone();
                            async move {
                                let h = |n: &str| {
                                    req.headers()
                                        .get(n)
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or("")
                                        .to_string()
                                };
                                let (path, host, ct) =
                                    (req.uri().path().to_string(), h("host"), h("content-type"));
                                let body = req.into_body().collect().await.map(|c| c.to_bytes());
                                let spans: Vec<Value> = match body {
                                    Ok(b) if ct == "application/x-protobuf" => proto_spans(&b),
                                    Ok(b) => serde_json::from_slice(&b).unwrap_or_default(),
                                    Err(_) => Vec::new(),
                                };
                                store.0.lock().unwrap().push((path, host, ct, spans));
                                Ok::<_, Infallible>(
                                    hyper::Response::builder()
                                        .status(202)
                                        .body(Full::new(Bytes::new()))
                                        .unwrap(),
                                )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        (z, addr)
    }

    fn spans(&self) -> Vec<Value> {
        let got = self.0.lock().unwrap();
        // The setup's readiness probe is traced too; the cases leave it out.
        got.iter()
            .flat_map(|(_, _, _, s)| s.clone())
            .filter(|s| {
                !s["tags"]["http.url"]
                    .as_str()
                    .unwrap_or("")
                    .ends_with("/ready-check")
            })
            .collect()
    }

    /// Waits for the span of trace `trace_id`.
    async fn span(&self, trace_id: &str) -> Value {
        let id = trace_id.to_string();
        eventually(
            &format!("a span of trace {trace_id} at the Zipkin collector"),
            Duration::from_secs(12),
            || {
                let s = self.spans();
                let id = id.clone();
                async move {
                    s.into_iter()
                        .find(|s| s["traceId"] == id.as_str())
                        .ok_or_else(|| "not yet".to_string())
                }
            },
        )
        .await
    }
}

/// `zipkin.proto3` spans in the JSON shape the cases read.
fn proto_spans(body: &[u8]) -> Vec<Value> {
    use prost::Message;
    let Ok(list) = otlp::zipkin::ListOfSpans::decode(body) else {
        return Vec::new();
    };
    list.spans
        .iter()
        .map(|s| {
            let mut v = serde_json::json!({
                "traceId": hex(&s.trace_id),
                "id": hex(&s.id),
                "kind": match s.kind { 1 => "CLIENT", 2 => "SERVER", _ => "?" },
                "name": s.name,
                "timestamp": s.timestamp,
                "duration": s.duration,
                "localEndpoint": {
                    "serviceName": s.local_endpoint.as_ref().map(|e| e.service_name.clone()),
                },
                "tags": s.tags,
                "annotations": s.annotations.iter()
                    .map(|a| serde_json::json!({"value": a.value, "timestamp": a.timestamp}))
                    .collect::<Vec<_>>(),
            });
            if !s.parent_id.is_empty() {
                v["parentId"] = Value::String(hex(&s.parent_id));
            }
            if s.shared {
                v["shared"] = Value::Bool(true);
            }
            v
        })
        .collect()
}

/// What an OpenTelemetry collector received.
#[derive(Clone, Default)]
struct Otel(Arc<Mutex<Vec<(String, otlp::ExportTraceServiceRequest)>>>);

struct Export(Otel, String);
impl tonic::server::UnaryService<otlp::ExportTraceServiceRequest> for Export {
    type Response = otlp::ExportTraceServiceResponse;
    type Future = BoxFuture<Response<otlp::ExportTraceServiceResponse>, Status>;
    fn call(&mut self, req: Request<otlp::ExportTraceServiceRequest>) -> Self::Future {
        self.0
             .0
            .lock()
            .unwrap()
            .push((self.1.clone(), req.into_inner()));
        Box::pin(async { Ok(Response::new(otlp::ExportTraceServiceResponse {})) })
    }
}

impl Otel {
    async fn start() -> (Otel, SocketAddr) {
        let o = Otel::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let store = o.clone();
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let store = store.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: thttp::Request<hyper::body::Incoming>| {
                            let store = store.clone();
                            async move {
                                let path = req.uri().path().to_string();
                                let authority = req
                                    .uri()
                                    .authority()
                                    .map(|a| a.to_string())
                                    .unwrap_or_default();
                                let mut g = tonic::server::Grpc::new(ProstCodec::<
                                    otlp::ExportTraceServiceResponse,
                                    otlp::ExportTraceServiceRequest,
                                >::default(
                                ));
                                Ok::<_, Infallible>(if path == otlp::EXPORT_PATH {
                                    g.unary(Export(store, authority), req).await
                                } else {
                                    Status::unimplemented("no such method").into_http()
                                })
                            }
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
                });
            }
        });
        (o, addr)
    }

    fn spans(&self) -> Vec<(String, otlp::Resource, otlp::Span)> {
        let got = self.0.lock().unwrap();
        let mut out = Vec::new();
        for (authority, req) in got.iter() {
            for rs in &req.resource_spans {
                for ss in &rs.scope_spans {
                    for s in &ss.spans {
                        if attr(s, "http.url").is_some_and(|u| u.ends_with("/ready-check")) {
                            continue;
                        }
                        out.push((
                            authority.clone(),
                            rs.resource.clone().unwrap_or_default(),
                            s.clone(),
                        ));
                    }
                }
            }
        }
        out
    }

    async fn span(&self, trace_id: &str) -> (String, otlp::Resource, otlp::Span) {
        let id = trace_id.to_string();
        eventually(
            &format!("a span of trace {trace_id} at the OpenTelemetry collector"),
            Duration::from_secs(12),
            || {
                let s = self.spans();
                let id = id.clone();
                async move {
                    s.into_iter()
                        .find(|(_, _, s)| hex(&s.trace_id) == id)
                        .ok_or_else(|| "not yet".to_string())
                }
            },
        )
        .await
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn attr<'a>(s: &'a otlp::Span, key: &str) -> Option<&'a str> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.as_str())
}

// ---------------------------------------------------------------------------
// Configuration.
// ---------------------------------------------------------------------------

fn zipkin_provider(trace_id_128bit: bool) -> TracingHttp {
    zipkin_provider_version(
        trace_id_128bit,
        zipkin_config::CollectorEndpointVersion::HttpJson,
    )
}

fn zipkin_provider_version(
    trace_id_128bit: bool,
    version: zipkin_config::CollectorEndpointVersion,
) -> TracingHttp {
    TracingHttp {
        name: "envoy.tracers.zipkin".into(),
        config_type: Some(ConfigType::TypedConfig(any(ZipkinConfig {
            collector_cluster: "zipkin".into(),
            collector_endpoint: "/api/v2/spans".into(),
            collector_endpoint_version: version as i32,
            collector_hostname: "zipkin-collector".into(),
            trace_id_128bit,
            ..Default::default()
        }))),
    }
}

fn otel_provider() -> TracingHttp {
    TracingHttp {
        name: "envoy.tracers.opentelemetry".into(),
        config_type: Some(ConfigType::TypedConfig(any(OpenTelemetryConfig {
            grpc_service: Some(GrpcService {
                target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                    grpc_service::EnvoyGrpc {
                        cluster_name: "otel".into(),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            }),
            service_name: "gateway-svc".into(),
            ..Default::default()
        }))),
    }
}

fn tracing(provider: TracingHttp, random_sampling: Option<f64>) -> Tracing {
    Tracing {
        provider: Some(provider),
        random_sampling: random_sampling.map(|value| Percent { value }),
        custom_tags: vec![
            CustomTag {
                tag: "lit".into(),
                r#type: Some(custom_tag::Type::Literal(custom_tag::Literal {
                    value: "v1".into(),
                })),
            },
            CustomTag {
                tag: "hdr".into(),
                r#type: Some(custom_tag::Type::RequestHeader(custom_tag::Header {
                    name: "x-tag".into(),
                    default_value: "none".into(),
                })),
            },
        ],
        ..Default::default()
    }
}

const RUNTIME: &str = r#"layered_runtime:
  layers:
  - name: static
    static_layer:
      tracing.zipkin.min_flush_spans: 1
      tracing.opentelemetry.min_flush_spans: 1
"#;

/// A route whose decorator names its spans.
fn decorated(
    mut r: envoy_types::pb::envoy::config::route::v3::Route,
) -> envoy_types::pb::envoy::config::route::v3::Route {
    r.decorator = Some(envoy_types::pb::envoy::config::route::v3::Decorator {
        operation: "checkout-op".into(),
        propagate: None,
    });
    r
}

struct Setup {
    _ads: AdsServer,
    gw: Gateway,
    port: u16,
    client: HttpClient,
}

impl Setup {
    /// A gateway whose listener traces with `t`; `web` is the backend, `zipkin` and `otel`
    /// the collectors' clusters.
    async fn start(
        t: Tracing,
        backend: SocketAddr,
        zipkin: SocketAddr,
        otel: SocketAddr,
        egress: bool,
    ) -> Setup {
        Setup::start_with(t, backend, zipkin, otel, egress, "").await
    }

    /// As `start`, with `extra` appended to the bootstrap.
    async fn start_with(
        t: Tracing,
        backend: SocketAddr,
        zipkin: SocketAddr,
        otel: SocketAddr,
        egress: bool,
        extra: &str,
    ) -> Setup {
        let port = free_port();
        let mut h = hcm(port);
        h.tracing = Some(t);
        let mut listener = listener_with(port, h);
        if egress {
            listener.traffic_direction = TrafficDirection::Outbound as i32;
        }
        let snapshot = Snapshot {
            listeners: vec![listener],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "trace",
                    &[HOST],
                    vec![
                        decorated(rt(prefix("/decorated"), to_cluster("web"))),
                        rt(prefix("/dead"), to_cluster("dead")),
                        rt(prefix("/"), to_cluster("web")),
                    ],
                )],
            )],
            clusters: vec![
                eds_cluster("web"),
                eds_cluster("dead"),
                eds_cluster("zipkin"),
                h2_cluster("otel"),
            ],
            endpoints: vec![
                cla("web", &[backend]),
                // Nothing listens there: connections are refused.
                cla(
                    "dead",
                    &[format!("127.0.0.1:{}", free_port()).parse().unwrap()],
                ),
                cla("zipkin", &[zipkin]),
                cla("otel", &[otel]),
            ],
            ..Default::default()
        };
        let ads = AdsServer::start_any("1", &snapshot).await;
        let ads_port = ads.port;
        let gw = Gateway::start_bootstrap(|admin| {
            format!("{}{RUNTIME}{extra}", bootstrap_yaml(admin, ads_port))
        })
        .await;
        let s = Setup {
            _ads: ads,
            gw,
            port,
            client: HttpClient::new(),
        };
        eventually("the route serves", Duration::from_secs(10), || async {
            let st = s.get("/ready-check", &[]).await.status;
            if st == 200 {
                Ok(())
            } else {
                Err(format!("status {st}"))
            }
        })
        .await;
        s
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Resp {
        self.client
            .get(
                &format!("http://127.0.0.1:{}{path}", self.port),
                Some(HOST),
                headers,
            )
            .await
    }
}

struct Collectors {
    backend: SocketAddr,
    zipkin: Zipkin,
    zipkin_addr: SocketAddr,
    otel: Otel,
    otel_addr: SocketAddr,
}

async fn collectors() -> Collectors {
    let backend = header_backend().await;
    let (zipkin, zipkin_addr) = Zipkin::start().await;
    let (otel, otel_addr) = Otel::start().await;
    Collectors {
        backend,
        zipkin,
        zipkin_addr,
        otel,
        otel_addr,
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// The uuid request-id extension's trace byte.
fn trace_byte(rid: &str) -> char {
    rid.chars().nth(14).expect("a uuid")
}

// ---------------------------------------------------------------------------
// Zipkin.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn zipkin_starts_a_trace_and_reports_the_span() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(false), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    let before = now_us();
    let r = s
        .get(
            "/shop/cart?item=1",
            &[("user-agent", "trace-test"), ("x-tag", "tagged")],
        )
        .await;
    let h = seen(&r);
    // 100% random sampling: Envoy marks the request id as sampled ('9') and starts a 64-bit
    // trace whose root span id is the trace id.
    let rid = &h["x-request-id"];
    assert_eq!(trace_byte(rid), '9', "{h:?}");
    let trace = &h["x-b3-traceid"];
    assert!(is_hex(trace, 16), "{h:?}");
    assert_eq!(&h["x-b3-spanid"], trace);
    assert_eq!(h["x-b3-sampled"], "1");
    assert!(!h.contains_key("x-b3-parentspanid"), "{h:?}");

    let span = c.zipkin.span(trace).await;
    let after = now_us();
    let posts = c.zipkin.0.lock().unwrap().clone();
    let (path, host, ct, _) = &posts[0];
    assert_eq!(path, "/api/v2/spans");
    assert_eq!(host, "zipkin-collector");
    assert_eq!(ct, "application/json");

    assert_eq!(span["id"], trace.as_str());
    assert!(span.get("parentId").is_none(), "{span}");
    assert_eq!(span["kind"], "SERVER");
    assert_eq!(span["shared"], true);
    assert_eq!(span["name"], HOST);
    assert_eq!(span["localEndpoint"]["serviceName"], NODE_CLUSTER);
    let ts = span["timestamp"].as_u64().expect("timestamp");
    let dur = span["duration"].as_u64().expect("duration");
    assert!(ts >= before && ts + dur <= after, "{span}");
    assert_eq!(span["annotations"][0]["value"], "ss");
    // The end, by the wall clock (the duration is measured on the monotonic one).
    let ss = span["annotations"][0]["timestamp"].as_u64().expect("ss");
    assert!(ss >= ts && ss <= after, "{span}");
    let tags = &span["tags"];
    let expect = [
        ("http.method", "GET"),
        (
            "http.url",
            &format!("http://{HOST}/shop/cart?item=1") as &str,
        ),
        ("http.status_code", "200"),
        ("http.protocol", "HTTP/1.1"),
        ("upstream_cluster", "web"),
        ("upstream_cluster.name", "web"),
        ("node_id", NODE_ID),
        ("guid:x-request-id", rid),
        ("user_agent", "trace-test"),
        ("downstream_cluster", "-"),
        ("peer.address", "127.0.0.1"),
        ("request_size", "0"),
        ("response_size", &r.body.len().to_string()),
        ("response_flags", "-"),
        ("component", "proxy"),
        ("lit", "v1"),
        ("hdr", "tagged"),
    ];
    for (k, v) in expect {
        assert_eq!(tags[k], v, "tag {k} in {span}");
    }
    assert!(tags.get("error").is_none(), "{span}");
    // Zipkin leaves out empty tags: the node has no zone.
    assert!(tags.get("zone").is_none(), "{span}");

    // Envoy's tracer counters.
    let url = s.gw.admin_url("/stats");
    eventually("tracing.zipkin counters", Duration::from_secs(5), || {
        let url = url.clone();
        async move {
            let body = get(&url, None, &[]).await.body;
            let stat = |name: &str| {
                body.lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            if stat("tracing.zipkin.spans_sent") >= 2 && stat("tracing.zipkin.reports_sent") >= 2 {
                Ok(())
            } else {
                Err(body
                    .lines()
                    .filter(|l| l.starts_with("tracing."))
                    .collect::<Vec<_>>()
                    .join("; "))
            }
        }
    })
    .await;
}

#[tokio::test]
async fn zipkin_http_proto_collector() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(
            zipkin_provider_version(true, zipkin_config::CollectorEndpointVersion::HttpProto),
            None,
        ),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    let h = seen(
        &s.get(
            "/p",
            &[
                ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
                ("x-b3-spanid", "a2fb4a1d1a96d312"),
                ("x-b3-parentspanid", "0020000000000001"),
            ],
        )
        .await,
    );
    assert_eq!(h["x-b3-sampled"], "1");
    let span = c.zipkin.span("463ac35c9f6413ad48485a3953bb6124").await;
    let posts = c.zipkin.0.lock().unwrap().clone();
    assert!(posts
        .iter()
        .all(|(_, _, ct, _)| ct == "application/x-protobuf"));
    // Envoy writes the trace id big-endian but span ids in its host's (little-endian) byte
    // order.
    assert_eq!(span["id"], "12d3961a1d4afba2");
    assert_eq!(span["parentId"], "0100000000002000");
    assert_eq!(span["kind"], "SERVER");
    assert_eq!(span["shared"], true);
    assert_eq!(span["name"], HOST);
    assert_eq!(span["localEndpoint"]["serviceName"], NODE_CLUSTER);
    assert_eq!(span["annotations"][0]["value"], "ss");
    assert_eq!(span["tags"]["http.method"], "GET");
    assert_eq!(span["tags"]["node_id"], NODE_ID);
    assert!(span["tags"].get("zone").is_none(), "{span}");
}

#[tokio::test]
async fn zipkin_marks_failed_requests_as_errors() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(false), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    let trace = "00000000000000cc";
    let r = s
        .get(
            "/dead/x",
            &[("x-b3-traceid", trace), ("x-b3-spanid", "00000000000000dd")],
        )
        .await;
    assert_eq!(r.status, 503, "{r:?}");
    let span = c.zipkin.span(trace).await;
    let tags = &span["tags"];
    assert_eq!(tags["http.status_code"], "503", "{span}");
    assert_eq!(tags["error"], "true", "{span}");
    assert_eq!(tags["response_flags"], "UF", "{span}");
    assert_eq!(tags["upstream_cluster"], "dead", "{span}");
    assert_eq!(tags["response_size"], r.body.len().to_string(), "{span}");
}

#[tokio::test]
async fn route_decorators_name_spans() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(false), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    // Ingress: the route's operation names the span and returns on the response.
    let r = s.get("/decorated/1", &[]).await;
    assert_eq!(r.header("x-envoy-decorator-operation"), Some("checkout-op"));
    let h = seen(&r);
    assert!(!h.contains_key("x-envoy-decorator-operation"), "{h:?}");
    let span = c.zipkin.span(&h["x-b3-traceid"]).await;
    assert_eq!(span["name"], "checkout-op");
    // A caller's operation (from a trusted hop) overrides it and is not passed on.
    let r = s
        .get(
            "/decorated/2",
            &[("x-envoy-decorator-operation", "client-op")],
        )
        .await;
    assert_eq!(r.header("x-envoy-decorator-operation"), None);
    let h = seen(&r);
    assert!(!h.contains_key("x-envoy-decorator-operation"), "{h:?}");
    let span = c.zipkin.span(&h["x-b3-traceid"]).await;
    assert_eq!(span["name"], "client-op");
}

#[tokio::test]
async fn zipkin_traces_local_replies() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(false), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    // No route for this host: the connection manager's 404, traced all the same.
    let trace = "00000000000000ee";
    let r = s
        .client
        .get(
            &format!("http://127.0.0.1:{}/x", s.port),
            Some("nowhere.example.com"),
            &[("x-b3-traceid", trace), ("x-b3-spanid", "00000000000000ef")],
        )
        .await;
    assert_eq!(r.status, 404, "{r:?}");
    let span = c.zipkin.span(trace).await;
    assert_eq!(span["name"], "nowhere.example.com");
    let tags = &span["tags"];
    assert_eq!(tags["http.status_code"], "404", "{span}");
    assert_eq!(tags["response_flags"], "NR", "{span}");
    assert_eq!(tags["http.url"], "http://nowhere.example.com/x", "{span}");
    assert!(tags.get("upstream_cluster").is_none(), "{span}");
    assert!(tags.get("error").is_none(), "{span}");
    let rid = tags["guid:x-request-id"].as_str().unwrap_or("");
    assert_eq!(rid.len(), 36, "{span}");
    assert_eq!(trace_byte(rid), '9', "{span}");
}

#[tokio::test]
async fn zipkin_continues_an_incoming_b3_trace() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(true), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    // B3 multi headers, 128-bit trace id: the ingress span shares the caller's span id
    // (shared_span_context defaults to true) and keeps its parent.
    let trace = "463ac35c9f6413ad48485a3953bb6124";
    let r = s
        .get(
            "/a",
            &[
                ("x-b3-traceid", trace),
                ("x-b3-spanid", "a2fb4a1d1a96d312"),
                ("x-b3-parentspanid", "0020000000000001"),
                ("x-b3-sampled", "1"),
            ],
        )
        .await;
    let h = seen(&r);
    assert_eq!(h["x-b3-traceid"], trace);
    assert_eq!(h["x-b3-spanid"], "a2fb4a1d1a96d312");
    assert_eq!(h["x-b3-parentspanid"], "0020000000000001");
    assert_eq!(h["x-b3-sampled"], "1");
    let span = c.zipkin.span(trace).await;
    assert_eq!(span["id"], "a2fb4a1d1a96d312");
    assert_eq!(span["parentId"], "0020000000000001");
    assert_eq!(span["kind"], "SERVER");

    // Short ids are read as numbers and written back as 16 hex digits.
    let r = s
        .get("/a", &[("x-b3-traceid", "abc"), ("x-b3-spanid", "def")])
        .await;
    let h = seen(&r);
    assert_eq!(h["x-b3-traceid"], "0000000000000abc");
    assert_eq!(h["x-b3-spanid"], "0000000000000def");

    // The single `b3` header: continued in the same format, no multi headers added.
    let b3 = "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90";
    let h = seen(&s.get("/a", &[("b3", b3)]).await);
    assert_eq!(h["b3"], b3);
    assert!(!h.contains_key("x-b3-traceid"), "{h:?}");
    let span = c.zipkin.span("80f198ee56343ba864fe8b2a57d3eff7").await;
    assert_eq!(span["id"], "e457b5a2e4d86bd1");
    assert_eq!(span["parentId"], "05e3ac9a4f6e3b90");

    // A malformed context: no span and no headers (Envoy's null span).
    let h = seen(
        &s.get("/a", &[("x-b3-traceid", "xyz"), ("x-b3-spanid", "1")])
            .await,
    );
    assert_eq!(h["x-b3-traceid"], "xyz");
    assert!(!h.contains_key("x-b3-sampled"), "{h:?}");
}

#[tokio::test]
async fn zipkin_respects_an_unsampled_caller() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(false), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    // `x-b3-sampled: 0` alone: a new trace, not sampled, not exported; the request id still
    // says sampled (the connection manager decided before the driver read the header).
    let h = seen(&s.get("/a", &[("x-b3-sampled", "0")]).await);
    let unsampled = h["x-b3-traceid"].clone();
    assert!(is_hex(&unsampled, 16), "{h:?}");
    assert_eq!(h["x-b3-spanid"], unsampled);
    assert_eq!(h["x-b3-sampled"], "0");
    assert_eq!(trace_byte(&h["x-request-id"]), '9');
    // `b3: 0` is answered in the single format.
    let h = seen(&s.get("/a", &[("b3", "0")]).await);
    let b3 = h["b3"].clone();
    let parts: Vec<&str> = b3.split('-').collect();
    assert_eq!(parts.len(), 3, "{b3}");
    assert!(
        is_hex(parts[0], 16) && parts[0] == parts[1] && parts[2] == "0",
        "{b3}"
    );
    // A sampled request after them is reported; the unsampled ones never are.
    let h = seen(&s.get("/a", &[]).await);
    c.zipkin.span(&h["x-b3-traceid"]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let traces: Vec<String> = c
        .zipkin
        .spans()
        .iter()
        .map(|s| s["traceId"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(!traces.contains(&unsampled), "{traces:?}");
    assert!(!traces.iter().any(|t| t == parts[0]), "{traces:?}");
    assert_eq!(traces.len(), 1, "{traces:?}");
}

#[tokio::test]
async fn zipkin_random_sampling_zero_sends_unsampled_headers() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(true), Some(0.0)),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    let h = seen(&s.get("/a", &[]).await);
    // Not sampled: the request id keeps its '4', the headers say 0, a 128-bit trace id whose
    // low half is the span id.
    assert_eq!(trace_byte(&h["x-request-id"]), '4', "{h:?}");
    let trace = h["x-b3-traceid"].clone();
    assert!(is_hex(&trace, 32), "{h:?}");
    assert_eq!(h["x-b3-spanid"], trace[16..]);
    assert_eq!(h["x-b3-sampled"], "0");
    // `x-envoy-force-trace` from an external client is stripped, so it changes nothing.
    let h = seen(&s.get("/a", &[("x-envoy-force-trace", "1")]).await);
    assert_eq!(h["x-b3-sampled"], "0");
    assert_eq!(trace_byte(&h["x-request-id"]), '4');
    // `x-client-trace-id` with client_sampling at its 100% default forces the trace ('b').
    let h = seen(&s.get("/a", &[("x-client-trace-id", "ct-1")]).await);
    assert_eq!(trace_byte(&h["x-request-id"]), 'b', "{h:?}");
    assert_eq!(h["x-b3-sampled"], "1");
    let span = c.zipkin.span(&h["x-b3-traceid"]).await;
    assert_eq!(span["tags"]["guid:x-client-trace-id"], "ct-1");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.zipkin.spans().len(), 1, "{:?}", c.zipkin.spans());
}

#[tokio::test]
async fn zipkin_egress_spans_are_client_children() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(zipkin_provider(false), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        true,
    )
    .await;
    let h = seen(
        &s.get(
            "/a",
            &[
                ("x-b3-traceid", "00000000000000aa"),
                ("x-b3-spanid", "00000000000000bb"),
            ],
        )
        .await,
    );
    // OUTBOUND listener (as istiod renders gateways): a new span, child of the caller's.
    assert_eq!(h["x-b3-traceid"], "00000000000000aa");
    assert_eq!(h["x-b3-parentspanid"], "00000000000000bb");
    let id = h["x-b3-spanid"].clone();
    assert!(is_hex(&id, 16) && id != "00000000000000bb", "{h:?}");
    let span = c.zipkin.span("00000000000000aa").await;
    assert_eq!(span["kind"], "CLIENT");
    assert_eq!(span["id"], id.as_str());
    assert_eq!(span["parentId"], "00000000000000bb");
    assert!(span.get("shared").is_none(), "{span}");
    assert_eq!(span["annotations"][0]["value"], "cr");

    // Egress: the route's operation names the span and goes upstream.
    let h = seen(&s.get("/decorated", &[]).await);
    assert_eq!(h["x-envoy-decorator-operation"], "checkout-op");
    let span = c.zipkin.span(&h["x-b3-traceid"]).await;
    assert_eq!(span["name"], "checkout-op");
}

/// istio-agent's bootstrap tracer, which istiod's connection managers (tracing without a
/// provider) fall back to.
const BOOTSTRAP_ZIPKIN: &str = r#"tracing:
  http:
    name: envoy.tracers.zipkin
    typed_config:
      "@type": type.googleapis.com/envoy.config.trace.v3.ZipkinConfig
      collector_cluster: zipkin
      collector_endpoint: /api/v2/spans
      collector_endpoint_version: HTTP_JSON
      trace_id_128bit: true
      shared_span_context: false
"#;

#[tokio::test]
async fn connection_managers_without_a_provider_use_the_bootstraps() {
    let c = collectors().await;
    // As istiod renders it: sampling percentages, no provider.
    let t = Tracing {
        client_sampling: Some(Percent { value: 100.0 }),
        random_sampling: Some(Percent { value: 100.0 }),
        overall_sampling: Some(Percent { value: 100.0 }),
        ..Default::default()
    };
    let s = Setup::start_with(
        t,
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
        BOOTSTRAP_ZIPKIN,
    )
    .await;
    let h = seen(
        &s.get(
            "/a",
            &[
                ("x-b3-traceid", "00000000000000aa"),
                ("x-b3-spanid", "00000000000000bb"),
            ],
        )
        .await,
    );
    // shared_span_context: false: a child span even at ingress.
    assert_eq!(h["x-b3-traceid"], "00000000000000aa");
    assert_eq!(h["x-b3-parentspanid"], "00000000000000bb");
    let id = h["x-b3-spanid"].clone();
    assert_ne!(id, "00000000000000bb");
    let span = c.zipkin.span("00000000000000aa").await;
    assert_eq!(span["id"], id.as_str());
    assert_eq!(span["kind"], "SERVER");
    assert!(span.get("shared").is_none(), "{span}");
    // 128-bit ids for a new trace; the collector's Host is the cluster's name.
    let h = seen(&s.get("/a", &[]).await);
    assert!(is_hex(&h["x-b3-traceid"], 32), "{h:?}");
    c.zipkin.span(&h["x-b3-traceid"]).await;
    let posts = c.zipkin.0.lock().unwrap().clone();
    assert!(posts.iter().all(|(_, host, _, _)| host == "zipkin"));
}

// ---------------------------------------------------------------------------
// OpenTelemetry.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn opentelemetry_starts_and_continues_w3c_traces() {
    let c = collectors().await;
    let s = Setup::start(
        tracing(otel_provider(), None),
        c.backend,
        c.zipkin_addr,
        c.otel_addr,
        false,
    )
    .await;
    // No context: a new trace, sampled by the connection manager.
    let before = now_us() * 1000;
    let r = s.get("/w3c?q=1", &[("x-tag", "t")]).await;
    let h = seen(&r);
    let tp = h["traceparent"].clone();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00");
    assert!(is_hex(parts[1], 32) && is_hex(parts[2], 16), "{tp}");
    assert_eq!(parts[3], "01");
    // Envoy writes `tracestate` even when it is empty.
    assert_eq!(h["tracestate"], "");
    assert!(!h.contains_key("x-b3-traceid"), "{h:?}");
    let (authority, resource, span) = c.otel.span(parts[1]).await;
    // The Export call's :authority is the cluster's name.
    assert_eq!(authority, "otel");
    assert_eq!(hex(&span.span_id), parts[2]);
    assert!(span.parent_span_id.is_empty(), "{span:?}");
    assert_eq!(span.kind, otlp::SPAN_KIND_SERVER);
    assert_eq!(span.name, "ingress");
    assert!(span.start_time_unix_nano >= before, "{span:?}");
    assert!(
        span.end_time_unix_nano >= span.start_time_unix_nano,
        "{span:?}"
    );
    let service = resource
        .attributes
        .iter()
        .find(|kv| kv.key == "service.name")
        .and_then(|kv| kv.as_str());
    assert_eq!(service, Some("gateway-svc"));
    for (k, v) in [
        ("http.method", "GET"),
        ("http.url", &format!("http://{HOST}/w3c?q=1") as &str),
        ("http.status_code", "200"),
        ("upstream_cluster", "web"),
        ("node_id", NODE_ID),
        // OpenTelemetry keeps empty attributes.
        ("zone", ""),
        ("component", "proxy"),
        ("lit", "v1"),
        ("hdr", "t"),
        ("response_flags", "-"),
    ] {
        assert_eq!(attr(&span, k), Some(v), "attribute {k} in {span:?}");
    }

    // An incoming traceparent: same trace, the caller's span is the parent, its flag decides.
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let parent = "b7ad6b7169203331";
    let h = seen(
        &s.get(
            "/w3c",
            &[
                ("traceparent", &format!("00-{trace}-{parent}-01") as &str),
                ("tracestate", "vendor=abc"),
            ],
        )
        .await,
    );
    let tp = h["traceparent"].clone();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts[1], trace, "{tp}");
    assert_ne!(parts[2], parent, "{tp}");
    assert_eq!(parts[3], "01");
    assert_eq!(h["tracestate"], "vendor=abc");
    let (_, _, span) = c.otel.span(trace).await;
    assert_eq!(hex(&span.span_id), parts[2]);
    assert_eq!(hex(&span.parent_span_id), parent);
    assert_eq!(span.trace_state, "vendor=abc");

    // An unsampled caller: propagated with flag 00, never exported.
    let unsampled = "1af7651916cd43dd8448eb211c80319d";
    let h = seen(
        &s.get(
            "/w3c",
            &[(
                "traceparent",
                &format!("00-{unsampled}-{parent}-00") as &str,
            )],
        )
        .await,
    );
    assert!(h["traceparent"].ends_with("-00"), "{h:?}");
    let h = seen(&s.get("/w3c", &[]).await);
    let last = h["traceparent"].split('-').nth(1).unwrap().to_string();
    c.otel.span(&last).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !c.otel
            .spans()
            .iter()
            .any(|(_, _, s)| hex(&s.trace_id) == unsampled),
        "an unsampled trace was exported"
    );
}
