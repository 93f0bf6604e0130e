//! Local rate limiting (`envoy.filters.http.local_ratelimit`): a listener-wide bucket and a
//! per-route override with its own bucket; limited requests get 429 `local_rate_limited`.
//! Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
    RuntimeFractionalPercent,
};
use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::v3::{
    fractional_percent::DenominatorType, FractionalPercent, TokenBucket,
};
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

const HOST: &str = "rl.example.com";

fn all() -> Option<RuntimeFractionalPercent> {
    Some(RuntimeFractionalPercent {
        default_value: Some(FractionalPercent {
            numerator: 100,
            denominator: DenominatorType::Hundred as i32,
        }),
        runtime_key: "rl".into(),
    })
}

fn limit(tokens: u32, enforce: bool) -> LocalRateLimit {
    LocalRateLimit {
        stat_prefix: "rl".into(),
        token_bucket: Some(TokenBucket {
            max_tokens: tokens,
            tokens_per_fill: Some(UInt32Value { value: tokens }),
            fill_interval: Some(PDuration {
                seconds: 60,
                nanos: 0,
            }),
        }),
        filter_enabled: all(),
        filter_enforced: if enforce { all() } else { None },
        response_headers_to_add: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: "x-limited-by".into(),
                value: "portico-test".into(),
                ..Default::default()
            }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        }],
        request_headers_to_add_when_not_enforced: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: "x-would-be-limited".into(),
                value: "yes".into(),
                ..Default::default()
            }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_limit_the_listener_and_routes_override_them() {
    let web = Backend::start("web").await;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.http_filters.insert(
            0,
            HttpFilter {
                name: "envoy.filters.http.local_ratelimit".into(),
                config_type: Some(http_filter::ConfigType::TypedConfig(any(LocalRateLimit {
                    enable_x_ratelimit_headers: 1,
                    ..limit(5, true)
                }))),
                ..Default::default()
            },
        );
        let mut tight = rt(prefix("/tight"), to_cluster("web"));
        tight.typed_per_filter_config.insert(
            "envoy.filters.http.local_ratelimit".into(),
            any(limit(2, true)),
        );
        let mut shadow = rt(prefix("/shadow"), to_cluster("web"));
        shadow.typed_per_filter_config.insert(
            "envoy.filters.http.local_ratelimit".into(),
            any(limit(1, false)),
        );
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "rl",
                    &[HOST],
                    vec![tight, shadow, rt(prefix("/"), to_cluster("web"))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)])
    })
    .await;
    // Readiness goes through /tight, whose own bucket it uses (counted below).
    eventually("routes", PROPAGATION, || async {
        let r = mesh.get("/tight", HOST, &[]).await;
        if r.status == 200 {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    // The route bucket (2 tokens) had one taken by the readiness probe.
    let r = mesh.get("/tight", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    let r = mesh.get("/tight", HOST, &[]).await;
    assert_eq!(
        (r.status, r.body.as_str(), r.header("x-limited-by")),
        (429, "local_rate_limited", Some("portico-test")),
        "{r:?}"
    );
    // Not enforced: the request goes through, with the header upstream.
    for _ in 0..3 {
        let r = mesh.get("/shadow", HOST, &[]).await;
        assert_eq!(r.status, 200, "{r:?}");
    }
    // The listener bucket (5 tokens) serves the other routes; the route buckets did not use it.
    let mut codes = Vec::new();
    for _ in 0..7 {
        codes.push(mesh.get("/other", HOST, &[]).await.status);
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429, 429]);
    let r = mesh.get("/other", HOST, &[]).await;
    // DRAFT_VERSION_03 headers: bucket size, tokens left, seconds to the next (60 s / 5).
    assert_eq!(
        (
            r.header("x-ratelimit-limit"),
            r.header("x-ratelimit-remaining")
        ),
        (Some("5"), Some("0"))
    );
    let reset: u64 = r
        .header("x-ratelimit-reset")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((1..=12).contains(&reset), "{reset}");
    // Envoy's counters, shared by the three configs' stat prefix: the listener bucket let
    // 5 through and limited 3; /tight let 2 through and limited 1; /shadow let 1 through and
    // limited 2 without enforcing.
    let stats = mesh.gw.prometheus().await;
    let counter = |stat: &str| {
        prom_value(
            &stats,
            &format!("envoy_http_local_rate_limit_{stat}"),
            "envoy_local_http_ratelimit_prefix",
            "rl",
        )
    };
    assert_eq!(
        (
            counter("enabled"),
            counter("ok"),
            counter("rate_limited"),
            counter("enforced")
        ),
        (14.0, 8.0, 6.0, 4.0),
        "{stats}"
    );
}
