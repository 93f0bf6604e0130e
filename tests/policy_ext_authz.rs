//! `envoy.filters.http.ext_authz` as Envoy runs it, against a raw HTTP authorization server
//! and a gRPC one (`envoy.service.auth.v3.Authorization`): allowed requests carry the
//! server's headers upstream, denials are relayed with the server's status, headers and body,
//! an unreachable or failing server is `status_on_error` (403) or, with
//! `failure_mode_allow`, let through, a route can turn the check off or add context
//! extensions, and the stats count each outcome. Runs against Envoy too:
//! `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test policy_ext_authz`.

mod common;

use std::net::SocketAddr;

use bytes::Bytes;
use common::*;
use envoy_types::pb::envoy::config::core::v3::{
    grpc_service, header_value_option, GrpcService, HeaderValue, HeaderValueOption, HttpUri,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::{
    ext_authz, ext_authz_per_route, AuthorizationResponse, CheckSettings, ExtAuthz,
    ExtAuthzPerRoute, HttpService,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    string_matcher, ListStringMatcher, StringMatcher,
};
use envoy_types::pb::envoy::service::auth::v3 as authpb;
use http_body_util::Full;

const HOST: &str = "example.com";

fn exact(names: &[&str]) -> Option<ListStringMatcher> {
    Some(ListStringMatcher {
        patterns: names
            .iter()
            .map(|n| StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact(n.to_string())),
                ..Default::default()
            })
            .collect(),
    })
}

/// The raw HTTP authorization server: `/check/allow...` is allowed (200 with `x-user`, and
/// `x-auth-seen` naming the headers it got), `/check/deny...` is denied (401 with a body
/// and headers), anything else fails (503).
async fn http_authz() -> SocketAddr {
    serve_fn(|req| {
        let mut seen: Vec<String> = req.headers().keys().map(|k| k.to_string()).collect();
        seen.sort();
        let path = req.uri().path().to_string();
        let b = hyper::Response::builder()
            .header("x-auth-seen", seen.join(","))
            .header("x-auth-method", req.method().as_str())
            .header("x-auth-path", path.as_str());
        let r = if path.starts_with("/check/allow") {
            b.status(200)
                .header("x-user", "alice")
                .header("x-on-success", "yes")
                .header("x-not-forwarded", "no")
                .body(Full::new(Bytes::new()))
        } else if path.starts_with("/check/deny") {
            b.status(401)
                .header("www-authenticate", "Bearer realm=\"test\"")
                .header("x-deny-reason", "nope")
                .header("x-not-forwarded", "no")
                .body(Full::new(Bytes::from_static(b"denied by test")))
        } else {
            b.status(503).body(Full::new(Bytes::from_static(b"down")))
        };
        r.expect("response")
    })
    .await
}

fn authz_filter(c: ExtAuthz) -> HttpFilter {
    HttpFilter {
        name: "envoy.filters.http.ext_authz".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(c))),
        ..Default::default()
    }
}

fn snapshot(
    port: u16,
    filter: ExtAuthz,
    authz: (&str, SocketAddr, bool),
    web: SocketAddr,
) -> Snapshot {
    let mut h = hcm(port);
    let router = h.http_filters.pop().expect("router");
    h.http_filters = vec![authz_filter(filter), router];
    let mut open = rt(prefix("/open"), to_cluster("web"));
    open.typed_per_filter_config.insert(
        "envoy.filters.http.ext_authz".into(),
        any(ExtAuthzPerRoute {
            r#override: Some(ext_authz_per_route::Override::Disabled(true)),
        }),
    );
    let mut ctx = rt(prefix("/allow/ctx"), to_cluster("web"));
    ctx.typed_per_filter_config.insert(
        "envoy.filters.http.ext_authz".into(),
        any(ExtAuthzPerRoute {
            r#override: Some(ext_authz_per_route::Override::CheckSettings(
                CheckSettings {
                    context_extensions: [("team".to_string(), "blue".to_string())].into(),
                    ..Default::default()
                },
            )),
        }),
    );
    let (name, addr, h2) = authz;
    let cluster = if h2 {
        h2_cluster(name)
    } else {
        eds_cluster(name)
    };
    Snapshot {
        listeners: vec![listener_with(port, h)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "all",
                &["*"],
                vec![open, ctx, rt(prefix("/"), to_cluster("web"))],
            )],
        )],
        clusters: vec![eds_cluster("web"), cluster],
        endpoints: vec![cla("web", &[web]), cla(name, &[addr])],
        ..Default::default()
    }
}

fn http_service(cluster: &str) -> ExtAuthz {
    ExtAuthz {
        transport_api_version: 2,
        services: Some(ext_authz::Services::HttpService(HttpService {
            server_uri: Some(HttpUri {
                uri: format!("http://{cluster}"),
                http_upstream_type: Some(
                    envoy_types::pb::envoy::config::core::v3::http_uri::HttpUpstreamType::Cluster(
                        cluster.into(),
                    ),
                ),
                timeout: Some(envoy_types::pb::google::protobuf::Duration {
                    seconds: 2,
                    nanos: 0,
                }),
            }),
            path_prefix: "/check".into(),
            authorization_response: Some(AuthorizationResponse {
                allowed_upstream_headers: exact(&["x-user", "x-auth-seen", "x-auth-path"]),
                allowed_client_headers: exact(&["x-deny-reason"]),
                allowed_client_headers_on_success: exact(&["x-on-success"]),
                ..Default::default()
            }),
            ..Default::default()
        })),
        allowed_headers: exact(&["x-extra"]),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_service_allows_denies_and_fails_closed() {
    let web = header_echo().await;
    let authz = http_authz().await;
    let mesh =
        Mesh::start_raw(|port| snapshot(port, http_service("authz"), ("authz", authz, false), web))
            .await;
    let allowed = eventually("allowed", std::time::Duration::from_secs(15), || async {
        let r = mesh
            .get(
                "/allow/x?q=1",
                HOST,
                &[
                    ("x-extra", "1"),
                    ("x-other", "2"),
                    ("authorization", "Bearer t"),
                ],
            )
            .await;
        (r.status == 200).then_some(r).ok_or("not yet".to_string())
    })
    .await;
    // Upstream: the server's allowed headers; the client: allowed_client_headers_on_success.
    assert_eq!(allowed.header("x-req-x-user"), Some("alice"));
    assert_eq!(allowed.header("x-req-x-not-forwarded"), None);
    assert_eq!(allowed.header("x-on-success"), Some("yes"));
    assert_eq!(allowed.header("x-req-authorization"), Some("Bearer t"));
    // The check: path_prefix + the request's path and query, with its method and the
    // headers Envoy always sends plus those allowed_headers names.
    assert_eq!(allowed.header("x-req-x-auth-path"), Some("/check/allow/x"));
    // (Envoy's async client marks the check internal and says its timeout.)
    assert_eq!(
        allowed.header("x-req-x-auth-seen"),
        Some("authorization,content-length,host,x-envoy-expected-rq-timeout-ms,x-envoy-internal,x-extra")
    );

    let denied = mesh.get("/deny/me", HOST, &[]).await;
    assert_eq!(denied.status, 401);
    assert_eq!(denied.body, "denied by test");
    assert_eq!(
        denied.header("www-authenticate"),
        Some("Bearer realm=\"test\"")
    );
    assert_eq!(denied.header("x-deny-reason"), Some("nope"));
    assert_eq!(denied.header("x-not-forwarded"), None);

    let failed = mesh.get("/broken", HOST, &[]).await;
    assert_eq!(failed.status, 403);
    assert_eq!(failed.body, "");

    // The route turns the check off: the server would fail this path.
    let open = mesh.get("/open", HOST, &[]).await;
    assert_eq!(open.status, 200);
    assert_eq!(open.header("x-req-x-user"), None);

    assert!(mesh.gw.stat_ending("ext_authz.ok").await >= 1);
    assert_eq!(mesh.gw.stat_ending("ext_authz.denied").await, 1);
    assert_eq!(mesh.gw.stat_ending("ext_authz.error").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_fails_closed_or_open_as_configured() {
    let web = header_echo().await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    for allow in [false, true] {
        let mut f = http_service("authz");
        f.failure_mode_allow = allow;
        f.failure_mode_allow_header_add = allow;
        let mesh = Mesh::start_raw(|port| snapshot(port, f, ("authz", closed, false), web)).await;
        let r = eventually("served", std::time::Duration::from_secs(15), || async {
            let r = mesh.get("/allow", HOST, &[]).await;
            (r.status == 200 || r.status == 403)
                .then_some(r)
                .ok_or("not yet".to_string())
        })
        .await;
        if allow {
            assert_eq!(r.status, 200);
            assert_eq!(
                r.header("x-req-x-envoy-auth-failure-mode-allowed"),
                Some("true")
            );
            assert_eq!(
                mesh.gw.stat_ending("ext_authz.failure_mode_allowed").await,
                1
            );
        } else {
            assert_eq!(r.status, 403);
            assert_eq!(r.body, "");
        }
        assert_eq!(mesh.gw.stat_ending("ext_authz.error").await, 1);
    }
}

/// The gRPC authorization server: allows paths under `/allow` (with `x-user` and the
/// route's `team` context extension as `x-team`), denies the rest with 401, a header and a
/// body.
#[derive(Clone)]
struct Grpc;

#[tonic::async_trait]
impl authpb::authorization_server::Authorization for Grpc {
    async fn check(
        &self,
        req: tonic::Request<authpb::CheckRequest>,
    ) -> Result<tonic::Response<authpb::CheckResponse>, tonic::Status> {
        let attrs = req.into_inner().attributes.unwrap_or_default();
        let http = attrs.request.and_then(|r| r.http).unwrap_or_default();
        let header = |k: &str, v: &str| HeaderValueOption {
            header: Some(HeaderValue {
                key: k.into(),
                value: v.into(),
                ..Default::default()
            }),
            append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        };
        let resp = if http.path.starts_with("/allow") {
            let mut headers = vec![
                header("x-user", "alice"),
                header("x-method-seen", &http.method),
                header("x-host-seen", &http.host),
            ];
            if let Some(t) = attrs.context_extensions.get("team") {
                headers.push(header("x-team", t));
            }
            authpb::CheckResponse {
                status: Some(Default::default()),
                http_response: Some(authpb::check_response::HttpResponse::OkResponse(
                    authpb::OkHttpResponse {
                        headers,
                        headers_to_remove: vec!["x-secret".into()],
                        ..Default::default()
                    },
                )),
                ..Default::default()
            }
        } else {
            authpb::CheckResponse {
                status: Some(envoy_types::pb::google::rpc::Status {
                    code: 7,
                    ..Default::default()
                }),
                http_response: Some(authpb::check_response::HttpResponse::DeniedResponse(
                    authpb::DeniedHttpResponse {
                        status: Some(envoy_types::pb::envoy::r#type::v3::HttpStatus { code: 401 }),
                        headers: vec![header("x-deny-reason", "grpc says no")],
                        body: "denied over grpc".into(),
                    },
                )),
                ..Default::default()
            }
        };
        Ok(tonic::Response::new(resp))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_service_allows_with_headers_and_denies_with_body() {
    let web = header_echo().await;
    let authz = grpc_server(Grpc).await;
    let filter = ExtAuthz {
        transport_api_version: 2,
        services: Some(ext_authz::Services::GrpcService(grpc_to("authz"))),
        ..Default::default()
    };
    let mesh = Mesh::start_raw(|port| snapshot(port, filter, ("authz", authz, true), web)).await;
    let allowed = eventually("allowed", std::time::Duration::from_secs(15), || async {
        let r = mesh.get("/allow/x", HOST, &[("x-secret", "s")]).await;
        (r.status == 200).then_some(r).ok_or("not yet".to_string())
    })
    .await;
    assert_eq!(allowed.header("x-req-x-user"), Some("alice"));
    assert_eq!(allowed.header("x-req-x-method-seen"), Some("GET"));
    assert_eq!(allowed.header("x-req-x-host-seen"), Some(HOST));
    assert_eq!(allowed.header("x-req-x-secret"), None);
    assert_eq!(allowed.header("x-req-x-team"), None);

    let ctx = mesh.get("/allow/ctx", HOST, &[]).await;
    assert_eq!(ctx.status, 200);
    assert_eq!(ctx.header("x-req-x-team"), Some("blue"));

    let denied = mesh.get("/private", HOST, &[]).await;
    assert_eq!(denied.status, 401);
    assert_eq!(denied.body, "denied over grpc");
    assert_eq!(denied.header("x-deny-reason"), Some("grpc says no"));

    assert_eq!(mesh.gw.stat_ending("ext_authz.ok").await, 2);
    assert_eq!(mesh.gw.stat_ending("ext_authz.denied").await, 1);
}

fn tokio_stream_listener(
    l: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(l, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    })
}

/// A gRPC server with one answer for every check (network filters send no HTTP request).
#[derive(Clone)]
struct Fixed(bool);

#[tonic::async_trait]
impl authpb::authorization_server::Authorization for Fixed {
    async fn check(
        &self,
        req: tonic::Request<authpb::CheckRequest>,
    ) -> Result<tonic::Response<authpb::CheckResponse>, tonic::Status> {
        let attrs = req.into_inner().attributes.unwrap_or_default();
        // The connection's addresses are what a TCP check carries.
        let code = if self.0 && attrs.source.is_some() && attrs.destination.is_some() {
            0
        } else {
            7
        };
        Ok(tonic::Response::new(authpb::CheckResponse {
            status: Some(envoy_types::pb::google::rpc::Status {
                code,
                ..Default::default()
            }),
            ..Default::default()
        }))
    }
}

/// The cluster's `envoy_grpc` service, 2 s timeout.
fn grpc_to(cluster: &str) -> GrpcService {
    GrpcService {
        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
            grpc_service::EnvoyGrpc {
                cluster_name: cluster.into(),
                ..Default::default()
            },
        )),
        timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 2,
            nanos: 0,
        }),
        ..Default::default()
    }
}

async fn grpc_server(s: impl authpb::authorization_server::Authorization) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(authpb::authorization_server::AuthorizationServer::new(s))
            .serve_with_incoming(tokio_stream_listener(l)),
    );
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_ext_authz_closes_a_denied_connection() {
    use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
    use envoy_types::pb::envoy::extensions::filters::network::ext_authz::v3::ExtAuthz as NetworkExtAuthz;
    use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
        tcp_proxy::ClusterSpecifier, TcpProxy,
    };
    let web = header_echo().await;
    let (yes, no) = (
        grpc_server(Fixed(true)).await,
        grpc_server(Fixed(false)).await,
    );
    let (open_port, closed_port) = (free_port(), free_port());
    let listener = |port: u16, cluster: &str, prefix: &str| {
        let authz = NetworkExtAuthz {
            stat_prefix: prefix.into(),
            transport_api_version: 2,
            grpc_service: Some(grpc_to(cluster)),
            ..Default::default()
        };
        Listener {
            name: format!("tcp_{port}"),
            address: Some(socket_addr("127.0.0.1", port)),
            filter_chains: vec![FilterChain {
                filters: vec![
                    Filter {
                        name: "envoy.filters.network.ext_authz".into(),
                        config_type: Some(filter::ConfigType::TypedConfig(any(authz))),
                    },
                    Filter {
                        name: "envoy.filters.network.tcp_proxy".into(),
                        config_type: Some(filter::ConfigType::TypedConfig(any(TcpProxy {
                            stat_prefix: "web".into(),
                            cluster_specifier: Some(ClusterSpecifier::Cluster("web".into())),
                            ..Default::default()
                        }))),
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        }
    };
    let mesh = Mesh::start_raw(|_| Snapshot {
        listeners: vec![
            listener(open_port, "yes", "open"),
            listener(closed_port, "no", "closed"),
        ],
        clusters: vec![eds_cluster("web"), h2_cluster("yes"), h2_cluster("no")],
        endpoints: vec![cla("web", &[web]), cla("yes", &[yes]), cla("no", &[no])],
        ..Default::default()
    })
    .await;
    let req = b"GET / HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n\r\n";
    eventually(
        "the open listener",
        std::time::Duration::from_secs(15),
        || async {
            let r = raw_http1(open_port, req, false).await;
            (r.status == 200)
                .then_some(())
                .ok_or(format!("{} {}", r.status, r.body_str()))
        },
    )
    .await;
    let r = raw_http1(closed_port, req, false).await;
    assert_eq!(r.status, 0, "closed without an answer: {}", r.body_str());
    assert_eq!(mesh.gw.stat_ending("ext_authz.closed.denied").await, 1);
    assert!(mesh.gw.stat_ending("ext_authz.open.ok").await >= 1);
}

/// `with_request_body`: the check carries the body (cut at `max_request_bytes` with
/// `allow_partial_message`, refused with 413 without it), and the upstream still gets all of
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_carries_the_request_body() {
    use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::BufferSettings;
    let web = EchoBackend::start("web").await;
    // Allows a body that starts with "let me in"; says what it saw.
    let authz = serve_fn(|req| {
        let partial = req
            .headers()
            .get("x-envoy-auth-partial-body")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        let len = req
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        hyper::Response::builder()
            .status(200)
            .header("x-auth-partial", partial)
            .header("x-auth-length", len)
            .body(Full::new(Bytes::new()))
            .expect("response")
    })
    .await;
    for allow_partial in [true, false] {
        let mut f = http_service("authz");
        if let Some(ext_authz::Services::HttpService(h)) = f.services.as_mut() {
            h.authorization_response = Some(AuthorizationResponse {
                allowed_client_headers_on_success: exact(&["x-auth-partial", "x-auth-length"]),
                ..Default::default()
            });
        }
        f.with_request_body = Some(BufferSettings {
            max_request_bytes: 16,
            allow_partial_message: allow_partial,
            ..Default::default()
        });
        let mesh = Mesh::start_raw(|port| {
            let mut h = hcm(port);
            let router = h.http_filters.pop().expect("router");
            h.http_filters = vec![authz_filter(f), router];
            Snapshot {
                listeners: vec![listener_with(port, h)],
                routes: vec![route_config(
                    &route_name(port),
                    vec![vhost(
                        "all",
                        &["*"],
                        vec![rt(prefix("/"), to_cluster("web"))],
                    )],
                )],
                clusters: vec![eds_cluster("web"), eds_cluster("authz")],
                endpoints: vec![cla("web", &[web.addr]), cla("authz", &[authz])],
                ..Default::default()
            }
        })
        .await;
        let post = |body: &'static str| {
            let req = format!(
                "POST /allow HTTP/1.1\r\nhost: {HOST}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let port = mesh.port;
            async move { raw_http1(port, req.as_bytes(), false).await }
        };
        let short = eventually("served", std::time::Duration::from_secs(15), || async {
            let r = post("short body").await;
            (r.status == 200).then_some(r).ok_or("not yet".to_string())
        })
        .await;
        assert_eq!(short.body_str(), "short body", "the upstream gets the body");
        assert_eq!(short.header("x-auth-length"), Some("10"));
        assert_eq!(short.header("x-auth-partial"), Some("false"));
        let long = post("a body longer than sixteen bytes").await;
        if allow_partial {
            assert_eq!(long.status, 200);
            assert_eq!(long.body_str(), "a body longer than sixteen bytes");
            assert_eq!(long.header("x-auth-length"), Some("16"));
            assert_eq!(long.header("x-auth-partial"), Some("true"));
        } else {
            assert_eq!(
                (long.status, long.body_str()),
                (413, "Payload Too Large".into())
            );
        }
    }
}
