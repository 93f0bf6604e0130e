//! The connection manager's request-line and header hygiene, against Envoy: path
//! normalization (`normalize_path`, `merge_slashes`, each `path_with_escaped_slashes_action`)
//! and how it changes routing (which backend, the path it sees, 400s and 307s with their
//! `location`), `common_http_protocol_options.headers_with_underscores_action` (what the client
//! gets, what the backend sees), and a listener carrying istiod's `istio.alpn` filter. Requests
//! go over raw HTTP/1.1 so the path reaches the gateway byte for byte. Runs against Envoy too
//! (PORTICO_GATEWAY_BIN), same assertions.

mod common;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{
    http_protocol_options::HeadersWithUnderscoresAction, HttpProtocolOptions,
};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::{PathWithEscapedSlashesAction, RouteSpecifier},
    http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::google::protobuf::{Any, BoolValue};
use prost::Message;

const ROUTE: &str = "norm";
const HOST: &str = "norm.example.com";
const A: &str = "outbound|80||a.default.svc.cluster.local";
const B: &str = "outbound|80||b.default.svc.cluster.local";
const OTHER: &str = "outbound|80||other.default.svc.cluster.local";

/// Routes: `/a/...` to a, `/b...` to b, the rest to other.
fn routes() -> envoy_types::pb::envoy::config::route::v3::RouteConfiguration {
    route_config(
        ROUTE,
        vec![vhost(
            "norm",
            &["*"],
            vec![
                rt(prefix("/a/"), to_cluster(A)),
                rt(prefix("/b"), to_cluster(B)),
                rt(prefix("/"), to_cluster(OTHER)),
            ],
        )],
    )
}

fn manager(tune: impl FnOnce(&mut HttpConnectionManager)) -> HttpConnectionManager {
    let mut h = hcm(0);
    h.stat_prefix = "norm".into();
    h.route_specifier = Some(RouteSpecifier::Rds(Rds {
        config_source: Some(ads_source()),
        route_config_name: ROUTE.into(),
    }));
    tune(&mut h);
    h
}

/// The listeners under test, each on its own port.
#[derive(Clone, Copy)]
enum L {
    Plain,
    Normalize,
    Merge,
    Keep,
    Reject,
    Redirect,
    RedirectNormalize,
    Forward,
    UnderscoreReject,
    UnderscoreDrop,
    Alpn,
}

fn escaped(h: &mut HttpConnectionManager, a: PathWithEscapedSlashesAction) {
    h.path_with_escaped_slashes_action = a as i32;
}

fn underscores(h: &mut HttpConnectionManager, a: HeadersWithUnderscoresAction) {
    h.common_http_protocol_options = Some(HttpProtocolOptions {
        headers_with_underscores_action: a as i32,
        ..Default::default()
    });
}

/// istio/api's `istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig`, as istiod sends it.
#[derive(Clone, PartialEq, prost::Message)]
struct AlpnFilterConfig {
    #[prost(message, repeated, tag = "1")]
    alpn_override: Vec<AlpnOverride>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct AlpnOverride {
    #[prost(int32, tag = "1")]
    upstream_protocol: i32,
    #[prost(string, repeated, tag = "2")]
    alpn_override: Vec<String>,
}

/// istiod's `istio.alpn` entry (PILOT_ENABLE_ALPN_FILTER), before the router.
fn alpn_filter() -> HttpFilter {
    let config = AlpnFilterConfig {
        alpn_override: vec![
            AlpnOverride {
                upstream_protocol: 0,
                alpn_override: vec!["istio-http/1.0".into(), "istio".into(), "http/1.0".into()],
            },
            AlpnOverride {
                upstream_protocol: 1,
                alpn_override: vec!["istio-http/1.1".into(), "istio".into(), "http/1.1".into()],
            },
            AlpnOverride {
                upstream_protocol: 2,
                alpn_override: vec!["istio-h2".into(), "istio".into(), "h2".into()],
            },
        ],
    };
    HttpFilter {
        name: "istio.alpn".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(Any {
            type_url:
                "type.googleapis.com/istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig"
                    .into(),
            value: config.encode_to_vec(),
        })),
        ..Default::default()
    }
}

fn listener(which: L, port: u16) -> Listener {
    use HeadersWithUnderscoresAction as U;
    use PathWithEscapedSlashesAction as E;
    let h = manager(|h| match which {
        L::Plain => {}
        L::Normalize => h.normalize_path = Some(BoolValue { value: true }),
        L::Merge => h.merge_slashes = true,
        L::Keep => escaped(h, E::KeepUnchanged),
        L::Reject => escaped(h, E::RejectRequest),
        L::Redirect => escaped(h, E::UnescapeAndRedirect),
        L::RedirectNormalize => {
            escaped(h, E::UnescapeAndRedirect);
            h.normalize_path = Some(BoolValue { value: true });
            h.merge_slashes = true;
        }
        L::Forward => escaped(h, E::UnescapeAndForward),
        L::UnderscoreReject => underscores(h, U::RejectRequest),
        L::UnderscoreDrop => underscores(h, U::DropHeader),
        L::Alpn => h.http_filters.insert(0, alpn_filter()),
    });
    listener_with(port, h)
}

struct World {
    mesh: Mesh,
    ports: Vec<u16>,
    a: RawBackend,
    b: RawBackend,
    other: RawBackend,
}

impl World {
    async fn start(with: &[L]) -> World {
        let a = RawBackend::start().await;
        let b = RawBackend::start().await;
        let other = RawBackend::start().await;
        let mut ports = Vec::new();
        let mesh = Mesh::start_raw(|first| {
            ports.push(first);
            while ports.len() < with.len() {
                ports.push(free_port());
            }
            let mut s = Snapshot {
                listeners: with
                    .iter()
                    .zip(&ports)
                    .map(|(w, p)| listener(*w, *p))
                    .collect(),
                routes: vec![routes()],
                ..Default::default()
            };
            for (c, be) in [(A, &a), (B, &b), (OTHER, &other)] {
                s.clusters.push(eds_cluster(c));
                s.endpoints.push(cla(c, &[be.addr]));
            }
            s
        })
        .await;
        let w = World {
            mesh,
            ports,
            a,
            b,
            other,
        };
        // Every listener serving (each answers its catch-all route).
        let wr = &w;
        for (i, _) in with.iter().enumerate() {
            let port = wr.ports[i];
            eventually(&format!("listener {port}"), PROPAGATION, || async move {
                let r = wr.send(port, "/warm", "").await;
                if r.status == 200 {
                    Ok(())
                } else {
                    Err(format!("{} {}", r.status, r.body_str()))
                }
            })
            .await;
        }
        w
    }

    async fn send(&self, port: u16, path: &str, extra: &str) -> RawResp {
        let req =
            format!("GET {path} HTTP/1.1\r\nhost: {HOST}\r\n{extra}connection: close\r\n\r\n");
        raw_http1(port, req.as_bytes(), false).await
    }

    /// Which backend got the request tagged `x-case: <case>`, and the target it saw.
    fn seen(&self, case: &str) -> Option<(&'static str, UpstreamRequest)> {
        [("a", &self.a), ("b", &self.b), ("other", &self.other)]
            .into_iter()
            .find_map(|(name, be)| {
                be.requests()
                    .into_iter()
                    .find(|r| r.header("x-case") == Some(case))
                    .map(|r| (name, r))
            })
    }
}

/// One request and what came of it: (status, location, backend, target the backend saw).
async fn outcome(
    w: &World,
    port: u16,
    case: &str,
    path: &str,
) -> (u16, Option<String>, Option<&'static str>, Option<String>) {
    let r = w.send(port, path, &format!("x-case: {case}\r\n")).await;
    let seen = w.seen(case);
    (
        r.status,
        r.header("location").map(str::to_string),
        seen.as_ref().map(|(n, _)| *n),
        seen.map(|(_, r)| r.target),
    )
}

fn routed(
    backend: &'static str,
    target: &str,
) -> (u16, Option<String>, Option<&'static str>, Option<String>) {
    (200, None, Some(backend), Some(target.to_string()))
}

fn local(
    status: u16,
    location: Option<&str>,
) -> (u16, Option<String>, Option<&'static str>, Option<String>) {
    (status, location.map(str::to_string), None, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_normalization_changes_routing_as_envoy_does() {
    let which = [
        L::Plain,
        L::Normalize,
        L::Merge,
        L::Keep,
        L::Reject,
        L::Redirect,
        L::RedirectNormalize,
        L::Forward,
    ];
    let w = World::start(&which).await;
    let port = |l: usize| w.ports[l];
    let (plain, norm, merge, keep, reject, redirect, redir_norm, forward) = (
        port(0),
        port(1),
        port(2),
        port(3),
        port(4),
        port(5),
        port(6),
        port(7),
    );
    let cases: Vec<(&str, u16, &str, _)> = vec![
        // No normalization: routed and forwarded as sent.
        ("plain-dots", plain, "/a/../b", routed("a", "/a/../b")),
        ("plain-slashes", plain, "//b", routed("other", "//b")),
        // Envoy's codec refuses raw UTF-8 in the request target, normalized or not.
        ("plain-utf8", plain, "/b/\u{e9}", local(400, None)),
        ("plain-brace", plain, "/b{x}", routed("b", "/b{x}")),
        ("plain-quote", plain, "/b\"x", routed("b", "/b\"x")),
        ("plain-escaped", plain, "/a%2Fb", routed("other", "/a%2Fb")),
        // normalize_path: RFC 3986 dot segments, unreserved escapes decoded, query untouched.
        ("norm-dots", norm, "/a/../b", routed("b", "/b")),
        ("norm-dot", norm, "/a/./c/../d", routed("a", "/a/d")),
        ("norm-escaped-dots", norm, "/a/%2e%2e/b", routed("b", "/b")),
        ("norm-unreserved", norm, "/%61/x", routed("a", "/a/x")),
        ("norm-query", norm, "/b?x=/../y", routed("b", "/b?x=/../y")),
        ("norm-above-root", norm, "/../b", routed("b", "/b")),
        ("norm-slashes-kept", norm, "//b", routed("other", "//b")),
        (
            "norm-escaped-slash-kept",
            norm,
            "/a/..%2Fb",
            routed("a", "/a/..%2Fb"),
        ),
        (
            "norm-single-escaped-dot",
            norm,
            "/a/%2e/b",
            routed("a", "/a/b"),
        ),
        ("norm-trailing-dots", norm, "/a/c/..", routed("a", "/a/")),
        ("norm-trailing-dot", norm, "/a/c/.", routed("a", "/a/c/")),
        (
            "norm-double-slash-dots",
            norm,
            "/a//../b",
            routed("a", "/a/b"),
        ),
        ("norm-tilde", norm, "/b%7Ex", routed("b", "/b~x")),
        ("norm-upper", norm, "/b%41", routed("b", "/bA")),
        ("norm-lower-hex", norm, "/b%3a", routed("b", "/b%3a")),
        ("norm-bad-percent", norm, "/b%zz", routed("b", "/b%zz")),
        ("norm-nul", norm, "/b%00", local(400, None)),
        ("norm-quote", norm, "/b\"x", routed("b", "/b%22x")),
        ("norm-brace", norm, "/b{x}", routed("b", "/b%7Bx%7D")),
        (
            "norm-backslash-escaped",
            norm,
            "/a/x%5C..%5Cb",
            routed("a", "/a/x%5C..%5Cb"),
        ),
        ("norm-dotdot-name", norm, "/a/..b", routed("a", "/a/..b")),
        // Raw UTF-8 in the request line: Envoy's codec refuses it before normalization.
        ("norm-utf8", norm, "/b/\u{e9}", local(400, None)),
        // merge_slashes.
        ("merge", merge, "//b///c", routed("b", "/b/c")),
        ("merge-query", merge, "/b?x=//y", routed("b", "/b?x=//y")),
        // path_with_escaped_slashes_action.
        ("keep", keep, "/a%2Fb", routed("other", "/a%2Fb")),
        ("reject-2F", reject, "/a%2Fb", local(400, None)),
        ("reject-2f", reject, "/a%2fb", local(400, None)),
        ("reject-5C", reject, "/a%5Cb", local(400, None)),
        ("reject-none", reject, "/b/c", routed("b", "/b/c")),
        ("reject-query", reject, "/b?x=%2F", routed("b", "/b?x=%2F")),
        ("redirect", redirect, "/x%2Fb", local(307, Some("/x/b"))),
        (
            "redirect-query",
            redirect,
            "/x%2fb?q=1",
            local(307, Some("/x/b?q=1")),
        ),
        ("redirect-none", redirect, "/b/c", routed("b", "/b/c")),
        (
            "redirect-normalized",
            redir_norm,
            "/a%2F..%2F%2Fb",
            local(307, Some("/b")),
        ),
        ("forward", forward, "/a%2Fb", routed("a", "/a/b")),
        (
            "forward-lower",
            forward,
            "/x%2fb%2F",
            routed("other", "/x/b/"),
        ),
        (
            "forward-backslash",
            forward,
            "/a%5Cb",
            routed("other", "/a\\b"),
        ),
        (
            "forward-query",
            forward,
            "/b?x=%2F",
            routed("b", "/b?x=%2F"),
        ),
        (
            "redirect-backslash",
            redirect,
            "/x%5Cb",
            local(307, Some("/x\\b")),
        ),
        (
            "redirect-normalized-dots",
            redir_norm,
            "/a/x%2F..%2F..%2Fb",
            local(307, Some("/b")),
        ),
    ];
    let mut checks = Checks::with_gaps(&[]);
    for (case, port, path, want) in cases {
        let got = outcome(&w, port, case, path).await;
        checks.eq(format!("{case}: GET {path}"), got, want);
    }
    checks.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_with_underscores_as_envoy_treats_them() {
    let w = World::start(&[L::Plain, L::UnderscoreReject, L::UnderscoreDrop]).await;
    let (allow, reject, drop) = (w.ports[0], w.ports[1], w.ports[2]);
    let mut checks = Checks::with_gaps(&[]);

    // ALLOW (the default): the header goes upstream.
    let r = w.send(allow, "/b", "x-case: allow\r\nx_under: 1\r\n").await;
    checks.eq("ALLOW: status", r.status, 200);
    let seen = w
        .seen("allow")
        .map(|(_, r)| r.header("x_under").map(str::to_string));
    checks.eq("ALLOW: upstream header", seen, Some(Some("1".to_string())));

    // REJECT_REQUEST: 400, nothing upstream.
    let r = w
        .send(reject, "/b", "x-case: reject\r\nx_under: 1\r\n")
        .await;
    checks.eq("REJECT_REQUEST: status", r.status, 400);
    checks.eq(
        "REJECT_REQUEST: upstream",
        w.seen("reject").is_some(),
        false,
    );
    // The codec refuses it and closes the connection, even one meant to be kept alive.
    let req = format!("GET /b HTTP/1.1\r\nhost: {HOST}\r\nx-case: reject-ka\r\nX_Under: 1\r\n\r\n");
    let r = raw_http1(reject, req.as_bytes(), false).await;
    checks.eq("REJECT_REQUEST keep-alive: status", r.status, 400);
    checks.eq(
        "REJECT_REQUEST keep-alive: connection",
        r.header("connection"),
        Some("close"),
    );
    // A request without one passes.
    let r = w
        .send(reject, "/b", "x-case: reject-ok\r\nx-dash: 1\r\n")
        .await;
    checks.eq("REJECT_REQUEST without: status", r.status, 200);

    // DROP_HEADER: routed, the header removed, the others kept.
    let r = w
        .send(
            drop,
            "/b",
            "x-case: drop\r\nx_under: 1\r\nX_Other: 3\r\nx-dash: 2\r\n",
        )
        .await;
    checks.eq("DROP_HEADER: status", r.status, 200);
    let seen = w.seen("drop").map(|(_, r)| {
        (
            r.header("x_under").map(str::to_string),
            r.header("x_other").map(str::to_string),
            r.header("x-dash").map(str::to_string),
        )
    });
    checks.eq(
        "DROP_HEADER: upstream headers",
        seen,
        Some((None, None, Some("2".to_string()))),
    );
    checks.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_with_istio_alpn_is_accepted_and_routes() {
    if is_envoy(&gateway_bin()) {
        // Envoy 1.40 from PyPI has no istio.alpn (it is in istio/proxy's build): it would
        // refuse the listener, which says nothing about Portico.
        return;
    }
    let w = World::start(&[L::Alpn]).await;
    let got = outcome(&w, w.ports[0], "alpn", "/b/x").await;
    assert_eq!(got, routed("b", "/b/x"));
    // Accepted, not just served from an older version: the LDS version is ACKed.
    w.mesh
        .ads
        .wait_for_ack(LDS, "1", std::time::Duration::from_secs(1))
        .await;
}
