//! The connection manager's HTTP filters run in chain order, and a filter after one that
//! answered never runs: fault aborts before a local rate limiter spend none of its tokens,
//! limiters around a fault each run where they stand, and a CORS preflight is answered or
//! aborted depending on whether CORS or the fault comes first. Per-route
//! `typed_per_filter_config` reaches each filter by its chain name. Every case runs against
//! Envoy too (PORTICO_GATEWAY_BIN); the assertions were settled on Envoy 1.40 first.

mod common;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
    RuntimeFractionalPercent,
};
use envoy_types::pb::envoy::config::route::v3::{FilterConfig, Route};
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::{Cors, CorsPolicy};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    fault_abort, FaultAbort, HttpFault,
};
use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::envoy::r#type::v3::{
    fractional_percent::DenominatorType, FractionalPercent, TokenBucket,
};
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

const HOST: &str = "order.example.com";
const FAULT: &str = "fault";
const ORIGIN: &str = "https://shop.example.com";

fn all() -> Option<RuntimeFractionalPercent> {
    Some(RuntimeFractionalPercent {
        default_value: Some(FractionalPercent {
            numerator: 100,
            denominator: DenominatorType::Hundred as i32,
        }),
        runtime_key: "rl".into(),
    })
}

/// Two tokens, refilled once an hour: none come back while a test runs. Its replies say
/// which limiter answered (`x-limited-by`).
fn limiter(name: &str) -> HttpFilter {
    let c = LocalRateLimit {
        stat_prefix: name.into(),
        token_bucket: Some(TokenBucket {
            max_tokens: 2,
            tokens_per_fill: Some(UInt32Value { value: 2 }),
            fill_interval: Some(PDuration {
                seconds: 3600,
                nanos: 0,
            }),
        }),
        filter_enabled: all(),
        filter_enforced: all(),
        response_headers_to_add: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: "x-limited-by".into(),
                value: name.into(),
                ..Default::default()
            }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        }],
        ..Default::default()
    };
    HttpFilter {
        name: name.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(c))),
        ..Default::default()
    }
}

/// A route-level limiter config without `filter_enabled`: the limiter of that name does
/// nothing on the route (Envoy requires a bucket in a per-route config all the same).
fn no_limit(name: &str) -> LocalRateLimit {
    LocalRateLimit {
        stat_prefix: format!("{name}_off"),
        token_bucket: Some(TokenBucket {
            max_tokens: 1,
            tokens_per_fill: Some(UInt32Value { value: 1 }),
            fill_interval: Some(PDuration {
                seconds: 3600,
                nanos: 0,
            }),
        }),
        ..Default::default()
    }
}

/// Aborts every request with 503.
fn fault() -> HttpFilter {
    let c = HttpFault {
        abort: Some(FaultAbort {
            error_type: Some(fault_abort::ErrorType::HttpStatus(503)),
            percentage: Some(FractionalPercent {
                numerator: 100,
                denominator: DenominatorType::Hundred as i32,
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    HttpFilter {
        name: FAULT.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(c))),
        ..Default::default()
    }
}

fn cors() -> HttpFilter {
    HttpFilter {
        name: "cors".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(Cors::default()))),
        ..Default::default()
    }
}

fn disabled() -> FilterConfig {
    FilterConfig {
        disabled: true,
        ..Default::default()
    }
}

/// `path` with the fault filter off and the limiters named in `unlimited` doing nothing.
fn route(path: &str, fault_off: bool, unlimited: &[&str]) -> Route {
    let mut r = rt(prefix(path), to_cluster("web"));
    if fault_off {
        r.typed_per_filter_config
            .insert(FAULT.into(), any(disabled()));
    }
    for name in unlimited {
        r.typed_per_filter_config
            .insert(name.to_string(), any(no_limit(name)));
    }
    r
}

/// A gateway whose connection manager runs `filters` (then the router); `/ready` passes
/// every filter untouched (readiness spends no token), `/free` has the fault off and the
/// limiters in `free_unlimited` idle, `/` meets every filter.
async fn mesh(web: &Backend, filters: Vec<HttpFilter>, free_unlimited: &[&str]) -> Mesh {
    let limiters: Vec<String> = filters
        .iter()
        .filter(|f| f.name.starts_with("rl"))
        .map(|f| f.name.clone())
        .collect();
    let free_unlimited: Vec<String> = free_unlimited.iter().map(|s| s.to_string()).collect();
    let mesh = Mesh::start_raw(move |port| {
        let mut h = hcm(port);
        for (i, f) in filters.into_iter().enumerate() {
            h.http_filters.insert(i, f);
        }
        let every: Vec<&str> = limiters.iter().map(String::as_str).collect();
        let free: Vec<&str> = free_unlimited.iter().map(String::as_str).collect();
        let mut api = route("/api", false, &[]);
        api.typed_per_filter_config.insert(
            "cors".into(),
            any(CorsPolicy {
                allow_origin_string_match: vec![StringMatcher {
                    match_pattern: Some(MatchPattern::Exact(ORIGIN.into())),
                    ..Default::default()
                }],
                allow_methods: "GET,POST".into(),
                ..Default::default()
            }),
        );
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "order",
                    &[HOST],
                    vec![
                        route("/ready", true, &every),
                        route("/free", true, &free),
                        api,
                        route("/", false, &[]),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", web)])
    })
    .await;
    mesh.wait_backend("/ready", HOST, &[], "web").await;
    mesh
}

/// (status, which limiter answered, the body) of GET `path`.
async fn hit(mesh: &Mesh, path: &str) -> (u16, Option<String>, String) {
    let r = mesh.get(path, HOST, &[]).await;
    (
        r.status,
        r.header("x-limited-by").map(str::to_string),
        r.body.clone(),
    )
}

fn aborted() -> (u16, Option<String>, String) {
    (503, None, "fault filter abort".into())
}

fn limited(by: &str) -> (u16, Option<String>, String) {
    (429, Some(by.into()), "local_rate_limited".into())
}

fn served() -> (u16, Option<String>, String) {
    (200, None, String::new())
}

/// 200s carry the backend's body; only status and limiter matter for them.
async fn hit_status(mesh: &Mesh, path: &str) -> (u16, Option<String>, String) {
    let (s, by, body) = hit(mesh, path).await;
    if s == 200 {
        (s, by, String::new())
    } else {
        (s, by, body)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_before_a_limiter_spends_none_of_its_tokens() {
    let web = Backend::start("web").await;
    let mesh = mesh(&web, vec![fault(), limiter("rl")], &[]).await;
    for i in 0..3 {
        assert_eq!(hit_status(&mesh, "/").await, aborted(), "request {i}");
    }
    // The aborted requests never reached the limiter: both tokens are left.
    assert_eq!(hit_status(&mesh, "/free").await, served());
    assert_eq!(hit_status(&mesh, "/free").await, served());
    assert_eq!(hit_status(&mesh, "/free").await, limited("rl"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limiter_before_a_fault_answers_first_once_empty() {
    let web = Backend::start("web").await;
    let mesh = mesh(&web, vec![limiter("rl"), fault()], &[]).await;
    // Each request takes a token, then the fault aborts it; the third finds none.
    assert_eq!(hit_status(&mesh, "/").await, aborted());
    assert_eq!(hit_status(&mesh, "/").await, aborted());
    assert_eq!(hit_status(&mesh, "/").await, limited("rl"));
    assert_eq!(hit_status(&mesh, "/free").await, limited("rl"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiters_around_a_fault_run_where_they_stand() {
    let web = Backend::start("web").await;
    let mesh = mesh(
        &web,
        vec![limiter("rl_a"), fault(), limiter("rl_b")],
        &["rl_a"],
    )
    .await;
    // rl_a runs before the fault: two aborts spend its tokens, then it answers.
    assert_eq!(hit_status(&mesh, "/").await, aborted());
    assert_eq!(hit_status(&mesh, "/").await, aborted());
    assert_eq!(hit_status(&mesh, "/").await, limited("rl_a"));
    // rl_b comes after the fault: none of those requests reached it. On /free rl_a is
    // idle and the fault off, so rl_b's own two tokens decide.
    assert_eq!(hit_status(&mesh, "/free").await, served());
    assert_eq!(hit_status(&mesh, "/free").await, served());
    assert_eq!(hit_status(&mesh, "/free").await, limited("rl_b"));
}

async fn preflight(mesh: &Mesh) -> RawResp {
    raw_http1(
        mesh.port,
        format!(
            "OPTIONS /api/orders HTTP/1.1\r\nhost: {HOST}\r\norigin: {ORIGIN}\r\naccess-control-request-method: POST\r\n\r\n"
        )
        .as_bytes(),
        false,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_before_a_fault_answers_the_preflight() {
    let web = Backend::start("web").await;
    let mesh = mesh(&web, vec![cors(), fault()], &[]).await;
    let served_before = web.served();
    let pre = preflight(&mesh).await;
    assert_eq!(pre.status, 200, "{pre:?}");
    assert_eq!(pre.header("access-control-allow-origin"), Some(ORIGIN));
    assert_eq!(pre.header("access-control-allow-methods"), Some("GET,POST"));
    // A simple request from the allowed origin: CORS latched the origin, then the fault
    // aborted it; the abort passes CORS's response side on its way out.
    let r = mesh.get("/api/orders", HOST, &[("origin", ORIGIN)]).await;
    assert_eq!((r.status, r.body.as_str()), (503, "fault filter abort"));
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some(ORIGIN),
        "{r:?}"
    );
    assert_eq!(web.served(), served_before, "nothing reached the backend");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_before_cors_aborts_the_preflight() {
    let web = Backend::start("web").await;
    let mesh = mesh(&web, vec![fault(), cors()], &[]).await;
    let pre = preflight(&mesh).await;
    assert_eq!(pre.status, 503, "{pre:?}");
    assert_eq!(pre.body_str(), "fault filter abort");
    assert_eq!(pre.header("access-control-allow-origin"), None, "{pre:?}");
    let r = mesh.get("/api/orders", HOST, &[("origin", ORIGIN)]).await;
    assert_eq!((r.status, r.body.as_str()), (503, "fault filter abort"));
    assert_eq!(r.header("access-control-allow-origin"), None, "{r:?}");
}
