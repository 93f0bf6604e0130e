//! Conformance: routing as a client sees it, case by case, with Envoy as the
//! spec. Each test starts one gateway and runs a table of requests against
//! it; every mismatch of a table is collected and reported together.
//!
//! Requests whose exact bytes matter (paths, fragments, repeated headers,
//! HEAD, chunked bodies) go over a raw HTTP/1.1 connection (`raw_http1`).

mod common;

use std::net::SocketAddr;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher::HeaderMatchSpecifier as Hms, query_parameter_matcher, redirect_action, route,
    route_action, DirectResponseAction, HeaderMatcher, QueryParameterMatcher, RedirectAction,
    RouteAction, RouteMatch, VirtualHost,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    string_matcher::MatchPattern, RegexMatcher, StringMatcher,
};
use envoy_types::pb::envoy::r#type::v3::Int64Range;
use envoy_types::pb::google::protobuf::BoolValue;

const HOST: &str = "conf.example.com";

// ---------------------------------------------------------------------------
// Builders local to this file
// ---------------------------------------------------------------------------

fn sm(p: MatchPattern) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(p),
        ignore_case: false,
    }
}

fn ic(mut m: StringMatcher) -> StringMatcher {
    m.ignore_case = true;
    m
}

fn exact(s: &str) -> StringMatcher {
    sm(MatchPattern::Exact(s.into()))
}

fn prefix_sm(s: &str) -> StringMatcher {
    sm(MatchPattern::Prefix(s.into()))
}

fn suffix_sm(s: &str) -> StringMatcher {
    sm(MatchPattern::Suffix(s.into()))
}

fn contains_sm(s: &str) -> StringMatcher {
    sm(MatchPattern::Contains(s.into()))
}

fn re(r: &str) -> RegexMatcher {
    RegexMatcher {
        regex: r.into(),
        ..Default::default()
    }
}

fn regex_sm(r: &str) -> StringMatcher {
    sm(MatchPattern::SafeRegex(re(r)))
}

fn hm(name: &str, spec: Hms) -> HeaderMatcher {
    HeaderMatcher {
        name: name.into(),
        header_match_specifier: Some(spec),
        ..Default::default()
    }
}

fn hs(name: &str, m: StringMatcher) -> HeaderMatcher {
    hm(name, Hms::StringMatch(m))
}

fn invert(mut h: HeaderMatcher) -> HeaderMatcher {
    h.invert_match = true;
    h
}

fn missing_as_empty(mut h: HeaderMatcher) -> HeaderMatcher {
    h.treat_missing_header_as_empty = true;
    h
}

fn range(start: i64, end: i64) -> Hms {
    Hms::RangeMatch(Int64Range { start, end })
}

fn with_headers(mut m: RouteMatch, headers: Vec<HeaderMatcher>) -> RouteMatch {
    m.headers = headers;
    m
}

fn qs(name: &str, m: StringMatcher) -> QueryParameterMatcher {
    QueryParameterMatcher {
        name: name.into(),
        query_parameter_match_specifier: Some(
            query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(m),
        ),
    }
}

fn qpresent(name: &str, present: bool) -> QueryParameterMatcher {
    QueryParameterMatcher {
        name: name.into(),
        query_parameter_match_specifier: Some(
            query_parameter_matcher::QueryParameterMatchSpecifier::PresentMatch(present),
        ),
    }
}

fn with_query(mut m: RouteMatch, q: Vec<QueryParameterMatcher>) -> RouteMatch {
    m.query_parameters = q;
    m
}

fn case_insensitive(mut m: RouteMatch) -> RouteMatch {
    m.case_sensitive = Some(BoolValue { value: false });
    m
}

fn separated(p: &str) -> RouteMatch {
    RouteMatch {
        path_specifier: Some(
            envoy_types::pb::envoy::config::route::v3::route_match::PathSpecifier::PathSeparatedPrefix(
                p.into(),
            ),
        ),
        ..Default::default()
    }
}

/// A 200 direct response whose body names the route that answered.
fn label(l: &str) -> route::Action {
    direct(200, l)
}

fn direct_with(status: u32, body: Option<data_source::Specifier>) -> route::Action {
    route::Action::DirectResponse(DirectResponseAction {
        status,
        body: body.map(|s| DataSource {
            specifier: Some(s),
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn forward_with(cluster: &str, edit: impl FnOnce(&mut RouteAction)) -> route::Action {
    let mut ra = RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.into())),
        ..Default::default()
    };
    edit(&mut ra);
    route::Action::Route(ra)
}

fn rewrite_prefix(cluster: &str, to: &str) -> route::Action {
    forward_with(cluster, |ra| ra.prefix_rewrite = to.into())
}

fn redirect(edit: impl FnOnce(&mut RedirectAction)) -> route::Action {
    let mut r = RedirectAction::default();
    edit(&mut r);
    route::Action::Redirect(r)
}

fn all_domains(
    name: &str,
    routes: Vec<envoy_types::pb::envoy::config::route::v3::Route>,
) -> VirtualHost {
    vhost(name, &["*"], routes)
}

/// Cluster + endpoint for an `EchoBackend`.
fn echo_backend(snapshot: &mut Snapshot, cluster: &str, addr: SocketAddr) {
    snapshot.clusters.push(eds_cluster(cluster));
    snapshot.endpoints.push(cla(cluster, &[addr]));
}

// ---------------------------------------------------------------------------
// Requests and checking
// ---------------------------------------------------------------------------

/// One request over a fresh raw HTTP/1.1 connection, exactly as written.
async fn raw(
    port: u16,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> RawResp {
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {host}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("content-length: {}\r\n", b.len()));
    }
    req.push_str("connection: close\r\n\r\n");
    let mut bytes = req.into_bytes();
    if let Some(b) = body {
        bytes.extend_from_slice(b);
    }
    raw_http1(port, &bytes, false).await
}

async fn raw_get(port: u16, path: &str, host: &str, headers: &[(&str, &str)]) -> RawResp {
    raw(port, "GET", path, host, headers, None).await
}

/// Waits until GET `path` answers `status` (the config has propagated).
async fn wait_raw(port: u16, path: &str, host: &str, status: u16) {
    eventually(
        &format!("{host}{path} to answer {status}"),
        PROPAGATION,
        || async {
            let r = raw_get(port, path, host, &[]).await;
            if r.status == status {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        },
    )
    .await
}

// ---------------------------------------------------------------------------
// Path matching
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_matching() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "paths",
                &[HOST],
                vec![
                    rt(path("/exact"), label("exact")),
                    rt(case_insensitive(path("/ci-exact")), label("ci-exact")),
                    rt(case_insensitive(prefix("/ci-prefix/")), label("ci-prefix")),
                    rt(regex("/re/[0-9]+"), label("regex")),
                    rt(regex("^/anchored$"), label("anchored")),
                    // case_sensitive has no effect on safe_regex.
                    rt(case_insensitive(regex("/rx/abc")), label("rx")),
                    rt(separated("/api"), label("sep")),
                    // A prefix never sees the query string.
                    rt(prefix("/qp?mode="), label("query-prefix")),
                    // First match in order: the longer prefix below is shadowed.
                    rt(prefix("/over"), label("over")),
                    rt(prefix("/over/long"), label("over-long")),
                    rt(path("/pct/a%20b"), label("pct-encoded")),
                    rt(path("/pct/A"), label("pct-plain")),
                    rt(regex("/pct-re/a b"), label("pct-re-decoded")),
                    rt(prefix("/"), label("fallback")),
                ],
            )],
        )],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/exact", HOST, 200).await;

    let cases: &[(&str, &str)] = &[
        ("/exact", "exact"),
        ("/exact?x=1", "exact"),
        ("/exact?", "exact"),
        ("/exact/", "fallback"),
        ("/exactly", "fallback"),
        ("/EXACT", "fallback"),
        ("/CI-Exact", "ci-exact"),
        ("/ci-exact?Q=1", "ci-exact"),
        ("/ci-exact/x", "fallback"),
        ("/CI-PREFIX/anything", "ci-prefix"),
        ("/ci-prefix/", "ci-prefix"),
        ("/ci-prefix", "fallback"),
        ("/re/123", "regex"),
        ("/re/123?x=y", "regex"),
        ("/re/123/4", "fallback"),
        ("/re/", "fallback"),
        ("/x/re/1", "fallback"),
        ("/anchored", "anchored"),
        ("/anchored?x", "anchored"),
        ("/rx/abc", "rx"),
        ("/RX/ABC", "fallback"),
        ("/api", "sep"),
        ("/api/", "sep"),
        ("/api/x", "sep"),
        ("/api?x=1", "sep"),
        ("/apix", "fallback"),
        ("/API", "fallback"),
        ("/qp?mode=fast", "fallback"),
        ("/qp", "fallback"),
        ("/over/long", "over"),
        ("/overlong", "over"),
        // Paths are matched as received: no percent-decoding.
        ("/pct/a%20b", "pct-encoded"),
        ("/pct/%41", "fallback"),
        ("/pct/A", "pct-plain"),
        ("/pct-re/a%20b", "fallback"),
    ];
    let mut c = Checks::default();
    for (p, want) in cases {
        let r = raw_get(mesh.port, p, HOST, &[]).await;
        c.eq(
            format!("GET {p}"),
            (r.status, r.body_str()),
            (200, want.to_string()),
        );
    }
    // A fragment in the request target is rejected before routing.
    for p in ["/exact#frag", "/api#frag", "/#"] {
        let r = raw_get(mesh.port, p, HOST, &[]).await;
        c.eq(
            format!("GET {p}"),
            (r.status, r.body_str()),
            (400, String::new()),
        );
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// Header matchers
// ---------------------------------------------------------------------------

#[allow(deprecated)]
fn header_routes() -> Vec<envoy_types::pb::envoy::config::route::v3::Route> {
    let h = |id: &str, matchers: Vec<HeaderMatcher>| {
        rt(with_headers(path(&format!("/h/{id}")), matchers), label(id))
    };
    let x = "x-v";
    vec![
        h("exact", vec![hs(x, exact("Abc"))]),
        h("exact-ic", vec![hs(x, ic(exact("Abc")))]),
        h("prefix", vec![hs(x, prefix_sm("ab"))]),
        h("prefix-ic", vec![hs(x, ic(prefix_sm("ab")))]),
        h("suffix", vec![hs(x, suffix_sm("yz"))]),
        h("suffix-ic", vec![hs(x, ic(suffix_sm("yz")))]),
        h("contains", vec![hs(x, contains_sm("mid"))]),
        h("contains-ic", vec![hs(x, ic(contains_sm("mid")))]),
        h("regex", vec![hs(x, regex_sm("v[0-9]+"))]),
        h("legacy-exact", vec![hm(x, Hms::ExactMatch("Abc".into()))]),
        h(
            "legacy-exact-empty",
            vec![hm(x, Hms::ExactMatch(String::new()))],
        ),
        h("legacy-prefix", vec![hm(x, Hms::PrefixMatch("ab".into()))]),
        h("legacy-suffix", vec![hm(x, Hms::SuffixMatch("yz".into()))]),
        h(
            "legacy-contains",
            vec![hm(x, Hms::ContainsMatch("mid".into()))],
        ),
        h(
            "legacy-regex",
            vec![hm(x, Hms::SafeRegexMatch(re("v[0-9]+")))],
        ),
        h("present", vec![hm(x, Hms::PresentMatch(true))]),
        h("absent", vec![hm(x, Hms::PresentMatch(false))]),
        h(
            "no-specifier",
            vec![HeaderMatcher {
                name: x.into(),
                ..Default::default()
            }],
        ),
        h("inv-exact", vec![invert(hs(x, exact("Abc")))]),
        h("inv-prefix", vec![invert(hs(x, prefix_sm("ab")))]),
        h("inv-suffix", vec![invert(hs(x, suffix_sm("yz")))]),
        h("inv-contains", vec![invert(hs(x, contains_sm("mid")))]),
        h("inv-regex", vec![invert(hs(x, regex_sm("v[0-9]+")))]),
        h(
            "inv-legacy-exact",
            vec![invert(hm(x, Hms::ExactMatch("Abc".into())))],
        ),
        h("inv-present", vec![invert(hm(x, Hms::PresentMatch(true)))]),
        h("inv-absent", vec![invert(hm(x, Hms::PresentMatch(false)))]),
        h("inv-range", vec![invert(hm(x, range(10, 20)))]),
        h("missing-empty", vec![missing_as_empty(hs(x, exact("")))]),
        h(
            "missing-empty-inv",
            vec![missing_as_empty(invert(hs(x, exact("x"))))],
        ),
        h(
            "missing-range-inv",
            vec![missing_as_empty(invert(hm(x, range(0, 10))))],
        ),
        h(
            "missing-prefix",
            vec![missing_as_empty(hs(x, prefix_sm("ab")))],
        ),
        h("range", vec![hm(x, range(10, 20))]),
        h("range-neg", vec![hm(x, range(-10, 0))]),
        h("multi", vec![hs(x, exact("a,b"))]),
        h("multi-first", vec![hs(x, exact("a"))]),
        h("multi-second", vec![hs(x, exact("b"))]),
        h("multi-inv", vec![invert(hs(x, exact("a")))]),
        h("multi-regex", vec![hs(x, regex_sm("a,b,c"))]),
        h("method", vec![hs(":method", exact("POST"))]),
        h(
            "authority",
            vec![hs(":authority", exact("Hdr.Example.com:8080"))],
        ),
        h(
            "authority-ic",
            vec![hs(":authority", ic(exact("hdr.example.com")))],
        ),
        h("path", vec![hs(":path", exact("/h/path?q=1"))]),
        h("scheme", vec![hs(":scheme", exact("http"))]),
        h("host-name", vec![hs("host", exact("hdr.example.com"))]),
        h("and", vec![hs("x-a", exact("1")), hs("x-b", exact("2"))]),
        h("name-case", vec![hs("X-Upper-Name", exact("v"))]),
        rt(prefix("/"), label("none")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_matching() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![all_domains("headers", header_routes())],
        )],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/h/present", HOST, 200).await;

    // (route id, method, host, headers, whether that route matches)
    type Case<'a> = (&'a str, &'a str, &'a str, &'a [(&'a str, &'a str)], bool);
    let cases: &[Case] = &[
        ("exact", "GET", HOST, &[("x-v", "Abc")], true),
        ("exact", "GET", HOST, &[("x-v", "abc")], false),
        ("exact", "GET", HOST, &[("x-v", "Abcd")], false),
        ("exact", "GET", HOST, &[], false),
        ("exact-ic", "GET", HOST, &[("x-v", "aBC")], true),
        ("exact-ic", "GET", HOST, &[("x-v", "abcd")], false),
        ("prefix", "GET", HOST, &[("x-v", "abc")], true),
        ("prefix", "GET", HOST, &[("x-v", "ab")], true),
        ("prefix", "GET", HOST, &[("x-v", "Abc")], false),
        ("prefix-ic", "GET", HOST, &[("x-v", "ABC")], true),
        ("prefix-ic", "GET", HOST, &[("x-v", "xab")], false),
        ("suffix", "GET", HOST, &[("x-v", "xyz")], true),
        ("suffix", "GET", HOST, &[("x-v", "xYZ")], false),
        ("suffix-ic", "GET", HOST, &[("x-v", "XYZ")], true),
        ("contains", "GET", HOST, &[("x-v", "amidb")], true),
        ("contains", "GET", HOST, &[("x-v", "aMIDb")], false),
        ("contains-ic", "GET", HOST, &[("x-v", "aMIDb")], true),
        ("contains-ic", "GET", HOST, &[("x-v", "amdb")], false),
        ("regex", "GET", HOST, &[("x-v", "v12")], true),
        ("regex", "GET", HOST, &[("x-v", "v12x")], false),
        ("regex", "GET", HOST, &[("x-v", "xv12")], false),
        ("regex", "GET", HOST, &[("x-v", "V12")], false),
        ("legacy-exact", "GET", HOST, &[("x-v", "Abc")], true),
        ("legacy-exact", "GET", HOST, &[("x-v", "abc")], false),
        (
            "legacy-exact-empty",
            "GET",
            HOST,
            &[("x-v", "anything")],
            true,
        ),
        ("legacy-exact-empty", "GET", HOST, &[("x-v", "")], true),
        ("legacy-exact-empty", "GET", HOST, &[], false),
        ("legacy-prefix", "GET", HOST, &[("x-v", "abc")], true),
        ("legacy-prefix", "GET", HOST, &[("x-v", "xab")], false),
        ("legacy-suffix", "GET", HOST, &[("x-v", "xyz")], true),
        ("legacy-suffix", "GET", HOST, &[("x-v", "yzx")], false),
        ("legacy-contains", "GET", HOST, &[("x-v", "amidb")], true),
        ("legacy-contains", "GET", HOST, &[("x-v", "amdb")], false),
        ("legacy-regex", "GET", HOST, &[("x-v", "v1")], true),
        ("legacy-regex", "GET", HOST, &[("x-v", "v1x")], false),
        ("present", "GET", HOST, &[("x-v", "x")], true),
        ("present", "GET", HOST, &[("x-v", "")], true),
        ("present", "GET", HOST, &[], false),
        ("absent", "GET", HOST, &[], true),
        ("absent", "GET", HOST, &[("x-v", "x")], false),
        ("absent", "GET", HOST, &[("x-v", "")], false),
        ("no-specifier", "GET", HOST, &[("x-v", "x")], true),
        ("no-specifier", "GET", HOST, &[], false),
        ("inv-exact", "GET", HOST, &[("x-v", "Abc")], false),
        ("inv-exact", "GET", HOST, &[("x-v", "zzz")], true),
        ("inv-exact", "GET", HOST, &[], false),
        ("inv-prefix", "GET", HOST, &[("x-v", "abc")], false),
        ("inv-prefix", "GET", HOST, &[("x-v", "zab")], true),
        ("inv-prefix", "GET", HOST, &[], false),
        ("inv-suffix", "GET", HOST, &[("x-v", "xyz")], false),
        ("inv-suffix", "GET", HOST, &[("x-v", "yzx")], true),
        ("inv-contains", "GET", HOST, &[("x-v", "amidb")], false),
        ("inv-contains", "GET", HOST, &[("x-v", "x")], true),
        ("inv-regex", "GET", HOST, &[("x-v", "v1")], false),
        ("inv-regex", "GET", HOST, &[("x-v", "v1x")], true),
        ("inv-regex", "GET", HOST, &[], false),
        ("inv-legacy-exact", "GET", HOST, &[("x-v", "Abc")], false),
        ("inv-legacy-exact", "GET", HOST, &[("x-v", "zzz")], true),
        ("inv-legacy-exact", "GET", HOST, &[], false),
        ("inv-present", "GET", HOST, &[], true),
        ("inv-present", "GET", HOST, &[("x-v", "x")], false),
        ("inv-absent", "GET", HOST, &[], false),
        ("inv-absent", "GET", HOST, &[("x-v", "x")], true),
        ("inv-range", "GET", HOST, &[("x-v", "15")], false),
        ("inv-range", "GET", HOST, &[("x-v", "25")], true),
        ("inv-range", "GET", HOST, &[("x-v", "abc")], true),
        ("inv-range", "GET", HOST, &[], false),
        ("missing-empty", "GET", HOST, &[], true),
        ("missing-empty", "GET", HOST, &[("x-v", "")], true),
        ("missing-empty", "GET", HOST, &[("x-v", "x")], false),
        ("missing-empty-inv", "GET", HOST, &[], true),
        ("missing-empty-inv", "GET", HOST, &[("x-v", "x")], false),
        ("missing-empty-inv", "GET", HOST, &[("x-v", "y")], true),
        ("missing-range-inv", "GET", HOST, &[], true),
        ("missing-range-inv", "GET", HOST, &[("x-v", "5")], false),
        ("missing-prefix", "GET", HOST, &[], false),
        ("range", "GET", HOST, &[("x-v", "10")], true),
        ("range", "GET", HOST, &[("x-v", "19")], true),
        ("range", "GET", HOST, &[("x-v", "015")], true),
        ("range", "GET", HOST, &[("x-v", "+15")], true),
        ("range", "GET", HOST, &[("x-v", "20")], false),
        ("range", "GET", HOST, &[("x-v", "9")], false),
        ("range", "GET", HOST, &[("x-v", "abc")], false),
        ("range", "GET", HOST, &[("x-v", "1.5")], false),
        ("range", "GET", HOST, &[("x-v", "0x10")], false),
        (
            "range",
            "GET",
            HOST,
            &[("x-v", "99999999999999999999")],
            false,
        ),
        ("range", "GET", HOST, &[], false),
        ("range-neg", "GET", HOST, &[("x-v", "-1")], true),
        ("range-neg", "GET", HOST, &[("x-v", "-10")], true),
        ("range-neg", "GET", HOST, &[("x-v", "0")], false),
        // Several lines of one header: each value is matched on its own.
        ("multi", "GET", HOST, &[("x-v", "a"), ("x-v", "b")], false),
        ("multi", "GET", HOST, &[("x-v", "a,b")], true),
        ("multi", "GET", HOST, &[("x-v", "a, b")], false),
        ("multi", "GET", HOST, &[("x-v", "a")], false),
        (
            "multi-first",
            "GET",
            HOST,
            &[("x-v", "a"), ("x-v", "b")],
            true,
        ),
        ("multi-first", "GET", HOST, &[("x-v", "a,b")], false),
        (
            "multi-inv",
            "GET",
            HOST,
            &[("x-v", "a"), ("x-v", "b")],
            false,
        ),
        (
            "multi-inv",
            "GET",
            HOST,
            &[("x-v", "b"), ("x-v", "c")],
            true,
        ),
        ("range", "GET", HOST, &[("x-v", "5"), ("x-v", "15")], true),
        ("multi-first", "GET", HOST, &[("x-v", "a")], true),
        (
            "multi-second",
            "GET",
            HOST,
            &[("x-v", "a"), ("x-v", "b")],
            true,
        ),
        (
            "multi-second",
            "GET",
            HOST,
            &[("x-v", "b"), ("x-v", "a")],
            true,
        ),
        (
            "multi-regex",
            "GET",
            HOST,
            &[("x-v", "a"), ("x-v", "b"), ("x-v", "c")],
            false,
        ),
        ("method", "POST", HOST, &[], true),
        ("method", "GET", HOST, &[], false),
        ("authority", "GET", "Hdr.Example.com:8080", &[], true),
        ("authority", "GET", "hdr.example.com:8080", &[], false),
        ("authority", "GET", "Hdr.Example.com", &[], false),
        ("authority-ic", "GET", "HDR.example.COM", &[], true),
        ("path", "GET", HOST, &[], false),
        ("scheme", "GET", HOST, &[], true),
        // A matcher named "host" sees the Host header (:authority).
        ("host-name", "GET", "hdr.example.com", &[], true),
        ("host-name", "GET", "other.example.com", &[], false),
        ("and", "GET", HOST, &[("x-a", "1"), ("x-b", "2")], true),
        ("and", "GET", HOST, &[("x-a", "1")], false),
        ("and", "GET", HOST, &[("x-b", "2")], false),
        ("and", "GET", HOST, &[("x-a", "1"), ("x-b", "3")], false),
        ("name-case", "GET", HOST, &[("x-upper-name", "v")], true),
    ];
    let mut c = Checks::default();
    for (id, method, host, headers, matches) in cases {
        let p = format!("/h/{id}");
        let r = raw(mesh.port, method, &p, host, headers, None).await;
        let want = if *matches { *id } else { "none" };
        c.eq(
            format!("{method} {p} host {host} {headers:?}"),
            (r.status, r.body_str()),
            (200, want.to_string()),
        );
    }
    // :path includes the query string.
    let r = raw_get(mesh.port, "/h/path?q=1", HOST, &[]).await;
    c.eq(
        "GET /h/path?q=1",
        (r.status, r.body_str()),
        (200, "path".into()),
    );
    c.finish();
}

// ---------------------------------------------------------------------------
// Query parameter matchers
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_parameter_matching() {
    let q = |id: &str, matchers: Vec<QueryParameterMatcher>| {
        rt(with_query(path(&format!("/q/{id}")), matchers), label(id))
    };
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "query",
                &[HOST],
                vec![
                    q("exact", vec![qs("mode", exact("fast"))]),
                    q("exact-ic", vec![qs("mode", ic(exact("fast")))]),
                    q("prefix", vec![qs("ver", prefix_sm("v1"))]),
                    q("suffix", vec![qs("file", suffix_sm(".txt"))]),
                    q("contains", vec![qs("tag", contains_sm("mid"))]),
                    q("regex", vec![qs("id", regex_sm("[0-9]+"))]),
                    q("present", vec![qpresent("debug", true)]),
                    q("empty-value", vec![qs("flag", exact(""))]),
                    q("pct-decoded", vec![qs("name", exact("a b"))]),
                    q("pct-raw", vec![qs("name", exact("a%20b"))]),
                    q("pct-key", vec![qpresent("my key", true)]),
                    q("eq-in-value", vec![qs("v", exact("a=b"))]),
                    q("and", vec![qs("a", exact("1")), qs("b", exact("2"))]),
                    rt(prefix("/"), label("none")),
                ],
            )],
        )],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/q/present?debug", HOST, 200).await;

    let cases: &[(&str, &str, bool)] = &[
        ("exact", "?mode=fast", true),
        ("exact", "?x=1&mode=fast", true),
        ("exact", "?mode=fast&", true),
        ("exact", "?&mode=fast", true),
        ("exact", "?mode=Fast", false),
        ("exact", "?mode=fast2", false),
        ("exact", "?MODE=fast", false),
        ("exact", "", false),
        // A repeated parameter: only its first value counts.
        ("exact", "?mode=fast&mode=slow", true),
        ("exact", "?mode=slow&mode=fast", false),
        ("exact-ic", "?mode=FAST", true),
        ("prefix", "?ver=v1.2", true),
        ("prefix", "?ver=v2", false),
        ("suffix", "?file=a.txt", true),
        ("suffix", "?file=a.txt.gz", false),
        ("contains", "?tag=amidb", true),
        ("contains", "?tag=amdb", false),
        ("regex", "?id=42", true),
        ("regex", "?id=42a", false),
        ("regex", "?id=", false),
        ("present", "?debug", true),
        ("present", "?debug=", true),
        ("present", "?debug=1", true),
        ("present", "?x=debug", false),
        ("present", "?debugx=1", false),
        ("present", "", false),
        ("empty-value", "?flag", true),
        ("empty-value", "?flag=", true),
        ("empty-value", "?flag=1", false),
        ("empty-value", "", false),
        // Values and names are compared as received, without percent-decoding.
        ("pct-decoded", "?name=a%20b", false),
        ("pct-decoded", "?name=a+b", false),
        ("pct-raw", "?name=a%20b", true),
        ("pct-key", "?my%20key=1", false),
        ("eq-in-value", "?v=a=b", true),
        ("and", "?a=1&b=2", true),
        ("and", "?b=2&a=1", true),
        ("and", "?a=1", false),
        ("and", "?a=1&b=3", false),
    ];
    let mut c = Checks::default();
    for (id, query, matches) in cases {
        let p = format!("/q/{id}{query}");
        let r = raw_get(mesh.port, &p, HOST, &[]).await;
        let want = if *matches { *id } else { "none" };
        c.eq(
            format!("GET {p}"),
            (r.status, r.body_str()),
            (200, want.to_string()),
        );
    }
    c.finish();
}

/// `present_match: false` is valid config for Envoy: it matches when the
/// parameter is absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_parameter_present_match_false() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "query",
                &[HOST],
                vec![
                    rt(
                        with_query(path("/q/absent"), vec![qpresent("debug", false)]),
                        label("absent"),
                    ),
                    rt(prefix("/"), label("none")),
                ],
            )],
        )],
        ..Default::default()
    })
    .await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;
    let mut c = Checks::default();
    let cases = [
        ("/q/absent", "absent"),
        ("/q/absent?x=1", "absent"),
        ("/q/absent?debugx=1", "absent"),
        ("/q/absent?debug", "none"),
        ("/q/absent?debug=1", "none"),
        ("/q/absent?x=1&debug=", "none"),
    ];
    for (p, want) in cases {
        let r = raw_get(mesh.port, p, HOST, &[]).await;
        c.eq(
            format!("GET {p}"),
            (r.status, r.body_str()),
            (200, want.into()),
        );
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// Virtual host selection
// ---------------------------------------------------------------------------

fn host_vhosts(catch_all: bool) -> Vec<VirtualHost> {
    let v = |name: &str, domains: &[&str]| vhost(name, domains, vec![rt(prefix("/"), label(name))]);
    let mut out = vec![
        v("exact", &["www.example.com"]),
        v("suffix-short", &["*.example.com"]),
        v("suffix-long", &["*.b.example.com"]),
        v("suffix-nodot", &["*ar.net"]),
        v("prefix-short", &["www.*"]),
        v("prefix-long", &["api.example.*"]),
        v("prefix-api", &["api.*"]),
        v("upper", &["Upper.Example.org"]),
        v("ported", &["ported.example.com:8080"]),
    ];
    if catch_all {
        out.push(v("any", &["*"]));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_host_selection() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(&route_name(port), host_vhosts(false))],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/", "www.example.com", 200).await;

    // (host, status, vhost) with no "*" domain configured.
    let cases: &[(&str, u16, &str)] = &[
        ("www.example.com", 200, "exact"),
        ("WWW.Example.COM", 200, "exact"),
        ("foo.example.com", 200, "suffix-short"),
        ("a.b.c.example.com", 200, "suffix-short"),
        ("x.b.example.com", 200, "suffix-long"),
        ("b.example.com", 200, "suffix-short"),
        ("www.b.example.com", 200, "suffix-long"),
        ("example.com", 404, ""),
        ("bar.net", 200, "suffix-nodot"),
        ("ar.net", 404, ""),
        ("www.other.org", 200, "prefix-short"),
        ("api.example.org", 200, "prefix-long"),
        ("api.other.org", 200, "prefix-api"),
        ("API.Example.Net", 200, "prefix-long"),
        ("upper.example.org", 200, "upper"),
        ("ported.example.com:8080", 200, "ported"),
        ("ported.example.com", 200, "suffix-short"),
        ("ported.example.com:9090", 404, ""),
        // The port is part of the host: only a prefix wildcard still matches.
        ("www.example.com:80", 200, "prefix-short"),
        ("foo.example.com:80", 404, ""),
        ("other.org", 404, ""),
    ];
    let mut c = Checks::default();
    for (host, status, body) in cases {
        let r = raw_get(mesh.port, "/", host, &[]).await;
        c.eq(
            format!("host {host}"),
            (r.status, r.body_str()),
            (*status, body.to_string()),
        );
    }

    // Add "*" and ignore the port.
    let mut rc = route_config(&route_name(mesh.port), host_vhosts(true));
    rc.ignore_port_in_host_matching = true;
    mesh.ads.set_routes("2", &[rc]);
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    mesh.wait_status("/", "other.org", 200).await;
    let cases: &[(&str, &str)] = &[
        ("other.org", "any"),
        ("example.com", "any"),
        ("www.example.com", "exact"),
        ("www.example.com:8080", "exact"),
        ("foo.example.com:1", "suffix-short"),
        ("www.other.org:9", "prefix-short"),
        ("other.org:8080", "any"),
    ];
    for (host, body) in cases {
        let r = raw_get(mesh.port, "/", host, &[]).await;
        c.eq(
            format!("ignore_port_in_host_matching: host {host}"),
            (r.status, r.body_str()),
            (200, body.to_string()),
        );
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// Weighted clusters
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_clusters() {
    let a = Backend::start("w-a").await;
    let b = Backend::start("w-b").await;
    let cb = Backend::start("w-c").await;
    let z = Backend::start("w-zero").await;
    let missing = "outbound|9080|v9|missing.default.svc.cluster.local";
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "weighted",
                    &[HOST],
                    vec![
                        rt(
                            prefix("/split"),
                            weighted(&[("w-a", 50), ("w-b", 30), ("w-c", 20), ("w-zero", 0)]),
                        ),
                        rt(
                            prefix("/half-missing"),
                            weighted(&[("w-a", 50), (missing, 50)]),
                        ),
                        rt(prefix("/all-missing"), weighted(&[(missing, 1)])),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("w-a", &a), ("w-b", &b), ("w-c", &cb), ("w-zero", &z)])
    })
    .await;
    mesh.wait_status("/split", HOST, 200).await;

    const N: usize = 1000;
    let mut counts = std::collections::HashMap::<String, usize>::new();
    for i in 0..N {
        let r = mesh.get("/split", HOST, &[]).await;
        assert_eq!(r.status, 200, "request {i}: {r:?}");
        *counts
            .entry(r.backend().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    let share = |name: &str| counts.get(name).copied().unwrap_or(0) as f64 * 100.0 / N as f64;
    // Farther than 8.5 points has probability at most 6e-8 for each share here (binomial,
    // n = 1000, computed).
    for (name, want) in [("w-a", 50.0), ("w-b", 30.0), ("w-c", 20.0)] {
        let got = share(name);
        assert!(
            (got - want).abs() <= 8.5,
            "{name}: {got}% of {N}, want {want}±8.5 ({counts:?})"
        );
    }
    assert_eq!(
        share("w-zero"),
        0.0,
        "a zero weight is never picked: {counts:?}"
    );

    // A weighted cluster that does not exist answers 503, empty body, each
    // time it is picked.
    let (mut ok, mut unavailable) = (0, 0);
    for i in 0..200 {
        let r = raw_get(mesh.port, "/half-missing", HOST, &[]).await;
        match (r.status, r.body_str().as_str()) {
            (200, "w-a") => ok += 1,
            (503, "") => unavailable += 1,
            _ => panic!("request {i}: {r:?}"),
        }
    }
    assert!(
        ok >= 60 && unavailable >= 60,
        "50/50 split with a missing cluster: {ok} served, {unavailable} 503"
    );
    for _ in 0..5 {
        let r = raw_get(mesh.port, "/all-missing", HOST, &[]).await;
        assert_eq!((r.status, r.body_str().as_str()), (503, ""), "{r:?}");
        assert_eq!(r.header("content-length"), Some("0"), "{r:?}");
    }
}

// ---------------------------------------------------------------------------
// Direct responses
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_responses() {
    use data_source::Specifier as S;
    let binary: Vec<u8> = vec![b'b', b'i', b'n', 0x00, 0x01, 0xfe, 0xff];
    let statuses = [200u32, 201, 204, 301, 302, 404, 503];
    let kinds: Vec<(&str, Option<S>)> = vec![
        ("string", Some(S::InlineString("hello world".into()))),
        ("bytes", Some(S::InlineBytes(binary.clone()))),
        ("empty", Some(S::InlineString(String::new()))),
        ("none", None),
    ];
    let mesh = Mesh::start(|port| {
        let mut routes = Vec::new();
        for s in statuses {
            for (k, body) in &kinds {
                routes.push(rt(
                    path(&format!("/d/{s}/{k}")),
                    direct_with(s, body.clone()),
                ));
            }
        }
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("direct", &[HOST], routes)],
            )],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_status("/d/200/string", HOST, 200).await;

    let mut c = Checks::default();
    for s in statuses {
        for (k, _) in &kinds {
            let p = format!("/d/{s}/{k}");
            // (body, content-type) as sent for this kind, before status rules.
            let (body, ctype): (Vec<u8>, Option<&str>) = match *k {
                "string" => (b"hello world".to_vec(), Some("text/plain")),
                "bytes" => (binary.clone(), Some("text/plain")),
                _ => (Vec::new(), None),
            };
            let r = raw_get(mesh.port, &p, HOST, &[]).await;
            let what = format!("GET {p}");
            c.eq(format!("{what} status"), r.status, s as u16);
            if s == 204 && !body.is_empty() {
                // Envoy writes the configured body and its content-length on
                // a 204 anyway, which no HTTP client can rely on: only the
                // status is checked.
                continue;
            }
            if s == 204 {
                c.eq(
                    format!("{what} content-length"),
                    r.header("content-length"),
                    None,
                );
            } else {
                c.eq(format!("{what} body"), r.body.clone(), body.clone());
                c.eq(
                    format!("{what} content-length"),
                    r.header("content-length").map(str::to_string),
                    Some(body.len().to_string()),
                );
            }
            c.eq(
                format!("{what} content-type"),
                r.header("content-type"),
                ctype,
            );
            c.eq(
                format!("{what} transfer-encoding"),
                r.header("transfer-encoding"),
                None,
            );
            // A 201 or 3xx direct response gets a location: the request's own URL.
            let location = (s == 201 || s / 100 == 3).then(|| format!("http://{HOST}{p}"));
            c.eq(
                format!("{what} location"),
                r.header("location").map(str::to_string),
                location,
            );
            c.eq(format!("{what} server"), r.header("server"), Some("envoy"));

            // HEAD: same headers, no body on the wire.
            let h = raw_head(mesh.port, &p, HOST).await;
            let what = format!("HEAD {p}");
            c.eq(format!("{what} status"), h.status, s as u16);
            c.eq(format!("{what} body"), h.body_str(), String::new());
            // The GET's content-length when there is a body; none at all otherwise.
            let want_len = (!body.is_empty()).then(|| body.len().to_string());
            c.eq(
                format!("{what} content-length"),
                h.header("content-length").map(str::to_string),
                want_len,
            );
            c.eq(
                format!("{what} content-type"),
                h.header("content-type"),
                ctype,
            );
        }
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// Redirects
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects() {
    use redirect_action::{
        PathRewriteSpecifier as P, RedirectResponseCode as Code, SchemeRewriteSpecifier as Sch,
    };
    let codes = [
        (Code::MovedPermanently, 301u16),
        (Code::Found, 302),
        (Code::SeeOther, 303),
        (Code::TemporaryRedirect, 307),
        (Code::PermanentRedirect, 308),
    ];
    let mesh = Mesh::start(|port| {
        let mut routes = vec![
            rt(
                prefix("/r/https-port"),
                redirect(|r| {
                    r.scheme_rewrite_specifier = Some(Sch::HttpsRedirect(true));
                    r.port_redirect = 8443;
                }),
            ),
            rt(
                prefix("/r/https-443"),
                redirect(|r| {
                    r.scheme_rewrite_specifier = Some(Sch::HttpsRedirect(true));
                    r.port_redirect = 443;
                }),
            ),
            rt(
                prefix("/r/https"),
                redirect(|r| {
                    r.scheme_rewrite_specifier = Some(Sch::HttpsRedirect(true));
                }),
            ),
            rt(
                prefix("/r/scheme-ftp"),
                redirect(|r| {
                    r.scheme_rewrite_specifier = Some(Sch::SchemeRedirect("ftp".into()));
                }),
            ),
            rt(
                prefix("/r/scheme-https"),
                redirect(|r| {
                    r.scheme_rewrite_specifier = Some(Sch::SchemeRedirect("https".into()));
                }),
            ),
            rt(
                prefix("/r/host-port"),
                redirect(|r| r.host_redirect = "new.example.com:9000".into()),
            ),
            rt(
                prefix("/r/host"),
                redirect(|r| r.host_redirect = "new.example.com".into()),
            ),
            rt(prefix("/r/port"), redirect(|r| r.port_redirect = 8443)),
            rt(
                prefix("/r/path-query"),
                redirect(|r| {
                    r.path_rewrite_specifier = Some(P::PathRedirect("/new?from=redirect".into()));
                }),
            ),
            rt(
                prefix("/r/path"),
                redirect(|r| {
                    r.path_rewrite_specifier = Some(P::PathRedirect("/new/path".into()));
                }),
            ),
            rt(
                prefix("/r/pre/"),
                redirect(|r| {
                    r.path_rewrite_specifier = Some(P::PrefixRewrite("/moved/".into()));
                }),
            ),
            rt(
                path("/r/exact-pre"),
                redirect(|r| {
                    r.path_rewrite_specifier = Some(P::PrefixRewrite("/ep".into()));
                }),
            ),
            rt(
                separated("/r/sep-pre"),
                redirect(|r| {
                    r.path_rewrite_specifier = Some(P::PrefixRewrite("/sp".into()));
                }),
            ),
            rt(prefix("/r/strip"), redirect(|r| r.strip_query = true)),
            rt(
                prefix("/r/all"),
                redirect(|r| {
                    r.scheme_rewrite_specifier = Some(Sch::HttpsRedirect(true));
                    r.host_redirect = "all.example.com".into();
                    r.port_redirect = 9443;
                    r.path_rewrite_specifier = Some(P::PathRedirect("/final".into()));
                    r.strip_query = true;
                }),
            ),
        ];
        for (code, status) in codes {
            routes.push(rt(
                prefix(&format!("/r/c/{status}")),
                redirect(|r| r.response_code = code as i32),
            ));
        }
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![all_domains("redirects", routes)],
            )],
            ..Default::default()
        }
    })
    .await;
    wait_raw(mesh.port, "/r/path", HOST, 301).await;

    let h = "redir.example.com";
    let h8080 = "redir.example.com:8080";
    let mut cases: Vec<(&str, &str, u16, String)> = vec![
        (
            "/r/https/a?x=1",
            h,
            301,
            format!("https://{h}/r/https/a?x=1"),
        ),
        // A scheme change keeps a non-default port, drops the default one.
        ("/r/https", h8080, 301, format!("https://{h8080}/r/https")),
        (
            "/r/https",
            "redir.example.com:80",
            301,
            format!("https://{h}/r/https"),
        ),
        // The Host is copied as received, case included.
        (
            "/r/https",
            "Redir.Example.com",
            301,
            "https://Redir.Example.com/r/https".into(),
        ),
        (
            "/r/scheme-ftp/x",
            h,
            301,
            format!("ftp://{h}/r/scheme-ftp/x"),
        ),
        (
            "/r/scheme-https",
            "redir.example.com:80",
            301,
            format!("https://{h}/r/scheme-https"),
        ),
        (
            "/r/scheme-https",
            h8080,
            301,
            format!("https://{h8080}/r/scheme-https"),
        ),
        // host_redirect replaces host and port.
        (
            "/r/host/x?y=1",
            h8080,
            301,
            "http://new.example.com/r/host/x?y=1".into(),
        ),
        (
            "/r/host-port",
            h8080,
            301,
            "http://new.example.com:9000/r/host-port".into(),
        ),
        ("/r/port/x", h8080, 301, format!("http://{h}:8443/r/port/x")),
        ("/r/port/x", h, 301, format!("http://{h}:8443/r/port/x")),
        (
            "/r/https-port",
            h,
            301,
            format!("https://{h}:8443/r/https-port"),
        ),
        // An explicit port_redirect is always written, even the default one.
        (
            "/r/https-443",
            h8080,
            301,
            format!("https://{h}:443/r/https-443"),
        ),
        // path_redirect keeps the query unless it brings its own.
        ("/r/path?x=1", h, 301, format!("http://{h}/new/path?x=1")),
        (
            "/r/path-query?x=1",
            h,
            301,
            format!("http://{h}/new?from=redirect"),
        ),
        (
            "/r/pre/a/b?x=1",
            h,
            301,
            format!("http://{h}/moved/a/b?x=1"),
        ),
        ("/r/exact-pre?x=1", h, 301, format!("http://{h}/ep?x=1")),
        ("/r/sep-pre/a?x=1", h, 301, format!("http://{h}/sp/a?x=1")),
        ("/r/strip?x=1&y=2", h, 301, format!("http://{h}/r/strip")),
        (
            "/r/all/x?q=1",
            h8080,
            301,
            "https://all.example.com:9443/final".into(),
        ),
    ];
    for (_, status) in codes {
        let p: &'static str = Box::leak(format!("/r/c/{status}?k=v").into_boxed_str());
        cases.push((p, h, status, format!("http://{h}{p}")));
    }
    let mut c = Checks::default();
    for (p, host, status, location) in &cases {
        let r = raw_get(mesh.port, p, host, &[]).await;
        let what = format!("GET {p} host {host}");
        c.eq(
            format!("{what} status/location"),
            (r.status, r.header("location")),
            (*status, Some(location.as_str())),
        );
        c.eq(format!("{what} body"), r.body_str(), String::new());
        c.eq(
            format!("{what} content-length"),
            r.header("content-length"),
            Some("0"),
        );
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// Route rewrites: what the upstream sees
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_rewrites() {
    let echo = EchoBackend::start("echo").await;
    let mesh = Mesh::start(|port| {
        let c = "echo";
        let mut s = Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "rewrites",
                    &[HOST],
                    vec![
                        rt(prefix("/svc/"), rewrite_prefix(c, "/")),
                        rt(prefix("/svc2"), rewrite_prefix(c, "/")),
                        rt(prefix("/v1"), rewrite_prefix(c, "/v2")),
                        rt(path("/old"), rewrite_prefix(c, "/new")),
                        rt(separated("/sep"), rewrite_prefix(c, "/other")),
                        rt(
                            case_insensitive(prefix("/CI/")),
                            rewrite_prefix(c, "/ci-rw/"),
                        ),
                        rt(
                            prefix("/host/"),
                            forward_with(c, |ra| {
                                ra.host_rewrite_specifier =
                                    Some(route_action::HostRewriteSpecifier::HostRewriteLiteral(
                                        "rewritten.example.com".into(),
                                    ))
                            }),
                        ),
                        rt(
                            prefix("/both/"),
                            forward_with(c, |ra| {
                                ra.prefix_rewrite = "/b/".into();
                                ra.host_rewrite_specifier =
                                    Some(route_action::HostRewriteSpecifier::HostRewriteLiteral(
                                        "both.example.com:8443".into(),
                                    ))
                            }),
                        ),
                        rt(prefix("/"), to_cluster(c)),
                    ],
                )],
            )],
            ..Default::default()
        };
        echo_backend(&mut s, c, echo.addr);
        s
    })
    .await;
    wait_raw(mesh.port, "/plain", HOST, 200).await;

    // (request path, upstream path, upstream Host)
    let cases: &[(&str, &str, &str)] = &[
        ("/svc/a/b?x=1", "/a/b?x=1", HOST),
        ("/svc/", "/", HOST),
        // The prefix is replaced as is: "/svc2" + "/a" becomes "/" + "/a".
        ("/svc2/a", "//a", HOST),
        ("/v1/users", "/v2/users", HOST),
        ("/v1", "/v2", HOST),
        ("/v1x?y", "/v2x?y", HOST),
        // prefix_rewrite on a path match replaces the whole path.
        ("/old", "/new", HOST),
        ("/old?x=1", "/new?x=1", HOST),
        ("/sep", "/other", HOST),
        ("/sep/a/b", "/other/a/b", HOST),
        ("/sep?q=1", "/other?q=1", HOST),
        // Case-insensitive prefix: the matched part is replaced whatever its case.
        ("/ci/x", "/ci-rw/x", HOST),
        ("/Ci/X", "/ci-rw/X", HOST),
        ("/host/x?y=1", "/host/x?y=1", "rewritten.example.com"),
        ("/both/x", "/b/x", "both.example.com:8443"),
        // No rewrite: path and query reach the upstream byte for byte.
        ("/plain/a%20b?q=%2F&r=a+b", "/plain/a%20b?q=%2F&r=a+b", HOST),
        ("/plain/%7Euser/./x/../y", "/plain/%7Euser/./x/../y", HOST),
    ];
    let mut c = Checks::default();
    for (p, want_path, want_host) in cases {
        let r = raw_get(mesh.port, p, HOST, &[]).await;
        c.eq(
            format!("GET {p}: status, upstream path, upstream host"),
            (r.status, r.header("x-echo-path"), r.header("x-echo-host")),
            (200, Some(*want_path), Some(*want_host)),
        );
    }
    // The Host reaches the upstream as the client sent it, case and port included.
    let r = raw_get(mesh.port, "/plain", "Conf.Example.com", &[]).await;
    c.eq(
        "mixed-case Host",
        r.header("x-echo-host"),
        Some("Conf.Example.com"),
    );
    c.finish();
}

// ---------------------------------------------------------------------------
// Methods and bodies
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_and_bodies() {
    let echo = EchoBackend::start("echo").await;
    let mesh = Mesh::start(|port| {
        let mut s = Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "methods",
                    &[HOST],
                    vec![
                        rt(path("/direct"), direct(200, "direct body")),
                        rt(prefix("/"), to_cluster("echo")),
                    ],
                )],
            )],
            ..Default::default()
        };
        echo_backend(&mut s, "echo", echo.addr);
        s
    })
    .await;
    wait_raw(mesh.port, "/echo", HOST, 200).await;
    let mut c = Checks::default();

    // HEAD to a direct response: its headers, no body.
    let h = raw_head(mesh.port, "/direct", HOST).await;
    c.eq(
        "HEAD /direct",
        (
            h.status,
            h.header("content-length"),
            h.header("content-type"),
            h.body_str(),
        ),
        (200, Some("11"), Some("text/plain"), String::new()),
    );
    // HEAD to a backend: forwarded as HEAD, the upstream's headers, no body.
    let h = raw_head(mesh.port, "/echo", HOST).await;
    c.eq(
        "HEAD /echo",
        (
            h.status,
            h.header("x-echo-method"),
            h.header("content-length"),
            h.body_str(),
        ),
        (200, Some("HEAD"), Some("4"), String::new()),
    );

    // A body with content-length reaches the upstream intact.
    let r = raw(mesh.port, "POST", "/echo", HOST, &[], Some(b"hello world")).await;
    c.eq(
        "POST content-length",
        (
            r.status,
            r.header("x-echo-method"),
            r.header("x-echo-body-len"),
            r.header("x-echo-content-length"),
            r.body_str(),
        ),
        (
            200,
            Some("POST"),
            Some("11"),
            Some("11"),
            "hello world".into(),
        ),
    );
    // A larger body.
    let big: Vec<u8> = (0..64 * 1024).map(|i| b'a' + (i % 26) as u8).collect();
    let r = raw(mesh.port, "PUT", "/echo/big", HOST, &[], Some(&big)).await;
    c.eq(
        "PUT 64 KiB",
        (
            r.status,
            r.header("x-echo-method"),
            r.header("x-echo-body-len"),
            r.body == big,
        ),
        (200, Some("PUT"), Some("65536"), true),
    );
    // A chunked body: de-chunked and forwarded whole.
    let chunked = format!(
        "POST /echo/chunked HTTP/1.1\r\nhost: {HOST}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"
    );
    let r = raw_http1(mesh.port, chunked.as_bytes(), false).await;
    c.eq(
        "POST chunked",
        (
            r.status,
            r.header("x-echo-method"),
            r.header("x-echo-body-len"),
            r.header("x-echo-transfer-encoding"),
            r.body_str(),
        ),
        (
            200,
            Some("POST"),
            Some("11"),
            Some("chunked"),
            "hello world".into(),
        ),
    );
    // Other methods are forwarded as they are.
    for m in ["DELETE", "PATCH", "OPTIONS"] {
        let r = raw(mesh.port, m, "/echo/m", HOST, &[], None).await;
        c.eq(
            format!("{m} /echo/m"),
            (r.status, r.header("x-echo-method")),
            (200, Some(m)),
        );
    }
    // A POST to a direct response gets the direct response.
    let r = raw(mesh.port, "POST", "/direct", HOST, &[], Some(b"ignored")).await;
    c.eq(
        "POST /direct",
        (r.status, r.body_str()),
        (200, "direct body".into()),
    );
    c.finish();
}

// ---------------------------------------------------------------------------
// HTTP/2 (h2c prior knowledge) gets the same routing answers as HTTP/1.1
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_same_answers_as_http1() {
    use redirect_action::PathRewriteSpecifier as P;
    const H: &str = "h2.example.com";
    let echo = EchoBackend::start("echo").await;
    let mesh = Mesh::start(|port| {
        let mut rc = route_config(
            &route_name(port),
            vec![vhost(
                "h2",
                &[H],
                vec![
                    rt(with_header(path("/hdr"), "x-v", "1"), label("hdr")),
                    rt(
                        with_query(path("/query"), vec![qs("mode", exact("fast"))]),
                        label("query"),
                    ),
                    rt(path("/direct"), direct(201, "made")),
                    rt(
                        prefix("/redir"),
                        redirect(|r| {
                            r.path_rewrite_specifier = Some(P::PathRedirect("/there".into()))
                        }),
                    ),
                    rt(prefix("/echo/"), rewrite_prefix("echo", "/up/")),
                    rt(regex("/re/[0-9]+"), label("regex")),
                ],
            )],
        );
        rc.ignore_port_in_host_matching = true;
        let mut s = Snapshot {
            routes: vec![rc],
            ..Default::default()
        };
        echo_backend(&mut s, "echo", echo.addr);
        s
    })
    .await;
    let target = SocketAddr::from(([127, 0, 0, 1], mesh.port));
    let build = |h2: bool| {
        let b = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(std::time::Duration::from_secs(5))
            .resolve(H, target);
        let b = if h2 {
            b.http2_prior_knowledge()
        } else {
            b.http1_only()
        };
        b.build().expect("build reqwest client")
    };
    let (h1, h2) = (build(false), build(true));
    let url = |p: &str| format!("http://{H}:{}{p}", mesh.port);
    wait_raw(mesh.port, "/direct", H, 201).await;

    // The h2 client really speaks HTTP/2.
    let r = h2.get(url("/direct")).send().await.expect("h2c request");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);

    let authority = format!("{H}:{}", mesh.port);
    let echo_host = authority.as_str();
    // (method, path, headers, status, body, location, upstream path)
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        u16,
        &'a str,
        Option<String>,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        ("GET", "/hdr", &[("x-v", "1")], 200, "hdr", None, None),
        ("GET", "/hdr", &[("x-v", "2")], 404, "", None, None),
        ("GET", "/query?mode=fast", &[], 200, "query", None, None),
        ("GET", "/query?mode=slow", &[], 404, "", None, None),
        (
            "GET",
            "/direct",
            &[],
            201,
            "made",
            Some(url("/direct")),
            None,
        ),
        (
            "POST",
            "/direct?x",
            &[],
            201,
            "made",
            Some(url("/direct?x")),
            None,
        ),
        (
            "GET",
            "/redir?a=1",
            &[],
            301,
            "",
            Some(format!("http://{authority}/there?a=1")),
            None,
        ),
        (
            "GET",
            "/echo/x?y=1",
            &[],
            200,
            "echo",
            None,
            Some("/up/x?y=1"),
        ),
        ("GET", "/re/42", &[], 200, "regex", None, None),
        ("GET", "/re/42x", &[], 404, "", None, None),
        ("GET", "/nothing", &[], 404, "", None, None),
    ];
    let mut c = Checks::default();
    for (method, p, headers, status, body, location, up_path) in &cases {
        for (proto, client) in [("HTTP/1.1", &h1), ("h2c", &h2)] {
            let r = send_request(client, method, &url(p), None, headers, None).await;
            let what = format!("{proto} {method} {p} {headers:?}");
            c.eq(
                format!("{what}: status, body, location"),
                (
                    r.status,
                    r.body.as_str(),
                    r.header("location").map(str::to_string),
                ),
                (*status, *body, location.clone()),
            );
            c.eq(
                format!("{what}: upstream path"),
                r.header("x-echo-path"),
                *up_path,
            );
            if up_path.is_some() {
                c.eq(
                    format!("{what}: upstream host"),
                    r.header("x-echo-host"),
                    Some(echo_host),
                );
            }
        }
    }
    // A POST body over h2 reaches the HTTP/1.1 upstream.
    let r = send_request(
        &h2,
        "POST",
        &url("/echo/post"),
        None,
        &[],
        Some(b"h2 body".to_vec()),
    )
    .await;
    c.eq(
        "h2c POST body",
        (
            r.status,
            r.header("x-echo-method"),
            r.header("x-echo-body-len"),
            r.body.as_str(),
        ),
        (200, Some("POST"), Some("7"), "h2 body"),
    );
    c.finish();
}

// ---------------------------------------------------------------------------
// Response headers added by the gateway
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_headers() {
    let echo = EchoBackend::start("echo").await;
    let mesh = Mesh::start(|port| {
        let mut s = Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "headers",
                    &[HOST],
                    vec![
                        rt(prefix("/proxied"), to_cluster("echo")),
                        rt(path("/direct"), direct(200, "d")),
                        rt(path("/direct-empty"), direct_with(200, None)),
                        rt(
                            prefix("/redirect"),
                            redirect(|r| r.host_redirect = "x.example.com".into()),
                        ),
                        rt(prefix("/missing"), to_cluster("no-such-cluster")),
                    ],
                )],
            )],
            ..Default::default()
        };
        echo_backend(&mut s, "echo", echo.addr);
        s
    })
    .await;
    wait_raw(mesh.port, "/proxied", HOST, 200).await;

    let mut c = Checks::default();
    // Proxied: the upstream's server header is overwritten; upstream time added.
    let r = raw_get(mesh.port, "/proxied", HOST, &[]).await;
    c.eq("proxied status", r.status, 200);
    c.eq("proxied server", r.header("server"), Some("envoy"));
    let t = r.header("x-envoy-upstream-service-time");
    c.ok(
        "proxied x-envoy-upstream-service-time is whole milliseconds",
        t.is_some_and(|t| t.parse::<u64>().is_ok()),
        t,
    );
    c.ok("proxied date", r.header("date").is_some(), &r.headers);

    // Local replies: (path, host, status, content-length)
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/direct", HOST, 200, "1"),
        ("/direct-empty", HOST, 200, "0"),
        ("/redirect", HOST, 301, "0"),
        ("/missing", HOST, 503, "0"),
        ("/no-route", HOST, 404, "0"),
        ("/", "unknown.example.com", 404, "0"),
    ];
    for (p, host, status, len) in cases {
        let r = raw_get(mesh.port, p, host, &[]).await;
        let what = format!("GET {p} host {host}");
        c.eq(
            format!("{what}: status, content-length, server"),
            (r.status, r.header("content-length"), r.header("server")),
            (*status, Some(*len), Some("envoy")),
        );
        c.eq(
            format!("{what}: x-envoy-upstream-service-time"),
            r.header("x-envoy-upstream-service-time"),
            None,
        );
        c.ok(
            format!("{what}: date"),
            r.header("date").is_some(),
            &r.headers,
        );
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// Route configurations Envoy rejects
// ---------------------------------------------------------------------------

/// `ignore_case` with `safe_regex` is an error for Envoy ("ignore_case has no
/// effect for safe_regex"), in header and query parameter matchers alike: the
/// push is NACKed and the previous routes keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safe_regex_with_ignore_case_is_nacked() {
    let routes = |port: u16, extra: Option<RouteMatch>| {
        let mut rs = vec![rt(path("/ok"), label("v1"))];
        if let Some(m) = extra {
            rs.insert(0, rt(m, label("v2")));
        }
        route_config(&route_name(port), vec![vhost("nack", &[HOST], rs)])
    };
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![routes(port, None)],
        ..Default::default()
    })
    .await;
    wait_raw(mesh.port, "/ok", HOST, 200).await;

    let bad_header = with_headers(path("/ok"), vec![hs("x-v", ic(regex_sm("a")))]);
    let bad_query = with_query(path("/ok"), vec![qs("q", ic(regex_sm("a")))]);
    for (i, (what, m)) in [("header", bad_header), ("query", bad_query)]
        .into_iter()
        .enumerate()
    {
        mesh.ads
            .set_routes(&format!("{}", i + 2), &[routes(mesh.port, Some(m))]);
        eventually(
            &format!("a NACK of the {what} matcher"),
            PROPAGATION,
            || async {
                let nacks = mesh
                    .ads
                    .log()
                    .iter()
                    .filter(|r| r.type_url == RDS && r.is_nack())
                    .count();
                if nacks > i {
                    Ok(())
                } else {
                    Err(format!("{nacks} RDS NACKs"))
                }
            },
        )
        .await;
        let r = raw(mesh.port, "GET", "/ok?q=a", HOST, &[("x-v", "a")], None).await;
        assert_eq!(
            (r.status, r.body_str().as_str()),
            (200, "v1"),
            "{what}: {r:?}"
        );
    }
}

#[tokio::test]
async fn require_tls_redirects_plain_requests_to_https() {
    use envoy_types::pb::envoy::config::route::v3::virtual_host::TlsRequirementType;
    let backend = Backend::start("secure").await;
    let mesh = Mesh::start(|port| {
        let mut all = vhost(
            "all",
            &["all.example", "all.example:8080"],
            vec![rt(prefix("/"), to_cluster("secure"))],
        );
        all.require_tls = TlsRequirementType::All as i32;
        let mut external = vhost(
            "external",
            &["ext.example"],
            vec![rt(prefix("/"), to_cluster("secure"))],
        );
        external.require_tls = TlsRequirementType::ExternalOnly as i32;
        Snapshot {
            routes: vec![route_config(&route_name(port), vec![all, external])],
            ..Default::default()
        }
        .with_backends(&[("secure", &backend)])
    })
    .await;
    // Envoy answers from the virtual host, before any route: 301 to the same host (port
    // kept) and path, query included, no body.
    wait_raw(mesh.port, "/a/b?x=1", "all.example:8080", 301).await;
    let r = raw_get(mesh.port, "/a/b?x=1", "all.example:8080", &[]).await;
    assert_eq!(
        r.header("location"),
        Some("https://all.example:8080/a/b?x=1")
    );
    assert_eq!((r.header("content-length"), r.body.len()), (Some("0"), 0));
    let r = raw(mesh.port, "POST", "/p", "all.example", &[], Some(b"abc")).await;
    assert_eq!(
        (r.status, r.header("location")),
        (301, Some("https://all.example/p"))
    );
    // Without use_remote_address the client's x-forwarded-proto stands.
    let https = [("x-forwarded-proto", "https")];
    let r = raw_get(mesh.port, "/a", "all.example", &https).await;
    assert_eq!((r.status, r.header("x-echo-xfp")), (200, Some("https")));
    // EXTERNAL_ONLY: an external client cannot claim to be internal.
    for claim in [&[][..], &[("x-envoy-internal", "true")][..]] {
        let r = raw_get(mesh.port, "/z", "ext.example", claim).await;
        assert_eq!(
            (r.status, r.header("location")),
            (301, Some("https://ext.example/z"))
        );
    }
    // No virtual host: no redirect.
    assert_eq!(
        raw_get(mesh.port, "/n", "none.example", &[]).await.status,
        404
    );
    // With use_remote_address, the gateway's own view of the connection decides.
    let mut h = hcm(mesh.port);
    h.use_remote_address = Some(BoolValue { value: true });
    mesh.ads.set_listeners("2", &[listener_with(mesh.port, h)]);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually(
        "the client's https no longer trusted",
        PROPAGATION,
        || async {
            match raw_get(mesh.port, "/a", "all.example", &https).await.status {
                301 => Ok(()),
                s => Err(format!("status {s}")),
            }
        },
    )
    .await;
}
