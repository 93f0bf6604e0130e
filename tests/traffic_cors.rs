//! CORS as Envoy's `envoy.filters.http.cors` applies a route's policy: preflights answered at
//! the gateway, allowed origins echoed on responses, others left alone. Every case runs
//! against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use common::*;
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::{Cors, CorsPolicy};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::google::protobuf::BoolValue;

const HOST: &str = "cors.example.com";

fn exact(s: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(MatchPattern::Exact(s.into())),
        ..Default::default()
    }
}

fn policy() -> CorsPolicy {
    CorsPolicy {
        allow_origin_string_match: vec![
            exact("https://shop.example.com"),
            StringMatcher {
                match_pattern: Some(MatchPattern::Suffix(".partner.example".into())),
                ..Default::default()
            },
        ],
        allow_methods: "GET,POST".into(),
        allow_headers: "x-token,content-type".into(),
        expose_headers: "x-request-id".into(),
        max_age: "600".into(),
        allow_credentials: Some(BoolValue { value: true }),
        ..Default::default()
    }
}

async fn mesh(backend: &Backend) -> Mesh {
    Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.http_filters.insert(
            0,
            HttpFilter {
                name: "envoy.filters.http.cors".into(),
                config_type: Some(http_filter::ConfigType::TypedConfig(any(Cors::default()))),
                ..Default::default()
            },
        );
        let mut with_cors = rt(prefix("/api"), to_cluster("web"));
        with_cors
            .typed_per_filter_config
            .insert("envoy.filters.http.cors".into(), any(policy()));
        let mut wildcard = policy();
        wildcard.allow_origin_string_match = vec![exact("*")];
        wildcard.allow_methods = "*".into();
        wildcard.allow_headers = "*".into();
        wildcard.forward_not_matching_preflights = Some(BoolValue { value: false });
        let mut open = rt(prefix("/open"), to_cluster("web"));
        open.typed_per_filter_config
            .insert("envoy.filters.http.cors".into(), any(wildcard));
        let mut strict = policy();
        strict.forward_not_matching_preflights = Some(BoolValue { value: false });
        let mut strict_route = rt(prefix("/strict"), to_cluster("web"));
        strict_route
            .typed_per_filter_config
            .insert("envoy.filters.http.cors".into(), any(strict));
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "cors",
                    &[HOST],
                    vec![
                        with_cors,
                        open,
                        strict_route,
                        rt(prefix("/"), to_cluster("web")),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", backend)])
    })
    .await
}

fn header<'a>(r: &'a RawResp, name: &str) -> Option<&'a str> {
    r.header(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflights_are_answered_and_allowed_origins_echoed() {
    let web = Backend::start("web").await;
    let mesh = mesh(&web).await;
    mesh.wait_backend("/api/x", HOST, &[], "web").await;
    let served = web.served();

    // A preflight from an allowed origin: answered by the gateway.
    let pre = raw_http1(
        mesh.port,
        format!(
            "OPTIONS /api/orders HTTP/1.1\r\nhost: {HOST}\r\norigin: https://shop.example.com\r\naccess-control-request-method: POST\r\naccess-control-request-headers: x-token\r\n\r\n"
        )
        .as_bytes(),
        false,
    )
    .await;
    assert_eq!(pre.status, 200, "{pre:?}");
    for (k, v) in [
        (
            "access-control-allow-origin",
            Some("https://shop.example.com"),
        ),
        ("access-control-allow-credentials", Some("true")),
        ("access-control-allow-methods", Some("GET,POST")),
        ("access-control-allow-headers", Some("x-token,content-type")),
        ("access-control-max-age", Some("600")),
        // Envoy runs the filter's response side on its own preflight answer too.
        ("access-control-expose-headers", Some("x-request-id")),
        ("content-length", Some("0")),
    ] {
        assert_eq!(header(&pre, k), v, "{k}: {pre:?}");
    }
    assert_eq!(
        web.served(),
        served,
        "the preflight never reaches the backend"
    );

    // A simple request from an allowed (suffix-matched) origin: headers on the response.
    let r = mesh
        .get(
            "/api/orders",
            HOST,
            &[("origin", "https://a.partner.example")],
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://a.partner.example")
    );
    assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
    assert_eq!(
        r.header("access-control-expose-headers"),
        Some("x-request-id")
    );

    // Origins not allowed: no CORS headers; their preflight goes to the backend.
    let r = mesh
        .get("/api/orders", HOST, &[("origin", "https://evil.example")])
        .await;
    assert_eq!(
        (r.status, r.header("access-control-allow-origin")),
        (200, None)
    );
    let pre = raw_http1(
        mesh.port,
        format!(
            "OPTIONS /api/orders HTTP/1.1\r\nhost: {HOST}\r\norigin: https://evil.example\r\naccess-control-request-method: POST\r\n\r\n"
        )
        .as_bytes(),
        false,
    )
    .await;
    assert_eq!(
        (pre.status, header(&pre, "x-backend")),
        (200, Some("web")),
        "{pre:?}"
    );
    // A route without a policy: nothing.
    let r = mesh
        .get("/", HOST, &[("origin", "https://shop.example.com")])
        .await;
    assert_eq!(r.header("access-control-allow-origin"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcards_and_strict_preflights() {
    let web = Backend::start("web").await;
    let mesh = mesh(&web).await;
    mesh.wait_backend("/api/x", HOST, &[], "web").await;
    // "*" methods and headers echo what the preflight asks for.
    let pre = raw_http1(
        mesh.port,
        format!(
            "OPTIONS /open HTTP/1.1\r\nhost: {HOST}\r\norigin: https://any.example\r\naccess-control-request-method: DELETE\r\naccess-control-request-headers: x-a,x-b\r\n\r\n"
        )
        .as_bytes(),
        false,
    )
    .await;
    assert_eq!(pre.status, 200, "{pre:?}");
    assert_eq!(
        header(&pre, "access-control-allow-origin"),
        Some("https://any.example")
    );
    assert_eq!(header(&pre, "access-control-allow-methods"), Some("DELETE"));
    assert_eq!(
        header(&pre, "access-control-allow-headers"),
        Some("x-a,x-b")
    );
    // forward_not_matching_preflights: false answers a foreign preflight without allow-origin.
    let pre = raw_http1(
        mesh.port,
        format!(
            "OPTIONS /strict HTTP/1.1\r\nhost: {HOST}\r\norigin: https://evil.example\r\naccess-control-request-method: POST\r\n\r\n"
        )
        .as_bytes(),
        false,
    )
    .await;
    assert_eq!(pre.status, 200, "{pre:?}");
    assert_eq!(header(&pre, "access-control-allow-origin"), None);
    assert_eq!(header(&pre, "x-backend"), None);
    assert_eq!(
        header(&pre, "access-control-allow-methods"),
        Some("GET,POST")
    );
}
