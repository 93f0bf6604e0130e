//! Traffic policy as a client and a backend see it: custom request/response headers at every
//! level (route config, virtual host, route, weighted-cluster entry), the HTTP fault filter
//! (listener config and per-route overrides), and gRPC local replies. Envoy is the spec: run
//! with `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh)` to check the expectations against it
//! (every case here passes against Envoy 1.40; the known differences are listed below).

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction as A, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::config::route::v3::{
    route, route_action, weighted_cluster, FilterConfig, Route, RouteAction, RouteConfiguration,
    WeightedCluster,
};
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::{fault_delay, FaultDelay};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    fault_abort, FaultAbort, HttpFault,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::v3::{
    fractional_percent::DenominatorType as D, FractionalPercent,
};
use envoy_types::pb::google::protobuf::{BoolValue, Duration as PbDuration, UInt32Value};

const HOST: &str = "traffic.example.com";
const FAULT: &str = "envoy.filters.http.fault";
/// The name of a fault filter that is `disabled` in the chain.
const OFF: &str = "fault-off";

/// Differences from Envoy that are known and explained: (mismatch prefix, reason).
const KNOWN_PORTICO_GAPS: &[(&str, &str)] = &[
    (
        "unrepresentable header",
        "a header name or value HTTP cannot carry (a space in the name, control characters in \
         the value) is NACKed by Portico; Envoy's lax validation accepts it and then fails the \
         requests on that route at its upstream codec",
    ),
    (
        "response_rate_limit",
        "response bandwidth limiting (fault.response_rate_limit) is not implemented, so Portico \
         NACKs it rather than accept a fault it would not inject",
    ),
];

// ---------------------------------------------------------------------------
// Builders
// ---------------------------------------------------------------------------

fn hv(key: &str, value: &str, action: A) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            value: value.into(),
            ..Default::default()
        }),
        append_action: action as i32,
        ..Default::default()
    }
}

fn set(key: &str, value: &str) -> HeaderValueOption {
    hv(key, value, A::OverwriteIfExistsOrAdd)
}

fn add(key: &str, value: &str) -> HeaderValueOption {
    hv(key, value, A::AppendIfExistsOrAdd)
}

#[allow(deprecated)]
fn legacy_append(key: &str, value: &str, append: bool) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            value: value.into(),
            ..Default::default()
        }),
        append: Some(BoolValue { value: append }),
        ..Default::default()
    }
}

fn keep_empty(key: &str) -> HeaderValueOption {
    HeaderValueOption {
        keep_empty_value: true,
        ..add(key, "")
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn pct(numerator: u32, d: D) -> Option<FractionalPercent> {
    Some(FractionalPercent {
        numerator,
        denominator: d as i32,
    })
}

fn abort(error: fault_abort::ErrorType, percentage: Option<FractionalPercent>) -> HttpFault {
    HttpFault {
        abort: Some(FaultAbort {
            error_type: Some(error),
            percentage,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn abort_http(status: u32, percentage: Option<FractionalPercent>) -> HttpFault {
    abort(fault_abort::ErrorType::HttpStatus(status), percentage)
}

fn delay(ms: i32) -> HttpFault {
    HttpFault {
        delay: Some(FaultDelay {
            fault_delay_secifier: Some(fault_delay::FaultDelaySecifier::FixedDelay(PbDuration {
                seconds: 0,
                nanos: ms * 1_000_000,
            })),
            percentage: pct(100, D::Hundred),
        }),
        ..Default::default()
    }
}

fn with_fault(mut r: Route, f: HttpFault) -> Route {
    r.typed_per_filter_config.insert(FAULT.into(), any(f));
    r
}

fn fault_filter(f: HttpFault) -> HttpFilter {
    HttpFilter {
        name: FAULT.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(f))),
        ..Default::default()
    }
}

fn router_filter() -> HttpFilter {
    HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(Router::default()))),
        ..Default::default()
    }
}

/// Every value of `name` the backend received, in order.
fn values(r: &UpstreamRequest, name: &str) -> Vec<String> {
    r.headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.clone())
        .collect()
}

fn raw_cluster(raw: &RawBackend) -> Snapshot {
    // A port nothing listens on: bound, then released.
    let dead: std::net::SocketAddr = ([127, 0, 0, 1], free_port()).into();
    Snapshot {
        clusters: vec![
            eds_cluster("raw"),
            eds_cluster("empty"),
            eds_cluster("dead"),
        ],
        endpoints: vec![
            cla("raw", &[raw.addr]),
            cla("empty", &[]),
            cla("dead", &[dead]),
        ],
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------
// Custom headers
// ---------------------------------------------------------------------------

/// The route config used for the header tests; `most_specific` sets
/// `most_specific_header_mutations_wins`.
fn header_routes(name: &str, most_specific: bool) -> RouteConfiguration {
    let mut h = rt(prefix("/h"), to_cluster("raw"));
    h.request_headers_to_add = vec![
        set("x-level", "route"),
        add("x-append", "gw"),
        hv("x-absent", "gw", A::AddIfAbsent),
        hv("x-absent-new", "gw", A::AddIfAbsent),
        hv("x-if-exists", "gw", A::OverwriteIfExists),
        hv("x-if-exists-present", "gw", A::OverwriteIfExists),
        legacy_append("x-legacy", "gw", false),
        legacy_append("x-legacy-append", "gw", true),
        keep_empty("x-empty-kept"),
        add("x-empty-dropped", ""),
        add("x-client", "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"),
        add("x-copy", "%REQ(x-in)%|%REQ(:AUTHORITY)%|%PROTOCOL%|100%%"),
        add("x-copy-missing", "%REQ(x-not-sent)%"),
        add("x-alt", "%REQ(x-not-sent?x-in)%"),
        add("x-trunc", "%REQ(x-in):3%"),
        set("x-request-id", "fixed-id"),
        add("x-copy-dup", "%REQ(x-dup)%"),
        add("x-utf8", "café ☕"),
    ];
    h.request_headers_to_remove = strings(&[
        "x-remove-me",
        "x-forwarded-proto",
        "x-envoy-expected-rq-timeout-ms",
    ]);
    h.response_headers_to_add = vec![
        add("x-resp", "route"),
        set("x-resp-level", "route"),
        set("server", "custom"),
        add("x-resp-copy", "%REQ(x-in)%"),
        add("x-resp-req-level", "%REQ(x-level)%"),
    ];
    h.response_headers_to_remove = strings(&["x-envoy-upstream-service-time"]);

    // A weighted route whose one entry carries its own headers.
    let mut entry = weighted_cluster::ClusterWeight {
        name: "raw".into(),
        weight: Some(UInt32Value { value: 1 }),
        ..Default::default()
    };
    entry.request_headers_to_add = vec![set("x-order", "entry"), add("x-entry", "entry")];
    entry.response_headers_to_add = vec![add("x-entry-resp", "entry")];
    let mut w = rt(
        prefix("/w"),
        route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::WeightedClusters(
                WeightedCluster {
                    clusters: vec![entry],
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
    );
    w.request_headers_to_add = vec![set("x-order", "route")];

    let mut d = rt(prefix("/direct"), direct(200, "direct"));
    d.response_headers_to_add = vec![add("x-direct", "yes")];

    let mut xff = rt(prefix("/xff"), to_cluster("raw"));
    xff.request_headers_to_add = vec![
        add("x-remote", "%DOWNSTREAM_REMOTE_ADDRESS%"),
        add("x-remote-ip", "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"),
        add(
            "x-direct-ip",
            "%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%",
        ),
        add("x-local-ip", "%DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT%"),
        add("x-method", "%REQ(:METHOD)% %REQ(:PATH)%"),
    ];

    // x-envoy-original-path is set after the custom headers: removing it has no effect.
    let mut rewrite = rt(
        prefix("/rw"),
        route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster("raw".into())),
            prefix_rewrite: "/rewritten".into(),
            ..Default::default()
        }),
    );
    rewrite.request_headers_to_remove = strings(&["x-envoy-original-path"]);

    // Local replies of the router carry the route's response headers.
    let mut unhealthy = rt(prefix("/unhealthy"), to_cluster("empty"));
    unhealthy.response_headers_to_add = vec![add("x-local-reply", "yes")];
    let mut refused = rt(prefix("/refused"), to_cluster("dead"));
    refused.response_headers_to_add = vec![add("x-local-reply", "yes")];
    let mut redirect = rt(
        prefix("/redirect"),
        route::Action::Redirect(envoy_types::pb::envoy::config::route::v3::RedirectAction {
            path_rewrite_specifier: Some(
                envoy_types::pb::envoy::config::route::v3::redirect_action::PathRewriteSpecifier::PathRedirect(
                    "/elsewhere".into(),
                ),
            ),
            ..Default::default()
        }),
    );
    redirect.response_headers_to_add = vec![add("x-redirect", "yes")];

    let mut vh = vhost(
        "traffic",
        &[HOST],
        vec![h, w, d, xff, rewrite, unhealthy, refused, redirect],
    );
    vh.request_headers_to_add = vec![set("x-level", "vh"), add("x-vh", "vh")];
    vh.response_headers_to_add = vec![set("x-resp-level", "vh")];
    vh.response_headers_to_remove = strings(&["x-backend"]);
    let mut rc = route_config(name, vec![vh]);
    rc.request_headers_to_add = vec![set("x-level", "rc"), add("x-rc", "rc")];
    rc.response_headers_to_add = vec![set("x-resp-level", "rc")];
    rc.most_specific_header_mutations_wins = most_specific;
    rc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_headers_reach_the_backend_and_the_client() {
    let raw = RawBackend::start().await;
    let second = free_port();
    let mesh = Mesh::start_raw(|port| {
        let mut s = raw_cluster(&raw);
        s.listeners = vec![l(port), l(second)];
        s.routes = vec![
            header_routes(&route_name(port), false),
            header_routes(&route_name(second), true),
        ];
        s
    })
    .await;
    mesh.wait_status("/direct", HOST, 200).await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);

    let sent = [
        ("x-in", "hello"),
        ("x-append", "client"),
        ("x-absent", "client"),
        ("x-if-exists-present", "client"),
        ("x-legacy", "client"),
        ("x-legacy-append", "client"),
        ("x-remove-me", "client"),
        ("x-request-id", "client-id"),
        ("x-dup", "first"),
        ("x-dup", "second"),
    ];
    let r = mesh.get("/h", HOST, &sent).await;
    c.eq("GET /h: status", r.status, 200);
    let up = raw.request("/h").expect("backend saw /h");
    let at = |name: &str| values(&up, name);
    c.eq(
        "backend x-level (route config wins by default)",
        at("x-level"),
        strings(&["rc"]),
    );
    c.eq("backend x-rc", at("x-rc"), strings(&["rc"]));
    c.eq("backend x-vh", at("x-vh"), strings(&["vh"]));
    c.eq(
        "backend x-append",
        at("x-append"),
        strings(&["client", "gw"]),
    );
    c.eq("backend x-absent", at("x-absent"), strings(&["client"]));
    c.eq("backend x-absent-new", at("x-absent-new"), strings(&["gw"]));
    c.eq("backend x-if-exists", at("x-if-exists"), strings(&[]));
    c.eq(
        "backend x-if-exists-present",
        at("x-if-exists-present"),
        strings(&["gw"]),
    );
    c.eq(
        "backend x-legacy (append: false)",
        at("x-legacy"),
        strings(&["gw"]),
    );
    c.eq(
        "backend x-legacy-append (append: true)",
        at("x-legacy-append"),
        strings(&["client", "gw"]),
    );
    c.eq("backend x-empty-kept", at("x-empty-kept"), strings(&[""]));
    c.eq(
        "backend x-empty-dropped",
        at("x-empty-dropped"),
        strings(&[]),
    );
    c.eq("backend x-client", at("x-client"), strings(&["127.0.0.1"]));
    c.eq(
        "backend x-copy",
        at("x-copy"),
        vec![format!("hello|{HOST}|HTTP/1.1|100%")],
    );
    c.eq("backend x-copy-missing", at("x-copy-missing"), strings(&[]));
    c.eq("backend x-alt", at("x-alt"), strings(&["hello"]));
    c.eq("backend x-trunc", at("x-trunc"), strings(&["hel"]));
    c.eq("backend x-remove-me", at("x-remove-me"), strings(&[]));
    c.eq(
        "backend x-forwarded-proto (removed)",
        at("x-forwarded-proto"),
        strings(&[]),
    );
    c.eq(
        "backend x-request-id (overwritten)",
        at("x-request-id"),
        strings(&["fixed-id"]),
    );
    c.eq("backend x-copy-dup", at("x-copy-dup"), strings(&["first"]));
    c.eq(
        "backend x-envoy-expected-rq-timeout-ms (removed)",
        at("x-envoy-expected-rq-timeout-ms"),
        strings(&[]),
    );
    c.eq("backend x-utf8", at("x-utf8"), strings(&["café ☕"]));

    c.eq(
        "client x-backend (removed by vhost)",
        r.header("x-backend"),
        None,
    );
    c.eq("client x-resp", r.header("x-resp"), Some("route"));
    c.eq("client x-resp-level", r.header("x-resp-level"), Some("rc"));
    c.eq("client x-resp-copy", r.header("x-resp-copy"), Some("hello"));
    c.eq(
        "client x-resp-req-level (the request as forwarded)",
        r.header("x-resp-req-level"),
        Some("rc"),
    );
    c.eq(
        "client server (the HCM's, set after)",
        r.header("server"),
        Some("envoy"),
    );
    c.eq(
        "client x-envoy-upstream-service-time (removed)",
        r.header("x-envoy-upstream-service-time"),
        None,
    );

    // Weighted-cluster entry: applied first, so the route's value wins over the entry's.
    let r = mesh.get("/w", HOST, &[]).await;
    c.eq("GET /w: status", r.status, 200);
    let up = raw.request("/w").expect("backend saw /w");
    c.eq(
        "weighted backend x-order",
        values(&up, "x-order"),
        strings(&["route"]),
    );
    c.eq(
        "weighted backend x-entry",
        values(&up, "x-entry"),
        strings(&["entry"]),
    );
    c.eq(
        "weighted backend x-level",
        values(&up, "x-level"),
        strings(&["rc"]),
    );
    c.eq(
        "weighted client x-entry-resp",
        r.header("x-entry-resp"),
        Some("entry"),
    );
    c.eq(
        "weighted client x-resp-level",
        r.header("x-resp-level"),
        Some("rc"),
    );

    // A direct response carries the route's response headers too.
    let r = mesh.get("/direct", HOST, &[]).await;
    c.eq(
        "direct: status, body",
        (r.status, r.body.as_str()),
        (200, "direct"),
    );
    c.eq("direct x-direct", r.header("x-direct"), Some("yes"));
    c.eq("direct x-resp-level", r.header("x-resp-level"), Some("rc"));

    // Envoy's downstream remote address without use_remote_address: the last XFF entry.
    let r = mesh
        .get("/xff", HOST, &[("x-forwarded-for", "10.9.8.7, 1.2.3.4")])
        .await;
    c.eq("GET /xff: status", r.status, 200);
    let up = raw.request("/xff").expect("backend saw /xff");
    c.eq(
        "xff backend x-remote",
        values(&up, "x-remote"),
        strings(&["1.2.3.4:0"]),
    );
    c.eq(
        "xff backend x-remote-ip",
        values(&up, "x-remote-ip"),
        strings(&["1.2.3.4"]),
    );
    c.eq(
        "xff backend x-direct-ip",
        values(&up, "x-direct-ip"),
        strings(&["127.0.0.1"]),
    );
    c.eq(
        "xff backend x-local-ip",
        values(&up, "x-local-ip"),
        strings(&["127.0.0.1"]),
    );
    c.eq(
        "xff backend x-method",
        values(&up, "x-method"),
        strings(&["GET /xff"]),
    );

    let r = mesh.get("/rw/x", HOST, &[]).await;
    c.eq("GET /rw/x: status", r.status, 200);
    let up = raw.request("/rewritten/x");
    c.eq(
        "rewrite: x-envoy-original-path survives its removal",
        up.map(|u| values(&u, "x-envoy-original-path")),
        Some(strings(&["/rw/x"])),
    );

    // The router's own local replies and redirects carry the route's response headers.
    let r = mesh.get("/unhealthy", HOST, &[]).await;
    c.eq(
        "no healthy upstream: status, body",
        (r.status, r.body.as_str()),
        (503, "no healthy upstream"),
    );
    c.eq(
        "no healthy upstream: x-local-reply",
        r.header("x-local-reply"),
        Some("yes"),
    );
    c.eq(
        "no healthy upstream: x-resp-level",
        r.header("x-resp-level"),
        Some("rc"),
    );
    let r = mesh.get("/refused", HOST, &[]).await;
    c.eq("connection refused: status", r.status, 503);
    c.eq(
        "connection refused: x-local-reply",
        r.header("x-local-reply"),
        Some("yes"),
    );
    let req = format!("GET /redirect HTTP/1.1\r\nHost: {HOST}\r\n\r\n");
    let r = raw_http1(mesh.port, req.as_bytes(), false).await;
    c.eq(
        "redirect: status, location, x-redirect, x-resp-level",
        (
            r.status,
            r.header("location"),
            r.header("x-redirect"),
            r.header("x-resp-level"),
        ),
        (
            301,
            Some(format!("http://{HOST}/elsewhere").as_str()),
            Some("yes"),
            Some("rc"),
        ),
    );

    // most_specific_header_mutations_wins: the route's value wins.
    let r = HttpClient::new()
        .get(
            &format!("http://127.0.0.1:{second}/h?most-specific"),
            Some(HOST),
            &[],
        )
        .await;
    c.eq("most specific: status", r.status, 200);
    let up = raw
        .request("/h?most-specific")
        .expect("backend saw /h?most-specific");
    c.eq(
        "most specific backend x-level",
        values(&up, "x-level"),
        strings(&["route"]),
    );
    c.eq(
        "most specific client x-resp-level",
        r.header("x-resp-level"),
        Some("route"),
    );
    c.finish();
}

/// Each bad header config is NACKed; the last good config keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_header_configs_are_nacked() {
    let raw = RawBackend::start().await;
    let mesh = Mesh::start(|port| {
        let mut s = raw_cluster(&raw);
        s.routes = vec![route_config(
            &route_name(port),
            vec![vhost(
                "traffic",
                &[HOST],
                vec![rt(prefix("/"), to_cluster("raw"))],
            )],
        )];
        s
    })
    .await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;
    let base = |r: Route| {
        route_config(
            &route_name(mesh.port),
            vec![vhost("traffic", &[HOST], vec![r])],
        )
    };
    let route = || rt(prefix("/"), to_cluster("raw"));
    let mut cases: Vec<(&str, RouteConfiguration)> = Vec::new();
    let mut r = route();
    r.request_headers_to_add = vec![add(":path", "/x")];
    cases.push(("add :path", base(r)));
    let mut r = route();
    r.request_headers_to_add = vec![add("host", "x")];
    cases.push(("add host", base(r)));
    let mut r = route();
    r.request_headers_to_remove = strings(&["host"]);
    cases.push(("remove host", base(r)));
    let mut r = route();
    r.response_headers_to_remove = strings(&[":status"]);
    cases.push(("remove :status", base(r)));
    let mut r = route();
    r.request_headers_to_add = vec![add("x-a", "%NOT_A_COMMAND%")];
    cases.push(("unknown command", base(r)));
    let mut r = route();
    r.request_headers_to_add = vec![add("x-a", "50%")];
    cases.push(("lone percent", base(r)));
    let mut r = route();
    r.response_headers_to_add = vec![add("x-a", "%REQ%")];
    cases.push(("REQ without header", base(r)));
    let mut r = route();
    r.request_headers_to_add = vec![HeaderValueOption {
        append_action: A::AddIfAbsent as i32,
        ..legacy_append("x-a", "v", true)
    }];
    cases.push(("append and append_action", base(r)));
    let mut vh = vhost("traffic", &[HOST], vec![route()]);
    vh.request_headers_to_add = vec![add("x-a", "%BOGUS(x)%")];
    cases.push((
        "vhost unknown command",
        route_config(&route_name(mesh.port), vec![vh]),
    ));

    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    for (i, (what, rc)) in cases.into_iter().enumerate() {
        let before = mesh.ads.log_len();
        mesh.ads.set_routes(&format!("bad-{i}"), &[rc]);
        let nack = mesh.ads.wait_for_nack_since(RDS, before, PROPAGATION).await;
        c.ok(
            format!("{what}: NACK carries a reason"),
            nack.error.as_deref().is_some_and(|e| !e.trim().is_empty()),
            &nack,
        );
        eprintln!("{what}: {:?}", nack.error);
    }
    let r = mesh.get("/still", HOST, &[]).await;
    c.eq("last good config serves", r.status, 200);

    // Configs Envoy accepts though HTTP cannot carry the header.
    for (i, (k, v)) in [("bad name", "v"), ("x-ctl", "a\u{1}b")].iter().enumerate() {
        let mut r = route();
        r.request_headers_to_add = vec![add(k, v)];
        let version = format!("lax-{i}");
        let before = mesh.ads.log_len();
        mesh.ads.set_routes(&version, &[base(r)]);
        let nacked = acked_or_nacked(&mesh.ads, &version, before).await;
        c.eq(
            format!("unrepresentable header {k:?}: {v:?}: NACKed"),
            nacked,
            false,
        );
    }
    c.finish();
}

/// Waits for the answer to RDS `version` pushed after log entry `before`: true if NACKed.
async fn acked_or_nacked(ads: &AdsServer, version: &str, before: usize) -> bool {
    eventually(
        &format!("an ACK or NACK of {version}"),
        PROPAGATION,
        || async {
            let log = ads.log();
            for r in log.iter().skip(before).filter(|r| r.type_url == RDS) {
                if r.is_nack() {
                    return Ok(true);
                }
                if r.version_info == version {
                    return Ok(false);
                }
            }
            Err("no answer yet".to_string())
        },
    )
    .await
}

// ---------------------------------------------------------------------------
// Fault injection
// ---------------------------------------------------------------------------

fn fault_routes(name: &str) -> RouteConfiguration {
    let plain = rt(prefix("/plain"), to_cluster("raw"));
    let override_ = with_fault(
        rt(prefix("/override"), to_cluster("raw")),
        abort_http(418, pct(100, D::Hundred)),
    );
    let mut disabled = rt(prefix("/disabled"), to_cluster("raw"));
    disabled.typed_per_filter_config.insert(
        FAULT.into(),
        any(FilterConfig {
            disabled: true,
            ..Default::default()
        }),
    );
    let delayed = with_fault(rt(prefix("/delay"), to_cluster("raw")), delay(300));
    let half = with_fault(
        rt(prefix("/half"), to_cluster("raw")),
        abort_http(503, pct(50, D::Hundred)),
    );
    let million = with_fault(
        rt(prefix("/million"), to_cluster("raw")),
        abort_http(500, pct(1_000_000, D::Million)),
    );
    let ten_thousand_zero = with_fault(
        rt(prefix("/tenk-zero"), to_cluster("raw")),
        abort_http(500, pct(0, D::TenThousand)),
    );
    let no_pct = with_fault(
        rt(prefix("/nopct"), to_cluster("raw")),
        abort_http(500, None),
    );
    let grpc = with_fault(
        rt(prefix("/grpc"), to_cluster("raw")),
        abort(fault_abort::ErrorType::GrpcStatus(14), pct(100, D::Hundred)),
    );
    let grpc_http = with_fault(
        rt(prefix("/grpchttp"), to_cluster("raw")),
        abort_http(503, pct(100, D::Hundred)),
    );
    let header = with_fault(
        rt(prefix("/header"), to_cluster("raw")),
        abort(
            fault_abort::ErrorType::HeaderAbort(fault_abort::HeaderAbort {}),
            pct(100, D::Hundred),
        ),
    );
    let mut other_cluster = abort_http(503, pct(100, D::Hundred));
    other_cluster.upstream_cluster = "other".into();
    let cluster = with_fault(rt(prefix("/cluster"), to_cluster("raw")), other_cluster);
    let mut direct_route = with_fault(
        rt(prefix("/direct"), direct(200, "direct")),
        abort_http(418, pct(100, D::Hundred)),
    );
    direct_route.response_headers_to_add = vec![add("x-route-resp", "yes")];
    // Enabling the disabled filter: an empty FilterConfig config keeps its listener config; a
    // plain config replaces it.
    let mut enable = rt(prefix("/enable-empty"), to_cluster("raw"));
    enable.typed_per_filter_config.insert(
        OFF.into(),
        any(FilterConfig {
            config: Some(envoy_types::pb::google::protobuf::Any::default()),
            ..Default::default()
        }),
    );
    let mut enable_own = rt(prefix("/enable-own"), to_cluster("raw"));
    enable_own
        .typed_per_filter_config
        .insert(OFF.into(), any(abort_http(451, pct(100, D::Hundred))));
    let mut custom = abort(fault_abort::ErrorType::GrpcStatus(13), pct(100, D::Hundred));
    if let Some(a) = custom.abort.as_mut() {
        a.response_body = "100% café".into();
    }
    let custom = with_fault(rt(prefix("/custom"), to_cluster("raw")), custom);
    let mut nodes = abort_http(503, pct(100, D::Hundred));
    nodes.downstream_nodes = strings(&["node-a"]);
    let nodes = with_fault(rt(prefix("/nodes"), to_cluster("raw")), nodes);
    let mut max_zero = abort_http(500, pct(100, D::Hundred));
    max_zero.max_active_faults = Some(UInt32Value { value: 0 });
    let max_zero = with_fault(rt(prefix("/maxzero"), to_cluster("raw")), max_zero);
    let header_delay = with_fault(
        rt(prefix("/hdelay"), to_cluster("raw")),
        HttpFault {
            delay: Some(FaultDelay {
                fault_delay_secifier: Some(fault_delay::FaultDelaySecifier::HeaderDelay(
                    fault_delay::HeaderDelay {},
                )),
                percentage: pct(100, D::Hundred),
            }),
            ..Default::default()
        },
    );
    let delay_then_abort = with_fault(
        rt(prefix("/both"), to_cluster("raw")),
        HttpFault {
            abort: abort_http(429, pct(100, D::Hundred)).abort,
            ..delay(200)
        },
    );
    route_config(
        name,
        // `*` too: an h2 client's :authority carries the port.
        vec![vhost(
            "traffic",
            &[HOST, "*"],
            vec![
                plain,
                override_,
                disabled,
                delayed,
                half,
                million,
                ten_thousand_zero,
                no_pct,
                grpc,
                grpc_http,
                header,
                cluster,
                direct_route,
                delay_then_abort,
                max_zero,
                header_delay,
                enable,
                enable_own,
                nodes,
                custom,
            ],
        )],
    )
}

/// The listener's own fault: abort 503 when the request carries `x-fault-me: yes`.
fn listener_fault() -> HttpFault {
    let mut f = abort_http(503, pct(100, D::Hundred));
    f.headers = vec![envoy_types::pb::envoy::config::route::v3::HeaderMatcher {
        name: "x-fault-me".into(),
        header_match_specifier: Some(
            envoy_types::pb::envoy::config::route::v3::header_matcher::HeaderMatchSpecifier::StringMatch(
                envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher {
                    match_pattern: Some(
                        envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern::Exact(
                            "yes".into(),
                        ),
                    ),
                    ..Default::default()
                },
            ),
        ),
        ..Default::default()
    }];
    f
}

/// (what, path, request headers, status, body)
type FaultCase = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
    u16,
    &'static str,
);

/// Whether a delay of `ms` was observed. Envoy's timers fire up to a few ms early as the
/// client measures (197.7 ms seen for 200 ms), so 5 ms of slack.
fn at_least(took: Duration, ms: u64) -> bool {
    took + Duration::from_millis(5) >= Duration::from_millis(ms)
}

async fn fault_mesh(raw: &RawBackend) -> Mesh {
    let mesh = Mesh::start_raw(|port| {
        let mut s = raw_cluster(raw);
        let mut h = hcm(port);
        h.stat_prefix = "faults".into();
        // A second fault filter, off unless a route enables it.
        let mut off = fault_filter(abort_http(500, pct(100, D::Hundred)));
        off.name = OFF.into();
        off.disabled = true;
        h.http_filters = vec![fault_filter(listener_fault()), off, router_filter()];
        s.listeners = vec![listener_with(port, h)];
        s.routes = vec![fault_routes(&route_name(port))];
        s
    })
    .await;
    mesh.wait_status("/plain", HOST, 200).await;
    mesh
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_abort_and_delay_as_envoy() {
    let raw = RawBackend::start().await;
    let mesh = fault_mesh(&raw).await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let mut aborts = 0u32;
    let mut delays = 0u32;

    let cases: &[FaultCase] = &[
        (
            "listener fault, headers not matched",
            "/plain",
            &[],
            200,
            "raw-backend",
        ),
        (
            "listener fault, headers matched",
            "/plain",
            &[("x-fault-me", "yes")],
            503,
            "fault filter abort",
        ),
        (
            "route override replaces the listener's",
            "/override",
            &[("x-fault-me", "yes")],
            418,
            "fault filter abort",
        ),
        (
            "route override applies without the listener's headers",
            "/override",
            &[],
            418,
            "fault filter abort",
        ),
        (
            "route disables the filter",
            "/disabled",
            &[("x-fault-me", "yes")],
            200,
            "raw-backend",
        ),
        (
            "MILLION denominator, all",
            "/million",
            &[],
            500,
            "fault filter abort",
        ),
        (
            "TEN_THOUSAND denominator, zero",
            "/tenk-zero",
            &[],
            200,
            "raw-backend",
        ),
        ("no percentage: never", "/nopct", &[], 200, "raw-backend"),
        (
            "header abort without header",
            "/header",
            &[],
            200,
            "raw-backend",
        ),
        (
            "header abort 429",
            "/header",
            &[("x-envoy-fault-abort-request", "429")],
            429,
            "fault filter abort",
        ),
        (
            "header abort out of range",
            "/header",
            &[("x-envoy-fault-abort-request", "700")],
            200,
            "raw-backend",
        ),
        (
            "upstream_cluster not matched",
            "/cluster",
            &[],
            200,
            "raw-backend",
        ),
        (
            "grpc_status abort, non-gRPC request",
            "/grpc",
            &[],
            200,
            "fault filter abort",
        ),
        (
            "no route: the listener's fault still runs",
            "/no-such-route",
            &[("x-fault-me", "yes")],
            503,
            "fault filter abort",
        ),
        (
            "no route, fault not matched",
            "/no-such-route",
            &[],
            404,
            "",
        ),
        (
            "header abort, percentage header 0",
            "/header",
            &[
                ("x-envoy-fault-abort-request", "429"),
                ("x-envoy-fault-abort-request-percentage", "0"),
            ],
            200,
            "raw-backend",
        ),
        (
            "downstream node listed",
            "/nodes",
            &[("x-envoy-downstream-service-node", "node-a")],
            503,
            "fault filter abort",
        ),
        (
            "downstream node not listed",
            "/nodes",
            &[("x-envoy-downstream-service-node", "node-b")],
            200,
            "raw-backend",
        ),
        ("downstream node absent", "/nodes", &[], 200, "raw-backend"),
        (
            "disabled filter, enabled by an empty FilterConfig",
            "/enable-empty",
            &[],
            500,
            "fault filter abort",
        ),
        (
            "disabled filter, enabled by its own config",
            "/enable-own",
            &[],
            451,
            "fault filter abort",
        ),
        (
            "max_active_faults 0: overflow, no fault",
            "/maxzero",
            &[],
            200,
            "raw-backend",
        ),
    ];
    for (what, path, headers, status, body) in cases {
        let served = raw.requests().len();
        let r = mesh.get(path, HOST, headers).await;
        c.eq(
            format!("{what}: status, body"),
            (r.status, r.body.as_str()),
            (*status, *body),
        );
        let aborted = *body == "fault filter abort";
        if aborted {
            aborts += 1;
            c.eq(
                format!("{what}: content-type"),
                r.header("content-type"),
                Some("text/plain"),
            );
            c.eq(
                format!("{what}: content-length"),
                r.header("content-length"),
                Some("18"),
            );
            c.eq(format!("{what}: server"), r.header("server"), Some("envoy"));
            c.eq(
                format!("{what}: backend not reached"),
                raw.requests().len(),
                served,
            );
        }
    }

    // A direct-response route is faulted too, and the abort carries none of the route's
    // response headers (the fault filter answers before the router).
    let r = mesh.get("/direct", HOST, &[]).await;
    aborts += 1;
    c.eq("direct route abort: status", r.status, 418);
    c.eq(
        "direct route abort: route headers",
        r.header("x-route-resp"),
        None,
    );

    // gRPC requests get a trailers-only gRPC answer.
    let grpc = [("content-type", "application/grpc")];
    let r = mesh.get("/grpc", HOST, &grpc).await;
    aborts += 1;
    c.eq(
        "gRPC abort: status, grpc-status, grpc-message, content-type",
        (
            r.status,
            r.header("grpc-status"),
            r.header("grpc-message"),
            r.header("content-type"),
        ),
        (
            200,
            Some("14"),
            Some("fault filter abort"),
            Some("application/grpc"),
        ),
    );
    c.eq("gRPC abort: body", r.body.as_str(), "");
    c.eq(
        "gRPC abort: content-length",
        r.header("content-length"),
        Some("0"),
    );
    let r = mesh.get("/grpchttp", HOST, &grpc).await;
    aborts += 1;
    c.eq(
        "HTTP abort of a gRPC request: status, grpc-status",
        (r.status, r.header("grpc-status")),
        (200, Some("14")),
    );

    // response_body replaces the text; in grpc-message it is percent-encoded.
    let r = mesh.get("/custom", HOST, &[]).await;
    aborts += 1;
    c.eq(
        "custom body: status, body",
        (r.status, r.body.as_str()),
        (200, "100% café"),
    );
    let r = mesh.get("/custom", HOST, &grpc).await;
    aborts += 1;
    c.eq(
        "custom body, gRPC: grpc-status, grpc-message",
        (r.header("grpc-status"), r.header("grpc-message")),
        (Some("13"), Some("100%25 caf%C3%A9")),
    );

    // Over HTTP/2 (h2c), as gRPC clients talk.
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .resolve(HOST, ([127, 0, 0, 1], mesh.port).into())
        .timeout(Duration::from_secs(5))
        .build()
        .expect("h2c client");
    let url = |p: &str| format!("http://{HOST}:{}{p}", mesh.port);
    let r = send_request(&h2, "POST", &url("/grpc"), None, &grpc, Some(vec![0; 5])).await;
    aborts += 1;
    c.eq(
        "h2 gRPC abort: status, grpc-status, grpc-message, content-length",
        (
            r.status,
            r.header("grpc-status"),
            r.header("grpc-message"),
            r.header("content-length"),
        ),
        (200, Some("14"), Some("fault filter abort"), None),
    );
    let r = send_request(&h2, "GET", &url("/override"), None, &[], None).await;
    aborts += 1;
    c.eq(
        "h2 abort: status, body, content-length",
        (r.status, r.body.as_str(), r.header("content-length")),
        (418, "fault filter abort", Some("18")),
    );

    // Delays happen before the upstream request.
    let start = Instant::now();
    let r = mesh.get("/delay", HOST, &[]).await;
    delays += 1;
    let took = start.elapsed();
    c.eq("delay: status", r.status, 200);
    c.ok("delay: took >= 300ms", at_least(took, 300), took);
    // Header-controlled delay.
    let start = Instant::now();
    let r = mesh
        .get("/hdelay", HOST, &[("x-envoy-fault-delay-request", "250")])
        .await;
    delays += 1;
    let took = start.elapsed();
    c.eq("header delay: status", r.status, 200);
    c.ok("header delay: took >= 250ms", at_least(took, 250), took);
    let start = Instant::now();
    let r = mesh.get("/hdelay", HOST, &[]).await;
    c.eq("header delay without header: status", r.status, 200);
    c.ok(
        "header delay without header: quick",
        start.elapsed() < Duration::from_millis(200),
        start.elapsed(),
    );
    // Delay, then abort.
    let start = Instant::now();
    let r = mesh.get("/both", HOST, &[]).await;
    delays += 1;
    aborts += 1;
    let took = start.elapsed();
    c.eq("delay then abort: status", r.status, 429);
    c.ok("delay then abort: took >= 200ms", at_least(took, 200), took);

    // 50% aborts: within 5 standard deviations of n/2 (n = 400: 200 +- 50).
    let n = 400;
    let mut half = 0;
    for _ in 0..n {
        let r = mesh.get("/half", HOST, &[]).await;
        match r.status {
            503 => half += 1,
            200 => {}
            s => c.ok("50% abort: only 200 and 503", false, s),
        }
    }
    aborts += half;
    c.ok(
        "50% abort: aborted count within 5 sigma",
        (150..=250).contains(&half),
        half,
    );

    // Envoy's counters: http.<stat_prefix>.fault.*
    let text = mesh.gw.prometheus().await;
    let stat = |name: &str| prom_value(&text, name, "envoy_http_conn_manager_prefix", "faults");
    c.eq(
        "envoy_http_fault_aborts_injected",
        stat("envoy_http_fault_aborts_injected"),
        f64::from(aborts),
    );
    c.eq(
        "envoy_http_fault_delays_injected",
        stat("envoy_http_fault_delays_injected"),
        f64::from(delays),
    );
    c.eq(
        "envoy_http_fault_faults_overflow",
        stat("envoy_http_fault_faults_overflow"),
        1.0,
    );
    c.eq(
        "envoy_http_fault_active_faults",
        stat("envoy_http_fault_active_faults"),
        0.0,
    );
    c.finish();
}

/// Bad fault configs are NACKed, at the listener (LDS) and per route (RDS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_fault_configs_are_nacked() {
    let raw = RawBackend::start().await;
    let mesh = fault_mesh(&raw).await;
    mesh.ads.wait_for_ack(LDS, "1", PROPAGATION).await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let route_cases: Vec<(&str, HttpFault)> = vec![
        (
            "route abort status 600",
            abort_http(600, pct(100, D::Hundred)),
        ),
        (
            "route abort status 100",
            abort_http(100, pct(100, D::Hundred)),
        ),
        ("route zero delay", delay(0)),
        (
            "route abort without error type",
            HttpFault {
                abort: Some(FaultAbort::default()),
                ..Default::default()
            },
        ),
    ];
    for (i, (what, f)) in route_cases.into_iter().enumerate() {
        let rc = route_config(
            &route_name(mesh.port),
            vec![vhost(
                "traffic",
                &[HOST],
                vec![with_fault(rt(prefix("/"), to_cluster("raw")), f)],
            )],
        );
        let before = mesh.ads.log_len();
        mesh.ads.set_routes(&format!("bad-{i}"), &[rc]);
        let nack = mesh.ads.wait_for_nack_since(RDS, before, PROPAGATION).await;
        c.ok(format!("{what}: NACK"), nack.error.is_some(), &nack);
        eprintln!("{what}: {:?}", nack.error);
    }
    // Accepted by Envoy, refused by Portico (see KNOWN_PORTICO_GAPS).
    let limited = HttpFault {
        response_rate_limit: Some(
            envoy_types::pb::envoy::extensions::filters::common::fault::v3::FaultRateLimit {
                limit_type: Some(
                    envoy_types::pb::envoy::extensions::filters::common::fault::v3::fault_rate_limit::LimitType::FixedLimit(
                        envoy_types::pb::envoy::extensions::filters::common::fault::v3::fault_rate_limit::FixedLimit {
                            limit_kbps: 1,
                        },
                    ),
                ),
                percentage: pct(100, D::Hundred),
            },
        ),
        ..Default::default()
    };
    let rc = route_config(
        &route_name(mesh.port),
        vec![vhost(
            "traffic",
            &[HOST],
            vec![with_fault(rt(prefix("/"), to_cluster("raw")), limited)],
        )],
    );
    let before = mesh.ads.log_len();
    mesh.ads.set_routes("rate-limit", &[rc]);
    let nacked = acked_or_nacked(&mesh.ads, "rate-limit", before).await;
    c.eq("response_rate_limit: NACKed", nacked, false);
    // Back to a good config before the listener case.
    let good = fault_routes(&route_name(mesh.port));
    mesh.ads.set_routes("good-again", &[good]);
    mesh.ads.wait_for_ack(RDS, "good-again", PROPAGATION).await;

    let mut h = hcm(mesh.port);
    h.stat_prefix = "faults".into();
    h.http_filters = vec![fault_filter(abort_http(99, None)), router_filter()];
    let before = mesh.ads.log_len();
    mesh.ads
        .set_listeners("bad-listener", &[listener_with(mesh.port, h)]);
    let nack = mesh.ads.wait_for_nack_since(LDS, before, PROPAGATION).await;
    c.ok(
        "listener abort status 99: NACK",
        nack.error.is_some(),
        &nack,
    );
    eprintln!("listener abort status 99: {:?}", nack.error);
    let r = mesh.get("/plain", HOST, &[]).await;
    c.eq("last good config serves", r.status, 200);
    c.finish();
}

/// (path, grpc-status, grpc-message, a route response header expected)
type GrpcCase = (
    &'static str,
    &'static str,
    Option<&'static str>,
    Option<(&'static str, &'static str)>,
);

/// Envoy answers a gRPC request's local replies (direct responses, redirects, no route, no
/// healthy upstream, connect failures) as trailers-only gRPC: HTTP 200, grpc-status mapped
/// from the HTTP status, the body as grpc-message, the route's response headers kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_requests_get_grpc_local_replies() {
    let raw = RawBackend::start().await;
    let mesh = Mesh::start_raw(|port| {
        let mut s = raw_cluster(&raw);
        s.listeners = vec![l(port)];
        s.routes = vec![header_routes(&route_name(port), false)];
        s
    })
    .await;
    mesh.wait_status("/direct", HOST, 200).await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let refused = "upstream connect error or disconnect/reset before headers. reset reason: \
                   remote connection failure";
    let cases: &[GrpcCase] = &[
        ("/direct", "2", Some("direct"), Some(("x-direct", "yes"))),
        (
            "/unhealthy",
            "14",
            Some("no healthy upstream"),
            Some(("x-local-reply", "yes")),
        ),
        (
            "/refused",
            "14",
            Some(refused),
            Some(("x-local-reply", "yes")),
        ),
        ("/nothing", "12", None, None),
        ("/redirect", "2", None, Some(("x-redirect", "yes"))),
    ];
    for (path, status, message, route_header) in cases {
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {HOST}\r\ncontent-type: application/grpc\r\n\r\n"
        );
        let r = raw_http1(mesh.port, req.as_bytes(), false).await;
        c.eq(
            format!("gRPC {path}: status, content-type, grpc-status, grpc-message, length, body"),
            (
                r.status,
                r.header("content-type"),
                r.header("grpc-status"),
                r.header("grpc-message"),
                r.header("content-length"),
                r.body_str(),
            ),
            (
                200,
                Some("application/grpc"),
                Some(*status),
                *message,
                Some("0"),
                String::new(),
            ),
        );
        if let Some((k, v)) = route_header {
            c.eq(format!("gRPC {path}: {k}"), r.header(k), Some(*v));
        }
    }
    c.finish();
}
