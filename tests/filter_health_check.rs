//! `envoy.filters.http.health_check` as Envoy answers it: a matching request is answered by the
//! gateway (200, or 503 under `POST /healthcheck/fail` or when a listed cluster has too few
//! healthy hosts) with the local cluster named; pass-through checks go upstream; other
//! responses say `x-envoy-immediate-health-check-fail` while the server fails. Runs against
//! Envoy too: `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test filter_health_check`.

mod common;

use common::*;
use envoy_types::pb::envoy::config::route::v3::{header_matcher, HeaderMatcher};
use envoy_types::pb::envoy::extensions::filters::http::health_check::v3::HealthCheck;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};

const HOST: &str = "hc.example.com";

fn health_check(path: &str, pass_through: bool, min: &[(&str, f64)]) -> HttpFilter {
    let hc = HealthCheck {
        pass_through_mode: Some(envoy_types::pb::google::protobuf::BoolValue {
            value: pass_through,
        }),
        headers: vec![HeaderMatcher {
            name: ":path".into(),
            header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
                StringMatcher {
                    match_pattern: Some(string_matcher::MatchPattern::Exact(path.into())),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }],
        cluster_min_healthy_percentages: min
            .iter()
            .map(|(c, p)| {
                (
                    c.to_string(),
                    envoy_types::pb::envoy::r#type::v3::Percent { value: *p },
                )
            })
            .collect(),
        ..Default::default()
    };
    HttpFilter {
        name: "envoy.filters.http.health_check".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(hc))),
        ..Default::default()
    }
}

async fn admin_post(mesh: &Mesh, path: &str) -> u16 {
    let req = format!("POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\n\r\n");
    raw_http1(mesh.gw.admin_port, req.as_bytes(), false)
        .await
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_answered_as_envoy() {
    let backend = Backend::start("web").await;
    let addr = backend.addr;
    let mesh = Mesh::start_raw(move |port| {
        let mut h = hcm(port);
        h.http_filters.splice(
            0..0,
            [
                health_check("/healthz", false, &[("web", 100.0)]),
                health_check("/empty-healthz", false, &[("empty", 50.0)]),
                health_check("/pass-healthz", true, &[]),
            ],
        );
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
            clusters: vec![eds_cluster("web"), eds_cluster("empty")],
            endpoints: vec![cla("web", &[addr]), cla("empty", &[])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_status("/app", HOST, 200).await;
    let mut c = Checks::with_gaps(&[]);
    let get = |path: &'static str| {
        let mesh = &mesh;
        async move { mesh.get(path, HOST, &[]).await }
    };
    let r = get("/healthz").await;
    c.eq("healthy: status", r.status, 200);
    c.eq("healthy: from the gateway", r.header("x-backend"), None);
    c.eq(
        "healthy: local cluster named",
        r.header("x-envoy-upstream-healthchecked-cluster"),
        Some("portico-test"),
    );
    c.eq(
        "a cluster without hosts: 503",
        get("/empty-healthz").await.status,
        503,
    );
    let r = get("/pass-healthz").await;
    c.eq(
        "pass-through: upstream answers",
        r.header("x-backend"),
        Some("web"),
    );
    c.eq(
        "pass-through: local cluster named",
        r.header("x-envoy-upstream-healthchecked-cluster"),
        Some("portico-test"),
    );
    let r = get("/app").await;
    c.eq(
        "other request: no fail header",
        r.header("x-envoy-immediate-health-check-fail"),
        None,
    );

    assert_eq!(admin_post(&mesh, "/healthcheck/fail").await, 200);
    c.eq("failing: 503", get("/healthz").await.status, 503);
    c.eq(
        "failing: pass-through answered too",
        get("/pass-healthz").await.status,
        503,
    );
    let r = get("/app").await;
    c.eq("failing: other requests still served", r.status, 200);
    c.eq(
        "failing: other responses say so",
        r.header("x-envoy-immediate-health-check-fail"),
        Some("true"),
    );
    assert_eq!(admin_post(&mesh, "/healthcheck/ok").await, 200);
    c.eq("ok again", get("/healthz").await.status, 200);
    c.finish();
}
