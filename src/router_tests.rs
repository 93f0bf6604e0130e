//! Route matching semantics, checked against Envoy's documented behaviour. Tables are built from
//! protos through `RouteTable::translate`, the public path.

use super::*;

use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::r#type::matcher::v3 as mpb;
use envoy_types::pb::envoy::r#type::v3::Int64Range;
use envoy_types::pb::google::protobuf::BoolValue;
use http::header::{HeaderName, HeaderValue};
use mpb::string_matcher::MatchPattern as MP;
use rpb::header_matcher::HeaderMatchSpecifier as HS;
use rpb::query_parameter_matcher::QueryParameterMatchSpecifier as QS;
use rpb::route_match::PathSpecifier as PS;

// ---------------------------------------------------------------------------------------------
// Builders

fn m(p: PS) -> rpb::RouteMatch {
    rpb::RouteMatch {
        path_specifier: Some(p),
        ..Default::default()
    }
}

fn prefix(p: &str) -> rpb::RouteMatch {
    m(PS::Prefix(p.into()))
}

fn exact(p: &str) -> rpb::RouteMatch {
    m(PS::Path(p.into()))
}

fn regex_path(re: &str) -> rpb::RouteMatch {
    m(PS::SafeRegex(regex(re)))
}

fn separated(p: &str) -> rpb::RouteMatch {
    m(PS::PathSeparatedPrefix(p.into()))
}

fn case_insensitive(mut rm: rpb::RouteMatch) -> rpb::RouteMatch {
    rm.case_sensitive = Some(BoolValue { value: false });
    rm
}

fn regex(re: &str) -> mpb::RegexMatcher {
    mpb::RegexMatcher {
        regex: re.into(),
        engine_type: None,
    }
}

fn sm(p: MP, ignore_case: bool) -> mpb::StringMatcher {
    mpb::StringMatcher {
        match_pattern: Some(p),
        ignore_case,
    }
}

/// A route named `name`; the router's pick is identified by it.
fn named(name: &str, rm: rpb::RouteMatch) -> rpb::Route {
    rpb::Route {
        name: name.into(),
        r#match: Some(rm),
        action: Some(rpb::route::Action::DirectResponse(
            rpb::DirectResponseAction {
                status: 200,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

fn vhost(name: &str, domains: &[&str], routes: Vec<rpb::Route>) -> rpb::VirtualHost {
    rpb::VirtualHost {
        name: name.into(),
        domains: domains.iter().map(|d| d.to_string()).collect(),
        routes,
        ..Default::default()
    }
}

fn table_of(vhosts: Vec<rpb::VirtualHost>) -> RouteTable {
    let rc = rpb::RouteConfiguration {
        name: "rc".into(),
        virtual_hosts: vhosts,
        ..Default::default()
    };
    RouteTable::translate(&rc).unwrap_or_else(|e| panic!("{e}"))
}

/// One catch-all vhost holding `routes`.
fn table(routes: Vec<rpb::Route>) -> RouteTable {
    table_of(vec![vhost("vh", &["*"], routes)])
}

/// A table with one route `r` matching `rm` behind a catch-all vhost.
fn single(rm: rpb::RouteMatch) -> RouteTable {
    table(vec![named("r", rm)])
}

fn hm(name: &str, spec: Option<HS>) -> rpb::HeaderMatcher {
    rpb::HeaderMatcher {
        name: name.into(),
        header_match_specifier: spec,
        ..Default::default()
    }
}

fn inverted(mut h: rpb::HeaderMatcher) -> rpb::HeaderMatcher {
    h.invert_match = true;
    h
}

fn missing_as_empty(mut h: rpb::HeaderMatcher) -> rpb::HeaderMatcher {
    h.treat_missing_header_as_empty = true;
    h
}

fn str_exact(v: &str) -> Option<HS> {
    Some(HS::StringMatch(sm(MP::Exact(v.into()), false)))
}

/// A table whose only route needs prefix "/" and the header matcher `h`.
fn with_header(h: rpb::HeaderMatcher) -> RouteTable {
    let mut rm = prefix("/");
    rm.headers.push(h);
    single(rm)
}

fn with_query(params: Vec<(&str, Option<QS>)>) -> RouteTable {
    let mut rm = prefix("/");
    for (name, spec) in params {
        rm.query_parameters.push(rpb::QueryParameterMatcher {
            name: name.into(),
            query_parameter_match_specifier: spec,
        });
    }
    single(rm)
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn view<'a>(host: &'a str, path: &'a str, headers: &'a HeaderMap) -> RequestView<'a> {
    RequestView {
        host,
        authority: host,
        path,
        method: "GET",
        scheme: "http",
        headers,
    }
}

/// The name of the route picked for `path` on host `example.com` with `hdrs`.
fn pick<'t>(t: &'t RouteTable, path: &str, hdrs: &HeaderMap) -> Option<&'t str> {
    route(t, &view("example.com", path, hdrs)).map(|(_, r)| &*r.name)
}

fn hits(t: &RouteTable, path: &str) -> bool {
    pick(t, path, &HeaderMap::new()).is_some()
}

fn hits_with(t: &RouteTable, path: &str, hdrs: &[(&str, &str)]) -> bool {
    pick(t, path, &headers(hdrs)).is_some()
}

// ---------------------------------------------------------------------------------------------
// Virtual host and route order

#[test]
fn vhost_is_picked_by_host_then_first_matching_route() {
    let t = table_of(vec![
        vhost(
            "a",
            &["a.com"],
            vec![named("a-api", prefix("/api")), named("a-all", prefix("/"))],
        ),
        vhost("b", &["*.b.com"], vec![named("b-all", prefix("/"))]),
    ]);
    let h = HeaderMap::new();
    let picked = |host: &str, path: &str| {
        route(&t, &view(host, path, &h)).map(|(v, r)| (v.name.as_str(), &*r.name))
    };
    assert_eq!(picked("a.com", "/api/x"), Some(("a", "a-api")));
    assert_eq!(picked("a.com", "/other"), Some(("a", "a-all")));
    assert_eq!(picked("x.b.com", "/api"), Some(("b", "b-all")));
    assert_eq!(picked("c.com", "/"), None);
}

#[test]
fn first_match_wins_even_if_a_later_route_is_more_specific() {
    let t = table(vec![
        named("broad", prefix("/")),
        named("narrow", exact("/exact")),
    ]);
    assert_eq!(pick(&t, "/exact", &HeaderMap::new()), Some("broad"));
}

#[test]
fn no_route_when_nothing_matches_in_the_vhost() {
    let t = table(vec![named("r", prefix("/api"))]);
    assert_eq!(pick(&t, "/", &HeaderMap::new()), None);
}

// ---------------------------------------------------------------------------------------------
// Path matching

#[test]
fn prefix_match() {
    let t = single(prefix("/api"));
    for p in ["/api", "/api/", "/api/v1", "/apix", "/api?x=1"] {
        assert!(hits(&t, p), "{p}");
    }
    for p in ["/ap", "/API", "/", "/v1/api"] {
        assert!(!hits(&t, p), "{p}");
    }
    assert!(hits(&single(prefix("")), "/anything"));
}

#[test]
fn prefix_is_matched_against_the_path_without_query() {
    // A prefix containing '?' can never match: the query string is stripped first.
    let t = single(prefix("/a?b"));
    assert!(!hits(&t, "/a?b=1"));
}

#[test]
fn exact_path_match_ignores_query_and_fragment() {
    let t = single(exact("/a/b"));
    for p in ["/a/b", "/a/b?x=1", "/a/b?", "/a/b#frag"] {
        assert!(hits(&t, p), "{p}");
    }
    for p in ["/a/b/", "/a/bc", "/a", "/A/b", "/a/b/?x"] {
        assert!(!hits(&t, p), "{p}");
    }
}

#[test]
fn regex_path_is_a_full_match_on_the_path_without_query() {
    let t = single(regex_path("/v[0-9]+"));
    for p in ["/v1", "/v12?x=/v", "/v3#frag"] {
        assert!(hits(&t, p), "{p}");
    }
    for p in ["/v", "/v1/users", "x/v1", "/V1"] {
        assert!(!hits(&t, p), "{p}");
    }
}

#[test]
fn path_separated_prefix_matches_whole_segments() {
    let t = single(separated("/api"));
    for p in ["/api", "/api/", "/api/v1", "/api?x=1", "/api#f"] {
        assert!(hits(&t, p), "{p}");
    }
    for p in ["/apix", "/ap", "/API", "/api-v1"] {
        assert!(!hits(&t, p), "{p}");
    }
}

#[test]
fn case_insensitive_prefix_exact_and_separated_prefix() {
    let t = single(case_insensitive(prefix("/API")));
    for p in ["/api", "/Api/x", "/APIS"] {
        assert!(hits(&t, p), "{p}");
    }
    assert!(!hits(&t, "/ap"));

    let t = single(case_insensitive(exact("/Foo/Bar")));
    assert!(hits(&t, "/foo/bar"));
    assert!(hits(&t, "/FOO/BAR?q=1"));
    assert!(!hits(&t, "/foo/bar/"));

    let t = single(case_insensitive(separated("/Api")));
    assert!(hits(&t, "/API/x"));
    assert!(hits(&t, "/api"));
    assert!(!hits(&t, "/apix"));
}

#[test]
fn case_sensitive_false_does_not_apply_to_regex() {
    let t = single(case_insensitive(regex_path("/abc")));
    assert!(hits(&t, "/abc"));
    assert!(!hits(&t, "/ABC"));
}

#[test]
fn route_matches_uses_the_path_it_is_given() {
    let t = single(exact("/a"));
    let r = &t.vhosts[0].routes[0];
    let h = HeaderMap::new();
    let req = view("example.com", "/ignored?x", &h);
    assert!(route_matches(r, &req, "/a"));
    assert!(!route_matches(r, &req, "/b"));
}

#[test]
fn request_view_splits_path_query_and_fragment() {
    let h = HeaderMap::new();
    let v = view("h", "/a/b?x=1&y#frag", &h);
    assert_eq!(v.path_only(), "/a/b");
    assert_eq!(v.query(), Some("x=1&y"));
    let v = view("h", "/a#frag", &h);
    assert_eq!(v.path_only(), "/a");
    assert_eq!(v.query(), None);
    let v = view("h", "/a?", &h);
    assert_eq!(v.path_only(), "/a");
    assert_eq!(v.query(), Some(""));
}

// ---------------------------------------------------------------------------------------------
// gRPC

fn grpc_table() -> RouteTable {
    let mut rm = prefix("/");
    rm.grpc = Some(Default::default());
    single(rm)
}

#[test]
fn grpc_route_needs_a_grpc_content_type() {
    let t = grpc_table();
    assert!(hits_with(
        &t,
        "/pkg.Svc/M",
        &[("content-type", "application/grpc")]
    ));
    assert!(hits_with(
        &t,
        "/pkg.Svc/M",
        &[("content-type", "application/grpc+proto")]
    ));
    assert!(!hits_with(
        &t,
        "/pkg.Svc/M",
        &[("content-type", "application/json")]
    ));
    assert!(!hits(&t, "/pkg.Svc/M"));
}

#[test]
fn grpc_web_is_not_grpc() {
    let t = grpc_table();
    for ct in [
        "application/grpc-web",
        "application/grpc-web-text",
        "application/grpcx",
    ] {
        assert!(
            !hits_with(&t, "/pkg.Svc/M", &[("content-type", ct)]),
            "{ct}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Header matchers

#[test]
fn string_header_match_and_missing_header() {
    let t = with_header(hm("x-env", str_exact("prod")));
    assert!(hits_with(&t, "/", &[("x-env", "prod")]));
    assert!(!hits_with(&t, "/", &[("x-env", "dev")]));
    assert!(!hits(&t, "/"));
}

#[test]
fn header_names_are_case_insensitive() {
    let t = with_header(hm("X-Env", str_exact("prod")));
    assert!(hits_with(&t, "/", &[("x-env", "prod")]));
}

#[test]
fn header_values_are_case_sensitive_unless_ignore_case() {
    let t = with_header(hm("x-env", str_exact("Prod")));
    assert!(!hits_with(&t, "/", &[("x-env", "prod")]));
    let t = with_header(hm(
        "x-env",
        Some(HS::StringMatch(sm(MP::Exact("Prod".into()), true))),
    ));
    assert!(hits_with(&t, "/", &[("x-env", "PROD")]));
}

#[test]
fn inverted_header_match() {
    let t = with_header(inverted(hm("x-env", str_exact("prod"))));
    assert!(hits_with(&t, "/", &[("x-env", "dev")]));
    assert!(!hits_with(&t, "/", &[("x-env", "prod")]));
    // A missing header is not matched by an inverted value matcher (Envoy ignores the rule).
    assert!(!hits(&t, "/"));
}

#[test]
fn present_match() {
    let t = with_header(hm("x-a", Some(HS::PresentMatch(true))));
    assert!(hits_with(&t, "/", &[("x-a", "")]));
    assert!(hits_with(&t, "/", &[("x-a", "1")]));
    assert!(!hits(&t, "/"));
}

#[test]
fn no_specifier_means_present() {
    let t = with_header(hm("x-a", None));
    assert!(hits_with(&t, "/", &[("x-a", "whatever")]));
    assert!(!hits(&t, "/"));
}

#[test]
fn present_match_false_means_absent() {
    let t = with_header(hm("x-a", Some(HS::PresentMatch(false))));
    assert!(hits(&t, "/"));
    assert!(!hits_with(&t, "/", &[("x-a", "1")]));
}

#[test]
fn inverted_present_matches() {
    let t = with_header(inverted(hm("x-a", Some(HS::PresentMatch(true)))));
    assert!(hits(&t, "/"));
    assert!(!hits_with(&t, "/", &[("x-a", "1")]));
    let t = with_header(inverted(hm("x-a", Some(HS::PresentMatch(false)))));
    assert!(!hits(&t, "/"));
    assert!(hits_with(&t, "/", &[("x-a", "1")]));
}

#[test]
fn treat_missing_header_as_empty() {
    // Envoy's doc example "header3" (a regex matching only the empty string; Envoy refuses an
    // empty regex), header missing.
    let t = with_header(missing_as_empty(hm(
        "x-a",
        Some(HS::StringMatch(sm(MP::SafeRegex(regex("^$")), false))),
    )));
    assert!(hits(&t, "/"));
    assert!(hits_with(&t, "/", &[("x-a", "")]));
    assert!(!hits_with(&t, "/", &[("x-a", "v")]));
    // "header4": same without treat_missing_header_as_empty.
    let t = with_header(hm(
        "x-a",
        Some(HS::StringMatch(sm(MP::SafeRegex(regex("^$")), false))),
    ));
    assert!(!hits(&t, "/"));
}

#[test]
fn treat_missing_as_empty_with_inverted_range() {
    // Envoy's doc example "header1": range [0, 10], inverted, missing header treated as empty.
    let range = Some(HS::RangeMatch(Int64Range { start: 0, end: 10 }));
    let t = with_header(missing_as_empty(inverted(hm("x-n", range.clone()))));
    assert!(hits(&t, "/"));
    assert!(!hits_with(&t, "/", &[("x-n", "5")]));
    // "header2": without treat_missing_header_as_empty the rule does not match.
    let t = with_header(inverted(hm("x-n", range)));
    assert!(!hits(&t, "/"));
    assert!(hits_with(&t, "/", &[("x-n", "50")]));
}

#[test]
fn treat_missing_as_empty_with_present_match() {
    let t = with_header(missing_as_empty(hm("x-a", Some(HS::PresentMatch(true)))));
    assert!(hits(&t, "/"));
    let t = with_header(missing_as_empty(hm("x-a", Some(HS::PresentMatch(false)))));
    assert!(!hits(&t, "/"));
}

#[test]
fn treat_missing_as_empty_with_string_exact() {
    let t = with_header(missing_as_empty(hm("x-a", str_exact(""))));
    assert!(hits(&t, "/"));
    let t = with_header(missing_as_empty(hm("x-a", str_exact("v"))));
    assert!(!hits(&t, "/"));
    let t = with_header(missing_as_empty(inverted(hm("x-a", str_exact("v")))));
    assert!(hits(&t, "/"));
}

#[test]
fn range_match_is_half_open_on_integers() {
    let t = with_header(hm(
        "x-n",
        Some(HS::RangeMatch(Int64Range { start: -10, end: 0 })),
    ));
    for v in ["-1", "-10", "-5"] {
        assert!(hits_with(&t, "/", &[("x-n", v)]), "{v}");
    }
    for v in ["0", "-11", "somestring", "10.9", "-1somestring", "", "5"] {
        assert!(!hits_with(&t, "/", &[("x-n", v)]), "{v}");
    }
}

#[test]
fn inverted_range_match() {
    let t = with_header(inverted(hm(
        "x-n",
        Some(HS::RangeMatch(Int64Range { start: -10, end: 0 })),
    )));
    assert!(!hits_with(&t, "/", &[("x-n", "-1")]));
    assert!(hits_with(&t, "/", &[("x-n", "0")]));
    assert!(hits_with(&t, "/", &[("x-n", "abc")]));
}

#[test]
fn legacy_exact_match() {
    #[allow(deprecated)]
    let t = with_header(hm("x-a", Some(HS::ExactMatch("v".into()))));
    assert!(hits_with(&t, "/", &[("x-a", "v")]));
    assert!(!hits_with(&t, "/", &[("x-a", "V")]));
    assert!(!hits_with(&t, "/", &[("x-a", "vv")]));
    assert!(!hits(&t, "/"));
}

#[test]
fn legacy_exact_match_with_empty_value_matches_any_value() {
    #[allow(deprecated)]
    let t = with_header(hm("x-a", Some(HS::ExactMatch(String::new()))));
    assert!(hits_with(&t, "/", &[("x-a", "anything")]));
    assert!(hits_with(&t, "/", &[("x-a", "")]));
    assert!(!hits(&t, "/"));
    // ... unlike string_match.exact "", which needs an empty value.
    let t = with_header(hm("x-a", str_exact("")));
    assert!(!hits_with(&t, "/", &[("x-a", "anything")]));
    assert!(hits_with(&t, "/", &[("x-a", "")]));
}

#[test]
fn legacy_prefix_suffix_contains_and_regex() {
    #[allow(deprecated)]
    let cases = [
        (HS::PrefixMatch("ab".into()), "abc", "cab"),
        (HS::SuffixMatch("bc".into()), "abc", "bca"),
        (HS::ContainsMatch("b".into()), "abc", "ac"),
        (HS::SafeRegexMatch(regex("a.c")), "abc", "abcd"),
    ];
    for (spec, yes, no) in cases {
        let t = with_header(hm("x-a", Some(spec)));
        assert!(hits_with(&t, "/", &[("x-a", yes)]), "{yes}");
        assert!(!hits_with(&t, "/", &[("x-a", no)]), "{no}");
    }
}

/// Envoy 1.40, observed (tests/conformance_routing.rs `header_matching`): each header line is
/// matched on its own and the matcher holds when any line does; inversion applies to that result.
#[test]
fn multi_valued_headers_match_line_by_line() {
    let t = with_header(hm("x-a", str_exact("1,2,3")));
    assert!(!hits_with(
        &t,
        "/",
        &[("x-a", "1"), ("x-a", "2"), ("x-a", "3")]
    ));
    let t = with_header(hm("x-a", str_exact("1")));
    assert!(hits_with(&t, "/", &[("x-a", "1"), ("x-a", "2")]));
    assert!(hits_with(&t, "/", &[("x-a", "2"), ("x-a", "1")]));
    let t = with_header(hm(
        "x-n",
        Some(HS::RangeMatch(Int64Range { start: 10, end: 20 })),
    ));
    assert!(hits_with(&t, "/", &[("x-n", "5"), ("x-n", "15")]));
    let mut inverted = hm("x-a", str_exact("a"));
    inverted.invert_match = true;
    let t = with_header(inverted);
    assert!(!hits_with(&t, "/", &[("x-a", "a"), ("x-a", "b")]));
    assert!(hits_with(&t, "/", &[("x-a", "b"), ("x-a", "c")]));
}

#[test]
fn only_the_named_header_lines_count() {
    let t = with_header(hm("x-a", str_exact("4")));
    assert!(hits_with(
        &t,
        "/",
        &[("x-b", "1"), ("x-a", "2"), ("x-b", "4"), ("x-a", "4")]
    ));
    assert!(!hits_with(&t, "/", &[("x-b", "4"), ("x-a", "2")]));
}

#[test]
fn single_header_line_with_commas_is_one_value() {
    let t = with_header(hm("x-a", str_exact("1,2")));
    assert!(hits_with(&t, "/", &[("x-a", "1,2")]));
    let t = with_header(hm("x-a", str_exact("1")));
    assert!(!hits_with(&t, "/", &[("x-a", "1,2")]));
}

#[test]
fn present_and_missing_with_several_lines() {
    let t = with_header(hm("x-a", Some(HS::PresentMatch(true))));
    assert!(hits_with(&t, "/", &[("x-a", "1"), ("x-a", "2")]));
    let t = with_header(hm("x-a", Some(HS::PresentMatch(false))));
    assert!(!hits_with(&t, "/", &[("x-a", "1"), ("x-a", "2")]));
}

#[test]
fn method_pseudo_header() {
    let t = with_header(hm(":method", str_exact("POST")));
    let h = HeaderMap::new();
    let mut req = view("example.com", "/", &h);
    assert!(route(&t, &req).is_none());
    req.method = "POST";
    assert!(route(&t, &req).is_some());
}

#[test]
fn scheme_pseudo_header() {
    let t = with_header(hm(":scheme", str_exact("https")));
    let h = HeaderMap::new();
    let mut req = view("example.com", "/", &h);
    assert!(route(&t, &req).is_none());
    req.scheme = "https";
    assert!(route(&t, &req).is_some());
}

#[test]
fn path_pseudo_header_includes_the_query() {
    let t = with_header(hm(
        ":path",
        Some(HS::StringMatch(sm(MP::Suffix("?debug=1".into()), false))),
    ));
    assert!(hits(&t, "/a?debug=1"));
    assert!(!hits(&t, "/a"));
}

#[test]
fn authority_pseudo_header_and_host_alias() {
    for name in [":authority", "host", "Host"] {
        let t = with_header(hm(name, str_exact("example.com")));
        // The authority comes from the view, not from a `host` entry in the header map.
        assert!(hits_with(&t, "/", &[("host", "other.com")]), "{name}");
        let h = HeaderMap::new();
        assert!(route(&t, &view("other.com", "/", &h)).is_none(), "{name}");
    }
}

#[test]
fn authority_matcher_sees_the_authority_as_received() {
    // Vhost selection uses the normalised host; `:authority` matchers the value as sent.
    let t = with_header(hm(":authority", str_exact("Example.com:8080")));
    let h = HeaderMap::new();
    let mut req = view("example.com", "/", &h);
    assert!(route(&t, &req).is_none());
    req.authority = "Example.com:8080";
    assert!(route(&t, &req).is_some());
}

#[test]
fn pseudo_headers_are_always_present() {
    let t = with_header(hm(":method", Some(HS::PresentMatch(false))));
    assert!(!hits(&t, "/"));
    let t = with_header(hm(":path", Some(HS::PresentMatch(true))));
    assert!(hits(&t, "/"));
}

#[test]
fn every_header_matcher_must_match() {
    let mut rm = prefix("/");
    rm.headers.push(hm("x-a", str_exact("1")));
    rm.headers.push(hm("x-b", Some(HS::PresentMatch(true))));
    let t = single(rm);
    assert!(hits_with(&t, "/", &[("x-a", "1"), ("x-b", "")]));
    assert!(!hits_with(&t, "/", &[("x-a", "1")]));
    assert!(!hits_with(&t, "/", &[("x-b", ""), ("x-a", "2")]));
}

#[test]
fn header_matches_directly() {
    let t = with_header(inverted(hm("x-a", str_exact("1"))));
    let matcher = &t.vhosts[0].routes[0].headers[0];
    let hdrs = headers(&[("x-a", "2")]);
    assert!(header_matches(matcher, &view("h", "/", &hdrs)));
    let hdrs = headers(&[("x-a", "1")]);
    assert!(!header_matches(matcher, &view("h", "/", &hdrs)));
}

#[test]
fn non_utf8_header_values_are_matched_lossily() {
    let t = with_header(hm(
        "x-a",
        Some(HS::StringMatch(sm(MP::Prefix("ab".into()), false))),
    ));
    let mut h = HeaderMap::new();
    h.insert("x-a", HeaderValue::from_bytes(b"ab\xff").unwrap());
    assert!(pick(&t, "/", &h).is_some());
}

// ---------------------------------------------------------------------------------------------
// Query parameter matchers

fn q_exact(v: &str) -> Option<QS> {
    Some(QS::StringMatch(sm(MP::Exact(v.into()), false)))
}

#[test]
fn query_present_match() {
    for spec in [None, Some(QS::PresentMatch(true))] {
        let t = with_query(vec![("debug", spec)]);
        for p in ["/?debug", "/?debug=", "/?debug=1", "/?a=1&debug&b=2"] {
            assert!(hits(&t, p), "{p}");
        }
        for p in ["/", "/?", "/?debugger=1", "/?x=debug", "/debug"] {
            assert!(!hits(&t, p), "{p}");
        }
    }
}

#[test]
fn query_string_match() {
    let t = with_query(vec![("a", q_exact("1"))]);
    assert!(hits(&t, "/?a=1"));
    assert!(hits(&t, "/x?b=2&a=1"));
    assert!(!hits(&t, "/?a=2"));
    assert!(!hits(&t, "/?a"));
    assert!(!hits(&t, "/?A=1"));
    let t = with_query(vec![("a", q_exact(""))]);
    assert!(hits(&t, "/?a"));
    assert!(hits(&t, "/?a="));
    assert!(!hits(&t, "/"));
}

#[test]
fn query_value_keeps_everything_after_the_first_equals() {
    let t = with_query(vec![("a", q_exact("b=c"))]);
    assert!(hits(&t, "/?a=b=c"));
}

#[test]
fn only_the_first_query_value_is_matched() {
    let t = with_query(vec![("a", q_exact("1"))]);
    assert!(hits(&t, "/?a=1&a=2"));
    assert!(!hits(&t, "/?a=2&a=1"));
}

#[test]
fn query_keys_and_values_are_matched_undecoded() {
    // Envoy's route matching uses QueryParamsMulti::parseQueryString (no decoding).
    let t = with_query(vec![("a b", q_exact("x&y"))]);
    assert!(!hits(&t, "/?a%20b=x%26y"));
    let t = with_query(vec![("a%20b", q_exact("x%26y"))]);
    assert!(hits(&t, "/?a%20b=x%26y"));
    let t = with_query(vec![("a", q_exact("A"))]);
    assert!(!hits(&t, "/?%61=A"));
    assert!(!hits(&t, "/?a=%41"));
    let t = with_query(vec![("a", q_exact("x y"))]);
    assert!(!hits(&t, "/?a=x+y"));
    let t = with_query(vec![("a", q_exact("%zz%4"))]);
    assert!(hits(&t, "/?a=%zz%4"));
}

#[test]
fn query_present_match_false_means_absent() {
    let t = with_query(vec![("debug", Some(QS::PresentMatch(false)))]);
    for p in ["/", "/?", "/?other=1", "/?debugger", "/?x=debug"] {
        assert!(hits(&t, p), "{p}");
    }
    for p in ["/?debug", "/?debug=", "/?debug=0", "/?a&debug=1"] {
        assert!(!hits(&t, p), "{p}");
    }
    // Combined with other matchers, all must hold.
    let t = with_query(vec![
        ("a", q_exact("1")),
        ("b", Some(QS::PresentMatch(false))),
    ]);
    assert!(hits(&t, "/?a=1"));
    assert!(!hits(&t, "/?a=1&b"));
    assert!(!hits(&t, "/"));
}

#[test]
fn query_fragment_is_not_part_of_the_value() {
    let t = with_query(vec![("a", q_exact("1"))]);
    assert!(hits(&t, "/?a=1#frag"));
}

#[test]
fn every_query_matcher_must_match() {
    let t = with_query(vec![("a", q_exact("1")), ("b", None)]);
    assert!(hits(&t, "/?b&a=1"));
    assert!(!hits(&t, "/?a=1"));
    assert!(!hits(&t, "/?b=1"));
}

#[test]
fn query_string_matchers_with_ignore_case_and_regex() {
    let t = with_query(vec![(
        "a",
        Some(QS::StringMatch(sm(MP::Prefix("ab".into()), true))),
    )]);
    assert!(hits(&t, "/?a=ABC"));
    let t = with_query(vec![(
        "a",
        Some(QS::StringMatch(sm(MP::SafeRegex(regex("[0-9]+")), false))),
    )]);
    assert!(hits(&t, "/?a=123"));
    assert!(!hits(&t, "/?a=123x"));
}

#[test]
fn first_query_value_semantics() {
    assert_eq!(first_query_value("a=1&b=2", "b"), Some("2"));
    assert_eq!(first_query_value("a&b", "a"), Some(""));
    assert_eq!(first_query_value("a=1&a=2", "a"), Some("1"));
    assert_eq!(first_query_value("%61=%31", "a"), None);
    assert_eq!(first_query_value("a=%31", "a"), Some("%31"));
    assert_eq!(first_query_value("", "a"), None);
    assert_eq!(first_query_value("ab=1", "a"), None);
}

// ---------------------------------------------------------------------------------------------
// Indexed vhosts (16 routes or more) keep first-match semantics

fn filler(n: usize) -> Vec<rpb::Route> {
    (0..n)
        .map(|i| named(&format!("filler{i}"), prefix(&format!("/filler{i}"))))
        .collect()
}

fn indexed(mut routes: Vec<rpb::Route>) -> RouteTable {
    routes.extend(filler(16));
    let t = table(routes);
    assert!(t.vhosts[0].index.is_some(), "vhost should be indexed");
    t
}

/// (path, headers, expected route name)
type IndexCase<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);

#[test]
fn indexed_first_match_across_kinds() {
    let mut ci = prefix("/CASE");
    ci.case_sensitive = Some(BoolValue { value: false });
    let mut needs_header = prefix("/api");
    needs_header
        .headers
        .push(hm("x-beta", Some(HS::PresentMatch(true))));
    let t = indexed(vec![
        named("beta", needs_header),
        named("regex", regex_path("/api/v[0-9]+")),
        named("exact", exact("/api/v1")),
        named("ci", ci),
        named("sep", separated("/api/users")),
        named("api", prefix("/api")),
        named("root-exact", exact("/")),
        named("all", prefix("/")),
    ]);
    let cases: &[IndexCase] = &[
        ("/api/v1", &[("x-beta", "1")], "beta"),
        ("/api/v1", &[], "regex"),
        ("/api/v1?x=1", &[], "regex"),
        ("/api/users/7", &[], "sep"),
        ("/api/users", &[], "sep"),
        ("/api/usersx", &[], "api"),
        ("/case/x", &[], "ci"),
        ("/CaSe", &[], "ci"),
        ("/", &[], "root-exact"),
        ("/?q", &[], "root-exact"),
        ("/filler3", &[], "all"),
        ("/other", &[], "all"),
    ];
    for (path, hdrs, want) in cases {
        assert_eq!(pick(&t, path, &headers(hdrs)), Some(*want), "{path}");
    }
}

#[test]
fn indexed_routes_after_a_catch_all_are_shadowed() {
    let mut routes = filler(16);
    routes.push(named("late", exact("/late")));
    let t = table(routes);
    assert!(t.vhosts[0].index.is_some());
    assert_eq!(pick(&t, "/filler1/x", &HeaderMap::new()), Some("filler1"));
    assert_eq!(pick(&t, "/late", &HeaderMap::new()), Some("late"));
    let mut routes = vec![named("all", prefix(""))];
    routes.extend(filler(16));
    routes.push(named("late", exact("/late")));
    let t = table(routes);
    assert_eq!(pick(&t, "/late", &HeaderMap::new()), Some("all"));
    assert_eq!(pick(&t, "/filler1", &HeaderMap::new()), Some("all"));
}

#[test]
fn indexed_no_match() {
    let t = indexed(vec![named("a", exact("/a"))]);
    assert_eq!(pick(&t, "/b", &HeaderMap::new()), None);
    assert_eq!(pick(&t, "/a/", &HeaderMap::new()), None);
    assert_eq!(pick(&t, "", &HeaderMap::new()), None);
}

#[test]
fn indexed_prefix_with_multibyte_path() {
    let t = indexed(vec![named("e", prefix("/é"))]);
    assert_eq!(pick(&t, "/é/x", &HeaderMap::new()), Some("e"));
    // A path whose byte at the prefix length is inside a character cannot match.
    assert_eq!(pick(&t, "/€", &HeaderMap::new()), None);
}

#[test]
fn indexed_query_and_header_conditions_fall_through() {
    let mut q = prefix("/s");
    q.query_parameters.push(rpb::QueryParameterMatcher {
        name: "v".into(),
        query_parameter_match_specifier: q_exact("2"),
    });
    let t = indexed(vec![named("v2", q), named("s", prefix("/s"))]);
    assert_eq!(pick(&t, "/s?v=2", &HeaderMap::new()), Some("v2"));
    assert_eq!(pick(&t, "/s?v=1", &HeaderMap::new()), Some("s"));
}
