//! Translation of `RouteConfiguration` into a `RouteTable`: rejections name the route config,
//! vhost, route index and field; accepted configs keep what the request path reads.

use super::*;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::r#type::v3::Int64Range;
use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
use mpb::string_matcher::MatchPattern as MP;
use rpb::header_matcher::HeaderMatchSpecifier as HS;
use rpb::query_parameter_matcher::QueryParameterMatchSpecifier as QS;
use rpb::route_action::ClusterSpecifier as CS;
use rpb::route_match::PathSpecifier as PS;

// ---------------------------------------------------------------------------------------------
// Proto builders

fn path_match(p: PS) -> rpb::RouteMatch {
    rpb::RouteMatch {
        path_specifier: Some(p),
        ..Default::default()
    }
}

fn prefix(p: &str) -> rpb::RouteMatch {
    path_match(PS::Prefix(p.into()))
}

fn route_action(spec: CS) -> rpb::route::Action {
    rpb::route::Action::Route(rpb::RouteAction {
        cluster_specifier: Some(spec),
        ..Default::default()
    })
}

fn to(cluster: &str) -> rpb::route::Action {
    route_action(CS::Cluster(cluster.into()))
}

fn route(m: rpb::RouteMatch, action: rpb::route::Action) -> rpb::Route {
    rpb::Route {
        r#match: Some(m),
        action: Some(action),
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

fn config(name: &str, vhosts: Vec<rpb::VirtualHost>) -> rpb::RouteConfiguration {
    rpb::RouteConfiguration {
        name: name.into(),
        virtual_hosts: vhosts,
        ..Default::default()
    }
}

fn regex(re: &str) -> mpb::RegexMatcher {
    mpb::RegexMatcher {
        regex: re.into(),
        engine_type: None,
    }
}

fn sm(p: MP) -> mpb::StringMatcher {
    mpb::StringMatcher {
        match_pattern: Some(p),
        ignore_case: false,
    }
}

fn header(name: &str, spec: Option<HS>) -> rpb::HeaderMatcher {
    rpb::HeaderMatcher {
        name: name.into(),
        header_match_specifier: spec,
        ..Default::default()
    }
}

fn with_header(mut m: rpb::RouteMatch, h: rpb::HeaderMatcher) -> rpb::RouteMatch {
    m.headers.push(h);
    m
}

fn with_query(mut m: rpb::RouteMatch, name: &str, spec: Option<QS>) -> rpb::RouteMatch {
    m.query_parameters.push(rpb::QueryParameterMatcher {
        name: name.into(),
        query_parameter_match_specifier: spec,
    });
    m
}

fn cw(name: &str, weight: Option<u32>) -> rpb::weighted_cluster::ClusterWeight {
    rpb::weighted_cluster::ClusterWeight {
        name: name.into(),
        weight: weight.map(|value| UInt32Value { value }),
        ..Default::default()
    }
}

fn weighted(
    clusters: Vec<rpb::weighted_cluster::ClusterWeight>,
    total: Option<u32>,
) -> rpb::route::Action {
    #[allow(deprecated)]
    let w = rpb::WeightedCluster {
        clusters,
        total_weight: total.map(|value| UInt32Value { value }),
        ..Default::default()
    };
    route_action(CS::WeightedClusters(w))
}

fn direct(status: u32, body: Option<DataSpecifier>) -> rpb::route::Action {
    rpb::route::Action::DirectResponse(rpb::DirectResponseAction {
        status,
        body: body.map(|s| corepb::DataSource {
            specifier: Some(s),
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn redirect(r: rpb::RedirectAction) -> rpb::route::Action {
    rpb::route::Action::Redirect(r)
}

/// Route config 'rc' with vhost 'vh' holding a good route 0 and `r` as route 1.
fn second_route(r: rpb::Route) -> rpb::RouteConfiguration {
    config(
        "rc",
        vec![vhost("vh", &["*"], vec![route(prefix("/ok"), to("c")), r])],
    )
}

fn translate(rc: &rpb::RouteConfiguration) -> RouteTable {
    RouteTable::translate(rc).unwrap_or_else(|e| panic!("unexpected rejection: {e}"))
}

fn translate_one(r: rpb::Route) -> Route {
    let mut t = translate(&second_route(r));
    t.vhosts.remove(0).routes.remove(1)
}

fn rejection(rc: &rpb::RouteConfiguration) -> TranslateError {
    match RouteTable::translate(rc) {
        Ok(t) => panic!("expected a rejection, got {t:?}"),
        Err(e) => e,
    }
}

/// Asserts route 1 of vhost 'vh' in route config 'rc' is rejected, naming `needle`.
#[track_caller]
fn assert_route_rejected(r: rpb::Route, needle: &str) -> String {
    let e = rejection(&second_route(r));
    assert_eq!(e.resource, "route 'rc'");
    let text = e.to_string();
    assert!(
        text.starts_with("route 'rc': vhost 'vh' route 1: "),
        "error does not name config, vhost and route index: {text}"
    );
    assert!(
        text.contains(needle),
        "error {text:?} does not mention {needle:?}"
    );
    text
}

#[track_caller]
fn assert_vhost_rejected(rc: &rpb::RouteConfiguration, vh: &str, needle: &str) {
    let text = rejection(rc).to_string();
    let want = format!("route '{}': vhost '{vh}': ", rc.name);
    assert!(
        text.starts_with(&want),
        "{text:?} does not start with {want:?}"
    );
    assert!(
        text.contains(needle),
        "error {text:?} does not mention {needle:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Domains and virtual host selection

#[test]
fn vhost_without_domains_is_rejected() {
    let rc = config("rc", vec![vhost("vh", &[], vec![])]);
    assert_vhost_rejected(&rc, "vh", "domains must not be empty");
}

#[test]
fn duplicate_domain_in_one_vhost_is_rejected() {
    let rc = config("rc", vec![vhost("vh", &["a.com", "a.com"], vec![])]);
    assert_vhost_rejected(&rc, "vh", "duplicate entry of domain a.com");
}

#[test]
fn duplicate_domain_across_vhosts_is_rejected_case_insensitively() {
    let rc = config(
        "rc",
        vec![
            vhost("one", &["A.com"], vec![]),
            vhost("two", &["a.COM"], vec![]),
        ],
    );
    assert_vhost_rejected(&rc, "two", "duplicate entry of domain a.com");
}

#[test]
fn two_catch_all_vhosts_are_rejected() {
    let rc = config(
        "rc",
        vec![vhost("one", &["*"], vec![]), vhost("two", &["*"], vec![])],
    );
    assert_vhost_rejected(&rc, "two", "duplicate entry of domain *");
}

#[test]
fn duplicate_wildcards_are_rejected() {
    let rc = config(
        "rc",
        vec![
            vhost("one", &["*.a.com"], vec![]),
            vhost("two", &["*.a.com"], vec![]),
        ],
    );
    assert_vhost_rejected(&rc, "two", "duplicate entry of domain *.a.com");
    let rc = config(
        "rc",
        vec![
            vhost("one", &["a.*"], vec![]),
            vhost("two", &["A.*"], vec![]),
        ],
    );
    assert_vhost_rejected(&rc, "two", "duplicate entry of domain a.*");
}

/// Envoy 1.40 accepts these (checked with `envoy --mode validate`): only a leading or trailing
/// `*` is a wildcard, any other `*` is an ordinary character.
#[test]
fn domains_with_several_or_inner_stars_are_accepted_as_envoy_does() {
    for d in ["*.*.com", "**", "*a*", "a.*.*", "a**", "a.*.com"] {
        translate(&config("rc", vec![vhost("vh", &[d], vec![])]));
    }
    let t = translate(&config(
        "rc",
        vec![
            vhost("inner", &["a.*.com"], vec![]),
            vhost("suffix", &["*.*.com"], vec![]),
        ],
    ));
    assert_eq!(t.vhost("a.*.com").map(|v| v.name.as_str()), Some("inner"));
    assert!(t.vhost("a.b.com").is_none());
    assert_eq!(t.vhost("x.*.com").map(|v| v.name.as_str()), Some("suffix"));
}

#[test]
fn first_bad_vhost_is_named() {
    let rc = config(
        "rc",
        vec![
            vhost("good", &["a.com"], vec![route(prefix("/"), to("c"))]),
            vhost("bad", &[], vec![]),
        ],
    );
    assert_vhost_rejected(&rc, "bad", "domains must not be empty");
}

fn selection_table() -> RouteTable {
    translate(&config(
        "rc",
        vec![
            vhost("exact", &["foo.example.com", "Mixed.Example.com"], vec![]),
            vhost("short-suffix", &["*.com"], vec![]),
            vhost("long-suffix", &["*.example.com"], vec![]),
            vhost("dash-suffix", &["*-bar.example.com"], vec![]),
            vhost("short-prefix", &["foo.*"], vec![]),
            vhost("long-prefix", &["foo.example.*"], vec![]),
            vhost("any", &["*"], vec![]),
        ],
    ))
}

fn picked<'t>(t: &'t RouteTable, host: &str) -> Option<&'t str> {
    t.vhost(host).map(|v| v.name.as_str())
}

#[test]
fn exact_domain_beats_every_wildcard() {
    let t = selection_table();
    assert_eq!(picked(&t, "foo.example.com"), Some("exact"));
    // Domains are lowercased at translation; hosts arrive lowercase.
    assert_eq!(picked(&t, "mixed.example.com"), Some("exact"));
}

#[test]
fn longest_suffix_wildcard_wins() {
    let t = selection_table();
    assert_eq!(picked(&t, "bar.example.com"), Some("long-suffix"));
    assert_eq!(picked(&t, "a-bar.example.com"), Some("dash-suffix"));
    assert_eq!(picked(&t, "other.com"), Some("short-suffix"));
}

#[test]
fn suffix_wildcard_beats_longer_prefix_wildcard() {
    let t = selection_table();
    // Matches both `foo.example.*` (longer) and `*.com`: suffixes are tried first.
    assert_eq!(picked(&t, "foo.example.org.com"), Some("short-suffix"));
}

#[test]
fn longest_prefix_wildcard_wins_when_no_suffix_matches() {
    let t = selection_table();
    assert_eq!(picked(&t, "foo.example.org"), Some("long-prefix"));
    assert_eq!(picked(&t, "foo.org"), Some("short-prefix"));
}

#[test]
fn catch_all_is_the_last_resort() {
    let t = selection_table();
    assert_eq!(picked(&t, "unrelated.org"), Some("any"));
    assert_eq!(picked(&t, ""), Some("any"));
}

#[test]
fn wildcard_never_matches_the_empty_string() {
    let t = selection_table();
    // `*.example.com` would need an empty `*`.
    assert_eq!(picked(&t, ".example.com"), Some("short-suffix"));
    // `*.com` with an empty `*`.
    assert_eq!(picked(&t, ".com"), Some("any"));
    // `foo.*` with an empty `*`.
    assert_eq!(picked(&t, "foo."), Some("any"));
}

#[test]
fn no_vhost_without_catch_all() {
    let t = translate(&config("rc", vec![vhost("a", &["a.com"], vec![])]));
    assert!(t.vhost("b.com").is_none());
    assert!(t.vhost("a.com.").is_none());
}

#[test]
fn equal_length_wildcards_keep_config_order() {
    let t = translate(&config(
        "rc",
        vec![
            vhost("first", &["*.aa.com"], vec![]),
            vhost("second", &["*.bb.com"], vec![]),
        ],
    ));
    assert_eq!(picked(&t, "x.aa.com"), Some("first"));
    assert_eq!(picked(&t, "x.bb.com"), Some("second"));
}

#[test]
fn domain_with_port_is_an_exact_domain() {
    let t = translate(&config("rc", vec![vhost("p", &["a.com:8080"], vec![])]));
    assert_eq!(picked(&t, "a.com:8080"), Some("p"));
    assert!(t.vhost("a.com").is_none());
}

#[test]
fn ignore_port_in_host_matching_is_kept() {
    let mut rc = config("rc", vec![vhost("v", &["*"], vec![])]);
    assert!(!translate(&rc).ignore_port);
    rc.ignore_port_in_host_matching = true;
    assert!(translate(&rc).ignore_port);
}

// ---------------------------------------------------------------------------------------------
// Route match rejections

#[test]
fn route_without_match_is_rejected() {
    let r = rpb::Route {
        r#match: None,
        action: Some(to("c")),
        ..Default::default()
    };
    assert_route_rejected(r, "match is required");
}

#[test]
fn match_without_path_specifier_is_rejected() {
    assert_route_rejected(
        route(rpb::RouteMatch::default(), to("c")),
        "one of prefix, path, safe_regex",
    );
}

#[test]
fn path_separated_prefix_with_trailing_slash_or_query_or_fragment_is_rejected() {
    for p in ["/api/", "/", "/a?b", "/a#b"] {
        let text = assert_route_rejected(
            route(path_match(PS::PathSeparatedPrefix(p.into())), to("c")),
            "path_separated_prefix",
        );
        assert!(text.contains(&format!("'{p}'")), "{text}");
    }
}

#[test]
fn empty_path_separated_prefix_is_rejected() {
    assert_route_rejected(
        route(path_match(PS::PathSeparatedPrefix(String::new())), to("c")),
        "path_separated_prefix",
    );
}

#[test]
fn connect_matcher_is_rejected() {
    let m = path_match(PS::ConnectMatcher(rpb::route_match::ConnectMatcher {}));
    assert_route_rejected(route(m, to("c")), "connect_matcher is not supported");
}

#[test]
fn path_match_policy_is_rejected() {
    let m = path_match(PS::PathMatchPolicy(corepb::TypedExtensionConfig {
        name: "uri_template".into(),
        typed_config: None,
    }));
    assert_route_rejected(
        route(m, to("c")),
        "path_match_policy 'uri_template' is not supported",
    );
}

#[test]
fn invalid_path_regex_is_rejected() {
    let text = assert_route_rejected(
        route(path_match(PS::SafeRegex(regex("/(a"))), to("c")),
        "invalid regex '/(a'",
    );
    assert!(!text.contains('\n'), "multi-line regex error: {text:?}");
}

#[test]
fn dynamic_metadata_matcher_is_rejected() {
    let mut m = prefix("/");
    m.dynamic_metadata.push(Default::default());
    assert_route_rejected(route(m, to("c")), "match.dynamic_metadata is not supported");
}

#[test]
fn tls_context_matcher_is_rejected() {
    let mut m = prefix("/");
    m.tls_context = Some(Default::default());
    assert_route_rejected(route(m, to("c")), "match.tls_context is not supported");
}

#[test]
fn cookie_matcher_is_rejected() {
    let mut m = prefix("/");
    m.cookies.push(rpb::CookieMatcher {
        name: "session".into(),
        ..Default::default()
    });
    assert_route_rejected(route(m, to("c")), "match.cookies is not supported");
}

#[test]
fn route_error_names_the_route_index_in_the_right_vhost() {
    let bad = route(rpb::RouteMatch::default(), to("c"));
    let rc = config(
        "my-routes",
        vec![
            vhost("first", &["a.com"], vec![route(prefix("/"), to("c"))]),
            vhost(
                "second",
                &["b.com"],
                vec![
                    route(prefix("/"), to("c")),
                    route(prefix("/x"), to("c")),
                    bad,
                ],
            ),
        ],
    );
    let text = rejection(&rc).to_string();
    assert!(
        text.starts_with("route 'my-routes': vhost 'second' route 2: "),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------------
// Header matcher rejections

#[test]
fn header_matcher_without_name_is_rejected() {
    let m = with_header(prefix("/"), header("", Some(HS::PresentMatch(true))));
    assert_route_rejected(route(m, to("c")), "headers[0] '': name must not be empty");
}

#[test]
fn unknown_pseudo_header_is_rejected() {
    let m = with_header(
        prefix("/"),
        header(":protocol", Some(HS::PresentMatch(true))),
    );
    assert_route_rejected(
        route(m, to("c")),
        "headers[0] ':protocol': unknown pseudo-header",
    );
}

#[test]
fn header_name_no_request_can_carry_never_matches() {
    // Envoy accepts it; such a header is simply never present.
    let m = with_header(prefix("/"), header("x y", Some(HS::PresentMatch(true))));
    let t = translate(&config(
        "rc",
        vec![vhost("vh", &["*"], vec![route(m, to("c"))])],
    ));
    assert!(t.vhosts[0].routes[0].headers[0].name.is_none());
}

#[test]
fn invalid_header_regex_is_rejected() {
    #[allow(deprecated)]
    let spec = HS::SafeRegexMatch(regex("[a-"));
    let m = with_header(prefix("/"), header("x-a", Some(HS::PresentMatch(true))));
    let m = with_header(m, header("x-b", Some(spec)));
    assert_route_rejected(route(m, to("c")), "headers[1] 'x-b': invalid regex '[a-'");
}

#[test]
fn invalid_header_string_matcher_is_rejected() {
    let m = with_header(
        prefix("/"),
        header("x-a", Some(HS::StringMatch(sm(MP::Prefix(String::new()))))),
    );
    assert_route_rejected(
        route(m, to("c")),
        "headers[0] 'x-a': string matcher: prefix, suffix and contains",
    );
}

#[test]
fn empty_legacy_header_prefix_suffix_contains_are_rejected() {
    #[allow(deprecated)]
    let specs = [
        HS::PrefixMatch(String::new()),
        HS::SuffixMatch(String::new()),
        HS::ContainsMatch(String::new()),
    ];
    for spec in specs {
        let m = with_header(prefix("/"), header("x-a", Some(spec)));
        assert_route_rejected(route(m, to("c")), "headers[0] 'x-a'");
    }
}

// ---------------------------------------------------------------------------------------------
// Query parameter matcher rejections

#[test]
fn query_matcher_without_name_is_rejected() {
    let m = with_query(prefix("/"), "", Some(QS::PresentMatch(true)));
    assert_route_rejected(
        route(m, to("c")),
        "query_parameters[0] '': name must not be empty",
    );
}

#[test]
fn query_present_match_false_translates_to_absent() {
    let m = with_query(prefix("/"), "debug", Some(QS::PresentMatch(false)));
    let r = translate_one(route(m, to("c")));
    assert_eq!(r.query[0].name, "debug");
    assert!(matches!(r.query[0].kind, QueryMatch::Absent));
}

#[test]
fn invalid_query_string_matcher_is_rejected() {
    let m = with_query(prefix("/"), "a", None);
    let m = with_query(m, "b", Some(QS::StringMatch(sm(MP::SafeRegex(regex("("))))));
    assert_route_rejected(
        route(m, to("c")),
        "query_parameters[1] 'b': invalid regex '('",
    );
}

// ---------------------------------------------------------------------------------------------
// Action rejections

#[test]
fn route_without_action_is_rejected() {
    let r = rpb::Route {
        r#match: Some(prefix("/")),
        action: None,
        ..Default::default()
    };
    assert_route_rejected(
        r,
        "an action (route, redirect or direct_response) is required",
    );
}

#[test]
fn filter_and_non_forwarding_actions_are_rejected() {
    let actions = [
        rpb::route::Action::FilterAction(Default::default()),
        rpb::route::Action::NonForwardingAction(Default::default()),
    ];
    for a in actions {
        assert_route_rejected(
            route(prefix("/"), a),
            "only route, redirect and direct_response actions are supported",
        );
    }
}

#[test]
fn empty_cluster_name_is_rejected() {
    assert_route_rejected(
        route(prefix("/"), to("")),
        "route.cluster must not be empty",
    );
}

#[test]
fn route_action_without_cluster_is_rejected() {
    let a = rpb::route::Action::Route(rpb::RouteAction::default());
    assert_route_rejected(
        route(prefix("/"), a),
        "one of cluster or weighted_clusters is required",
    );
}

#[test]
fn cluster_header_is_rejected() {
    let a = route_action(CS::ClusterHeader("x-cluster".into()));
    assert_route_rejected(route(prefix("/"), a), "cluster_header is not supported");
}

#[test]
fn cluster_specifier_plugins_are_rejected() {
    let specs = [
        CS::ClusterSpecifierPlugin("plugin".into()),
        CS::InlineClusterSpecifierPlugin(Default::default()),
    ];
    for spec in specs {
        assert_route_rejected(
            route(prefix("/"), route_action(spec)),
            "cluster specifier plugins are not supported",
        );
    }
}

#[test]
fn empty_weighted_clusters_are_rejected() {
    assert_route_rejected(
        route(prefix("/"), weighted(vec![], None)),
        "weighted_clusters.clusters must not be empty",
    );
}

#[test]
fn weighted_cluster_without_name_is_rejected() {
    let mut header_only = cw("", Some(10));
    header_only.cluster_header = "x-cluster".into();
    assert_route_rejected(
        route(
            prefix("/"),
            weighted(vec![cw("a", Some(10)), header_only], None),
        ),
        "weighted_clusters.clusters[1]: name is required",
    );
}

#[test]
fn weighted_total_weight_is_ignored_as_envoy_does() {
    let t = translate(&config(
        "rc",
        vec![vhost(
            "vh",
            &["*"],
            vec![route(
                prefix("/"),
                weighted(vec![cw("a", Some(30)), cw("b", Some(30))], Some(100)),
            )],
        )],
    ));
    match &t.vhosts[0].routes[0].action {
        Action::Forward(Forward {
            target: Target::Weighted(w),
            ..
        }) => assert_eq!(w.total, 60),
        other => panic!("unexpected action {other:?}"),
    }
}

#[test]
fn weighted_clusters_summing_to_zero_are_rejected() {
    assert_route_rejected(
        route(
            prefix("/"),
            weighted(vec![cw("a", Some(0)), cw("b", None)], None),
        ),
        "sum of weights must be greater than 0",
    );
}

#[test]
fn direct_response_status_out_of_range_is_rejected() {
    for status in [0, 100, 199, 600, 999, 70000] {
        let text = assert_route_rejected(
            route(prefix("/"), direct(status, None)),
            "direct_response.status",
        );
        assert!(
            text.contains(&format!("status {status} must be in [200, 600)")),
            "{text}"
        );
    }
}

#[test]
fn direct_response_body_from_file_or_env_is_rejected() {
    for body in [
        DataSpecifier::Filename("/etc/passwd".into()),
        DataSpecifier::EnvironmentVariable("HOME".into()),
    ] {
        assert_route_rejected(
            route(prefix("/"), direct(200, Some(body))),
            "direct_response.body: filename and environment_variable are not supported",
        );
    }
}

#[test]
fn redirect_regex_rewrite_without_a_pattern_is_rejected() {
    let r = rpb::RedirectAction {
        path_rewrite_specifier: Some(rpb::redirect_action::PathRewriteSpecifier::RegexRewrite(
            Default::default(),
        )),
        ..Default::default()
    };
    assert_route_rejected(
        route(prefix("/"), redirect(r)),
        "redirect.regex_rewrite: pattern is required",
    );
}

#[test]
fn redirect_path_rewrite_is_rejected() {
    let r = rpb::RedirectAction {
        path_rewrite_specifier: Some(rpb::redirect_action::PathRewriteSpecifier::PathRewrite(
            "/{x}".into(),
        )),
        ..Default::default()
    };
    assert_route_rejected(
        route(prefix("/"), redirect(r)),
        "redirect.path_rewrite is not supported",
    );
}

// ---------------------------------------------------------------------------------------------
// string_matcher and compile_full_regex

#[test]
fn string_matcher_rejects_empty_prefix_suffix_contains() {
    for p in [
        MP::Prefix(String::new()),
        MP::Suffix(String::new()),
        MP::Contains(String::new()),
    ] {
        let e = string_matcher(&sm(p)).unwrap_err();
        assert_eq!(
            e,
            "string matcher: prefix, suffix and contains must not be empty"
        );
    }
}

#[test]
fn string_matcher_accepts_empty_exact() {
    let m = string_matcher(&sm(MP::Exact(String::new()))).unwrap();
    assert!(m.matches(""));
    assert!(!m.matches("x"));
}

#[test]
fn string_matcher_rejects_custom_and_missing_pattern() {
    let custom = MP::Custom(envoy_types::pb::xds::core::v3::TypedExtensionConfig {
        name: "lua".into(),
        typed_config: None,
    });
    assert_eq!(
        string_matcher(&sm(custom)).unwrap_err(),
        "string matcher: custom matcher 'lua' is not supported"
    );
    let none = mpb::StringMatcher {
        match_pattern: None,
        ignore_case: true,
    };
    assert_eq!(
        string_matcher(&none).unwrap_err(),
        "string matcher: no match pattern set"
    );
}

#[test]
fn string_matcher_rejects_bad_regex() {
    let e = string_matcher(&sm(MP::SafeRegex(regex("a{2")))).unwrap_err();
    assert!(e.starts_with("invalid regex 'a{2': "), "{e}");
}

#[test]
fn string_matcher_semantics() {
    let m = |p: MP, ic: bool| {
        string_matcher(&mpb::StringMatcher {
            match_pattern: Some(p),
            ignore_case: ic,
        })
        .unwrap()
    };
    let exact = m(MP::Exact("AbC".into()), false);
    assert!(exact.matches("AbC") && !exact.matches("abc"));
    let exact_ic = m(MP::Exact("AbC".into()), true);
    assert!(exact_ic.matches("abc") && exact_ic.matches("ABC") && !exact_ic.matches("abcd"));
    let prefix = m(MP::Prefix("Ab".into()), false);
    assert!(prefix.matches("Abc") && !prefix.matches("abc") && !prefix.matches("A"));
    let prefix_ic = m(MP::Prefix("Ab".into()), true);
    assert!(prefix_ic.matches("aBc") && !prefix_ic.matches("a"));
    let suffix = m(MP::Suffix("Yz".into()), false);
    assert!(suffix.matches("xYz") && !suffix.matches("xyz"));
    let suffix_ic = m(MP::Suffix("Yz".into()), true);
    assert!(suffix_ic.matches("XYZ") && !suffix_ic.matches("z"));
    let contains = m(MP::Contains("Mid".into()), false);
    assert!(contains.matches("aMidb") && !contains.matches("amidb"));
    let contains_ic = m(MP::Contains("Mid".into()), true);
    assert!(
        contains_ic.matches("AMIDB") && contains_ic.matches("amidb") && !contains_ic.matches("mi")
    );
    // Regex matches the whole value, case-sensitively.
    let re = m(MP::SafeRegex(regex("a+")), false);
    assert!(re.matches("aaa") && !re.matches("AAA") && !re.matches("baa"));
}

#[test]
fn string_matcher_rejects_ignore_case_on_regex() {
    // Envoy: "ignore_case has no effect for safe_regex."
    let e = string_matcher(&mpb::StringMatcher {
        match_pattern: Some(MP::SafeRegex(regex("a+"))),
        ignore_case: true,
    })
    .unwrap_err();
    assert_eq!(
        e,
        "string matcher: ignore_case has no effect for safe_regex"
    );
}

#[test]
fn compile_full_regex_anchors_the_whole_string() {
    let re = compile_full_regex("a|b").unwrap();
    assert!(re.is_match("a") && re.is_match("b"));
    assert!(!re.is_match("ab") && !re.is_match("xa"));
    let re = compile_full_regex("/api/v[0-9]+").unwrap();
    assert!(re.is_match("/api/v12"));
    assert!(!re.is_match("/api/v12/users"));
}

#[test]
fn compile_full_regex_error_is_one_line_and_names_the_regex() {
    for bad in ["(", "[z-a]", "a)", "\\"] {
        let e = compile_full_regex(bad).unwrap_err();
        assert!(e.starts_with(&format!("invalid regex '{bad}': ")), "{e}");
        assert!(!e.contains('\n'), "{e:?}");
        let reason = e.trim_start_matches(&format!("invalid regex '{bad}': "));
        assert!(!reason.is_empty() && !reason.starts_with("error:"), "{e:?}");
    }
}

#[test]
fn compile_full_regex_rejects_huge_programs() {
    let e = compile_full_regex("(a{1000}){1000}").unwrap_err();
    assert!(e.starts_with("invalid regex '(a{1000}){1000}': "), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Accepted routes

#[test]
fn path_specifiers_translate() {
    assert!(
        matches!(translate_one(route(prefix("/Api"), to("c"))).path, PathMatch::Prefix(p) if p == "/Api")
    );
    assert!(matches!(
        translate_one(route(path_match(PS::Path("/X".into())), to("c"))).path,
        PathMatch::Exact(p) if p == "/X"
    ));
    assert!(matches!(
        translate_one(route(path_match(PS::PathSeparatedPrefix("/Api".into())), to("c"))).path,
        PathMatch::SeparatedPrefix(p) if p == "/Api"
    ));
    match translate_one(route(path_match(PS::SafeRegex(regex("/v[0-9]"))), to("c"))).path {
        PathMatch::Regex(re) => assert!(re.is_match("/v1") && !re.is_match("/v1/x")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn case_insensitive_paths_are_lowercased() {
    let ci = |p: PS| {
        let mut m = path_match(p);
        m.case_sensitive = Some(BoolValue { value: false });
        translate_one(route(m, to("c")))
    };
    let r = ci(PS::Prefix("/API".into()));
    assert!(!r.case_sensitive);
    assert!(matches!(r.path, PathMatch::Prefix(p) if p == "/api"));
    assert!(matches!(ci(PS::Path("/A/B".into())).path, PathMatch::Exact(p) if p == "/a/b"));
    assert!(
        matches!(ci(PS::PathSeparatedPrefix("/Foo".into())).path, PathMatch::SeparatedPrefix(p) if p == "/foo")
    );
    // case_sensitive defaults to true.
    assert!(translate_one(route(prefix("/"), to("c"))).case_sensitive);
}

#[test]
fn grpc_flag_and_route_name_are_kept() {
    let mut m = prefix("/");
    m.grpc = Some(Default::default());
    let mut r = route(m, to("c"));
    r.name = "grpc-only".into();
    let r = translate_one(r);
    assert!(r.grpc_only);
    assert_eq!(&*r.name, "grpc-only");
    assert!(!translate_one(route(prefix("/"), to("c"))).grpc_only);
}

#[test]
fn header_matchers_translate() {
    #[allow(deprecated)]
    let specs = vec![
        header("X-Exact", Some(HS::ExactMatch("v".into()))),
        header("host", Some(HS::PresentMatch(true))),
        header(":authority", None),
        header(
            ":path",
            Some(HS::RangeMatch(Int64Range { start: 1, end: 5 })),
        ),
        header(":METHOD", Some(HS::PrefixMatch("G".into()))),
        header(":scheme", Some(HS::SuffixMatch("s".into()))),
        header("x-c", Some(HS::ContainsMatch("mid".into()))),
        header("x-re", Some(HS::SafeRegexMatch(regex("a+")))),
        header("x-sm", Some(HS::StringMatch(sm(MP::Exact("e".into()))))),
    ];
    let mut m = prefix("/");
    for mut h in specs {
        h.invert_match = h.name == "x-c";
        h.treat_missing_header_as_empty = h.name == "x-re";
        m.headers.push(h);
    }
    let r = translate_one(route(m, to("c")));
    let h = &r.headers;
    assert_eq!(h.len(), 9);
    assert_eq!(
        h[0].name.as_ref().map(|n| n.as_str()).unwrap_or_default(),
        "x-exact"
    );
    assert!(h[0].pseudo.is_none());
    assert!(matches!(&h[0].kind, HeaderMatch::LegacyExact(v) if v == "v"));
    assert_eq!(h[1].pseudo, Some(Pseudo::Authority));
    assert!(matches!(h[1].kind, HeaderMatch::Present(true)));
    // No specifier means "present".
    assert_eq!(h[2].pseudo, Some(Pseudo::Authority));
    assert!(matches!(h[2].kind, HeaderMatch::Present(true)));
    assert_eq!(h[3].pseudo, Some(Pseudo::Path));
    assert!(matches!(h[3].kind, HeaderMatch::Range { start: 1, end: 5 }));
    assert_eq!(h[4].pseudo, Some(Pseudo::Method));
    assert!(matches!(&h[4].kind, HeaderMatch::String(StringMatch::Prefix(p, false)) if p == "G"));
    assert_eq!(h[5].pseudo, Some(Pseudo::Scheme));
    assert!(matches!(&h[5].kind, HeaderMatch::String(StringMatch::Suffix(s, false)) if s == "s"));
    assert!(
        matches!(&h[6].kind, HeaderMatch::String(StringMatch::Contains(s, false)) if s == "mid")
    );
    assert!(h[6].invert && !h[6].treat_missing_as_empty);
    assert!(matches!(
        &h[7].kind,
        HeaderMatch::String(StringMatch::Regex(_))
    ));
    assert!(!h[7].invert && h[7].treat_missing_as_empty);
    assert!(matches!(&h[8].kind, HeaderMatch::String(StringMatch::Exact(e, false)) if e == "e"));
}

#[test]
fn query_matchers_translate() {
    let m = with_query(prefix("/"), "a", None);
    let m = with_query(m, "b", Some(QS::PresentMatch(true)));
    let m = with_query(m, "c", Some(QS::StringMatch(sm(MP::Exact("1".into())))));
    let r = translate_one(route(m, to("c")));
    let names: Vec<_> = r.query.iter().map(|q| q.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert!(matches!(r.query[0].kind, QueryMatch::Present));
    assert!(matches!(r.query[1].kind, QueryMatch::Present));
    assert!(
        matches!(&r.query[2].kind, QueryMatch::String(StringMatch::Exact(v, false)) if v == "1")
    );
}

#[test]
fn forward_action_translates() {
    let a = rpb::route::Action::Route(rpb::RouteAction {
        cluster_specifier: Some(CS::Cluster("backend".into())),
        prefix_rewrite: "/v2".into(),
        host_rewrite_specifier: Some(rpb::route_action::HostRewriteSpecifier::HostRewriteLiteral(
            "internal.local".into(),
        )),
        ..Default::default()
    });
    let Action::Forward(f) = translate_one(route(prefix("/"), a)).action else {
        panic!("not a forward");
    };
    assert!(matches!(&f.target, Target::Cluster(c) if &**c == "backend"));
    assert_eq!(f.prefix_rewrite.as_deref(), Some("/v2"));
    assert_eq!(f.host_rewrite.as_deref(), Some("internal.local"));

    let Action::Forward(f) = translate_one(route(prefix("/"), to("b"))).action else {
        panic!("not a forward");
    };
    assert_eq!(f.prefix_rewrite, None);
    assert_eq!(f.host_rewrite, None);
    assert!(f.host_rewrite_from.is_none());
}

#[test]
fn host_rewrites_from_the_endpoint_a_header_or_the_path() {
    use rpb::route_action::HostRewriteSpecifier as HR;
    let with = |spec: HR| {
        rpb::route::Action::Route(rpb::RouteAction {
            cluster_specifier: Some(CS::Cluster("backend".into())),
            host_rewrite_specifier: Some(spec),
            append_x_forwarded_host: true,
            ..Default::default()
        })
    };
    let forward = |spec: HR| match translate_one(route(prefix("/"), with(spec))).action {
        Action::Forward(f) => f,
        _ => panic!("not a forward"),
    };
    let f = forward(HR::AutoHostRewrite(
        envoy_types::pb::google::protobuf::BoolValue { value: true },
    ));
    assert!(matches!(
        f.host_rewrite_from.as_deref(),
        Some(HostRewrite::Auto)
    ));
    assert!(f.append_x_forwarded_host);
    let f = forward(HR::AutoHostRewrite(
        envoy_types::pb::google::protobuf::BoolValue { value: false },
    ));
    assert!(f.host_rewrite_from.is_none());
    let f = forward(HR::HostRewriteHeader("x-target".into()));
    assert!(
        matches!(f.host_rewrite_from.as_deref(), Some(HostRewrite::Header(h)) if h == "x-target")
    );
    let f = forward(HR::HostRewritePathRegex(mpb::RegexMatchAndSubstitute {
        pattern: Some(mpb::RegexMatcher {
            regex: "^/([^/]+)/.*$".into(),
            ..Default::default()
        }),
        substitution: "\\1.svc".into(),
    }));
    let Some(HostRewrite::PathRegex(rr)) = f.host_rewrite_from.as_deref() else {
        panic!("no path regex");
    };
    assert_eq!(rr.apply("/api/v1"), "api.svc");
    assert_route_rejected(
        route(
            prefix("/"),
            with(HR::HostRewriteHeader("bad header".into())),
        ),
        "host_rewrite_header: invalid header name 'bad header'",
    );
}

#[test]
fn weighted_clusters_translate_and_pick_like_envoy() {
    let a = weighted(
        vec![cw("a", Some(1)), cw("zero", Some(0)), cw("b", Some(3))],
        Some(4),
    );
    let Action::Forward(Forward {
        target: Target::Weighted(w),
        ..
    }) = translate_one(route(prefix("/"), a)).action
    else {
        panic!("not weighted");
    };
    assert_eq!(w.total, 4);
    let picks: Vec<&str> = (0..8).map(|v| &**w.pick(v)).collect();
    // value % total against running sums: [0,1) -> a, [1,4) -> b; a zero weight is never picked.
    assert_eq!(picks, ["a", "b", "b", "b", "a", "b", "b", "b"]);
    assert_eq!(&**w.pick(u64::MAX), "b"); // u64::MAX % 4 == 3
}

#[test]
fn direct_response_translates() {
    let r = translate_one(route(
        prefix("/"),
        direct(503, Some(DataSpecifier::InlineString("down".into()))),
    ));
    assert!(
        matches!(r.action, Action::Direct { status, body: Some(ref b) } if status == 503 && b == "down")
    );
    let r = translate_one(route(
        prefix("/"),
        direct(200, Some(DataSpecifier::InlineBytes(vec![0, 1]))),
    ));
    assert!(
        matches!(r.action, Action::Direct { status, body: Some(ref b) } if status == 200 && b[..] == [0, 1])
    );
    let r = translate_one(route(prefix("/"), direct(599, None)));
    assert!(matches!(r.action, Action::Direct { status, body: None } if status.as_u16() == 599));
}

#[test]
fn redirect_translates() {
    use rpb::redirect_action::{
        PathRewriteSpecifier as PR, RedirectResponseCode as RC, SchemeRewriteSpecifier as SR,
    };
    let r = rpb::RedirectAction {
        host_redirect: "new.example.com".into(),
        port_redirect: 8443,
        response_code: RC::PermanentRedirect as i32,
        strip_query: true,
        scheme_rewrite_specifier: Some(SR::SchemeRedirect("HTTPS".into())),
        path_rewrite_specifier: Some(PR::PathRedirect("/new".into())),
    };
    let Action::Redirect(rd) = translate_one(route(prefix("/"), redirect(r))).action else {
        panic!("not a redirect");
    };
    assert_eq!(rd.scheme.as_deref(), Some("https"));
    assert_eq!(rd.host.as_deref(), Some("new.example.com"));
    assert_eq!(rd.port, Some(8443));
    assert_eq!(rd.path.as_deref(), Some("/new"));
    assert_eq!(rd.prefix_rewrite, None);
    assert!(rd.strip_query);
    assert_eq!(rd.status, StatusCode::PERMANENT_REDIRECT);

    let r = rpb::RedirectAction {
        scheme_rewrite_specifier: Some(SR::HttpsRedirect(true)),
        path_rewrite_specifier: Some(PR::PrefixRewrite("/p".into())),
        ..Default::default()
    };
    let Action::Redirect(rd) = translate_one(route(prefix("/"), redirect(r))).action else {
        panic!("not a redirect");
    };
    assert_eq!(rd.scheme.as_deref(), Some("https"));
    assert_eq!(rd.prefix_rewrite.as_deref(), Some("/p"));
    assert_eq!(
        (rd.host.as_deref(), rd.port, rd.path.as_deref()),
        (None, None, None)
    );
    assert_eq!(rd.status, StatusCode::MOVED_PERMANENTLY);
}

#[test]
fn redirect_response_codes_map() {
    use rpb::redirect_action::RedirectResponseCode as RC;
    let cases = [
        (RC::MovedPermanently, 301),
        (RC::Found, 302),
        (RC::SeeOther, 303),
        (RC::TemporaryRedirect, 307),
        (RC::PermanentRedirect, 308),
    ];
    for (code, want) in cases {
        let r = rpb::RedirectAction {
            response_code: code as i32,
            ..Default::default()
        };
        let Action::Redirect(rd) = translate_one(route(prefix("/"), redirect(r))).action else {
            panic!("not a redirect");
        };
        assert_eq!(rd.status.as_u16(), want);
    }
}

#[test]
fn https_redirect_false_and_empty_scheme_keep_the_scheme() {
    use rpb::redirect_action::SchemeRewriteSpecifier as SR;
    for spec in [SR::HttpsRedirect(false), SR::SchemeRedirect(String::new())] {
        let r = rpb::RedirectAction {
            scheme_rewrite_specifier: Some(spec),
            ..Default::default()
        };
        let Action::Redirect(rd) = translate_one(route(prefix("/"), redirect(r))).action else {
            panic!("not a redirect");
        };
        assert_eq!(rd.scheme, None);
    }
}

#[test]
fn clusters_lists_every_forward_target() {
    let rc = config(
        "rc",
        vec![
            vhost(
                "a",
                &["a.com"],
                vec![
                    route(prefix("/x"), to("one")),
                    route(
                        prefix("/y"),
                        weighted(vec![cw("two", Some(1)), cw("three", Some(1))], None),
                    ),
                    route(prefix("/z"), direct(200, None)),
                ],
            ),
            vhost(
                "b",
                &["b.com"],
                vec![route(prefix("/"), redirect(Default::default()))],
            ),
            vhost("c", &["c.com"], vec![route(prefix("/"), to("one"))]),
        ],
    );
    let t = translate(&rc);
    let names: Vec<&str> = t.clusters().map(|c| &**c).collect();
    assert_eq!(names, ["one", "two", "three", "one"]);
}

#[test]
fn accepted_table_keeps_names_and_order() {
    let t = translate(&config(
        "rc",
        vec![
            vhost(
                "v1",
                &["a.com"],
                vec![route(prefix("/a"), to("c")), route(prefix("/b"), to("c"))],
            ),
            vhost("v2", &["b.com"], vec![]),
        ],
    ));
    assert_eq!(t.name, "rc");
    let names: Vec<&str> = t.vhosts.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["v1", "v2"]);
    assert_eq!(t.vhosts[0].routes.len(), 2);
    assert!(t.vhosts[1].routes.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Route timeout

fn with_timeout(t: Option<(i64, i32)>) -> rpb::route::Action {
    rpb::route::Action::Route(rpb::RouteAction {
        cluster_specifier: Some(CS::Cluster("c".into())),
        timeout: t
            .map(|(seconds, nanos)| envoy_types::pb::google::protobuf::Duration { seconds, nanos }),
        ..Default::default()
    })
}

fn forward_timeout(t: Option<(i64, i32)>) -> Option<std::time::Duration> {
    match translate_one(route(prefix("/"), with_timeout(t))).action {
        Action::Forward(f) => f.timeout,
        other => panic!("{other:?}"),
    }
}

#[test]
fn route_timeout_defaults_to_15s() {
    assert_eq!(
        forward_timeout(None),
        Some(std::time::Duration::from_secs(15))
    );
}

#[test]
fn route_timeout_is_kept_and_zero_disables_it() {
    assert_eq!(
        forward_timeout(Some((2, 500_000_000))),
        Some(std::time::Duration::from_millis(2500))
    );
    assert_eq!(forward_timeout(Some((0, 0))), None);
}

#[test]
fn invalid_route_timeout_is_rejected() {
    assert_route_rejected(
        route(prefix("/"), with_timeout(Some((-1, 0)))),
        "timeout: invalid duration -1s 0ns",
    );
}

// ---------------------------------------------------------------------------------------------
// Route index

#[test]
fn long_route_lists_are_indexed() {
    let routes = |n: usize| {
        (0..n)
            .map(|i| route(prefix(&format!("/r{i}")), to("c")))
            .collect::<Vec<_>>()
    };
    let short = translate(&config("rc", vec![vhost("vh", &["*"], routes(15))]));
    assert!(short.vhosts[0].index.is_none());
    let long = translate(&config("rc", vec![vhost("vh", &["*"], routes(16))]));
    let idx = long.vhosts[0].index.as_ref().expect("indexed");
    assert_eq!(idx.prefixes.len(), 16);
    assert!(idx.exact.is_empty() && idx.always.is_empty());
}

#[test]
fn index_buckets_routes_by_kind() {
    let mut rs: Vec<rpb::Route> = (0..12)
        .map(|i| route(prefix(&format!("/p{i}")), to("c")))
        .collect();
    rs.push(route(path_match(PS::Path("/exact".into())), to("c"))); // 12
    rs.push(route(
        path_match(PS::PathSeparatedPrefix("/sep".into())),
        to("c"),
    )); // 13
    rs.push(route(path_match(PS::SafeRegex(regex("/re.*"))), to("c"))); // 14
    let mut ci = prefix("/CI");
    ci.case_sensitive = Some(BoolValue { value: false });
    rs.push(route(ci, to("c"))); // 15
    rs.push(route(prefix("/p0"), to("c"))); // 16: same prefix as route 0
    let t = translate(&config("rc", vec![vhost("vh", &["*"], rs)]));
    let idx = t.vhosts[0].index.as_ref().expect("indexed");
    assert_eq!(idx.prefixes["/p0"], [0, 16]);
    assert_eq!(idx.prefixes["/sep"], [13]);
    assert_eq!(idx.exact["/exact"], [12]);
    assert_eq!(idx.always, [14, 15]);
    assert_eq!(idx.prefix_lens, [3, 4]);
    // Candidates come in route order and stop at the first accepted one.
    let mut seen = Vec::new();
    let got = idx.candidates("/p0/x", |i| {
        seen.push(i);
        i == 15
    });
    assert_eq!(got, Some(15));
    assert_eq!(seen, [0, 14, 15]);
    assert_eq!(idx.candidates("/exact", |i| i == 12), Some(12));
    assert_eq!(idx.candidates("/none", |_| false), None);
}

// ---------------------------------------------------------------------------------------------
// regex_rewrite

fn regex_rewrite(pattern: &str, substitution: &str) -> Result<RegexRewrite, String> {
    RegexRewrite::translate(&mpb::RegexMatchAndSubstitute {
        pattern: Some(mpb::RegexMatcher {
            regex: pattern.into(),
            ..Default::default()
        }),
        substitution: substitution.into(),
    })
}

#[test]
fn regex_rewrite_substitutes_groups_and_literals_like_re2() {
    let r = regex_rewrite(r"^/service/([^/]+)(/.*)$", r"\2/instance/\1").unwrap();
    assert_eq!(r.apply("/service/foo/v1/api"), "/v1/api/instance/foo");
    assert_eq!(r.apply("/other"), "/other");
    let all = regex_rewrite("o", "0").unwrap();
    assert_eq!(all.apply("/foo/boo"), "/f00/b00");
    let literal = regex_rewrite("^/(a)", r"/$1\\\1").unwrap();
    assert_eq!(literal.apply("/abc"), r"/$1\abc");
    let whole = regex_rewrite("^/x", r"/y\0").unwrap();
    assert_eq!(whole.apply("/x/z"), "/y/x/z");
}

#[test]
fn regex_rewrite_rejections() {
    for (pattern, substitution, want) in [
        ("^/(a)", r"\2", "refers to group 2; the pattern has 1"),
        ("^/a", r"\q", "a backslash must be followed by a digit"),
        ("(", "/", "invalid regex '('"),
        ("", "/", "pattern.regex must not be empty"),
    ] {
        let e = regex_rewrite(pattern, substitution).unwrap_err();
        assert!(e.contains(want), "{pattern} {substitution}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// request_mirror_policies

#[test]
fn mirror_fractions_and_shadow_hosts() {
    use envoy_types::pb::envoy::r#type::v3::fractional_percent::DenominatorType as D;
    use envoy_types::pb::envoy::r#type::v3::FractionalPercent;
    let policy = |numerator, denominator: D| rpb::route_action::RequestMirrorPolicy {
        cluster: "shadow".into(),
        runtime_fraction: Some(corepb::RuntimeFractionalPercent {
            default_value: Some(FractionalPercent {
                numerator,
                denominator: denominator as i32,
            }),
            runtime_key: String::new(),
        }),
        ..Default::default()
    };
    let m = Mirror::translate(&policy(25, D::Hundred)).unwrap();
    assert_eq!(m.per_million, 250_000);
    assert_eq!(
        Mirror::translate(&policy(5, D::TenThousand))
            .unwrap()
            .per_million,
        500
    );
    assert_eq!(
        Mirror::translate(&policy(200, D::Hundred))
            .unwrap()
            .per_million,
        1_000_000
    );
    assert_eq!(m.host("a.example.com"), "a.example.com-shadow");
    assert_eq!(m.host("a.example.com:8080"), "a.example.com-shadow:8080");
    assert_eq!(m.host("[::1]:8080"), "[::1]-shadow:8080");
    let mut raw = policy(1, D::Hundred);
    raw.cluster.clear();
    raw.cluster_header = "x-mirror".into();
    assert!(Mirror::translate(&raw)
        .unwrap_err()
        .contains("cluster_header is not supported"));
    raw.cluster_header.clear();
    assert!(Mirror::translate(&raw)
        .unwrap_err()
        .contains("cluster is required"));
}

// ---------------------------------------------------------------------------------------------
// Custom headers and fault overrides

fn add(key: &str, value: &str) -> corepb::HeaderValueOption {
    corepb::HeaderValueOption {
        header: Some(corepb::HeaderValue {
            key: key.into(),
            value: value.into(),
            ..Default::default()
        }),
        append_action: corepb::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd
            as i32,
        ..Default::default()
    }
}

fn level_values(ops: &[Arc<HeaderOps>]) -> Vec<String> {
    ops.iter()
        .flat_map(|o| o.add.iter())
        .map(|a| match &a.value {
            headers::Format::Static(v) => v.to_str().unwrap_or("?").to_string(),
            headers::Format::Dynamic(_) => "dyn".to_string(),
        })
        .collect()
}

#[test]
fn header_levels_are_precomputed_per_route_in_envoys_order() {
    let mut r = route(prefix("/"), to("c"));
    r.request_headers_to_add = vec![add("x-l", "route")];
    r.response_headers_to_add = vec![add("x-r", "route")];
    let mut vh = vhost("vh", &["*"], vec![r]);
    vh.request_headers_to_add = vec![add("x-l", "vh")];
    vh.response_headers_to_remove = vec!["x-gone".into()];
    let mut rc = config("rc", vec![vh]);
    rc.request_headers_to_add = vec![add("x-l", "rc")];
    let t = translate(&rc);
    let plan = &t.vhosts[0].routes[0].header_plan;
    assert_eq!(level_values(&plan.request), ["route", "vh", "rc"]);
    assert_eq!(level_values(&plan.response), ["route"]);
    assert_eq!(plan.response.len(), 2, "vhost removal level kept");
    rc.most_specific_header_mutations_wins = true;
    let t = translate(&rc);
    let plan = &t.vhosts[0].routes[0].header_plan;
    assert_eq!(level_values(&plan.request), ["rc", "vh", "route"]);
}

#[test]
fn header_rejections_name_the_level() {
    let mut r = route(prefix("/"), to("c"));
    r.request_headers_to_add = vec![add(":path", "/x")];
    let e = rejection(&config("rc", vec![vhost("vh", &["*"], vec![r])]));
    assert_eq!(
        e.to_string(),
        "route 'rc': vhost 'vh' route 0: request_headers_to_add[0] ':path': :-prefixed or host headers may not be modified"
    );
    let mut vh = vhost("vh", &["*"], vec![route(prefix("/"), to("c"))]);
    vh.response_headers_to_add = vec![add("x-a", "%BAD%")];
    let e = rejection(&config("rc", vec![vh]));
    assert_eq!(
        e.to_string(),
        "route 'rc': vhost 'vh': response_headers_to_add[0] 'x-a': Not supported field in StreamInfo: BAD"
    );
    let mut rc = config(
        "rc",
        vec![vhost("vh", &["*"], vec![route(prefix("/"), to("c"))])],
    );
    rc.request_headers_to_remove = vec!["Host".into()];
    assert_eq!(
        rejection(&rc).to_string(),
        "route 'rc': request_headers_to_remove[0] 'Host': :-prefixed or host headers may not be removed"
    );
    let mut a = cw("a", Some(1));
    a.request_headers_to_add = vec![add("x-a", "100%")];
    let e = rejection(&config(
        "rc",
        vec![vhost(
            "vh",
            &["*"],
            vec![route(prefix("/"), weighted(vec![a], None))],
        )],
    ));
    assert_eq!(
        e.to_string(),
        "route 'rc': vhost 'vh' route 0: weighted_clusters.clusters[0] 'a': request_headers_to_add[0] 'x-a': Incorrect configuration: 100%. Couldn't find valid command at position 3"
    );
}

#[test]
fn weighted_entries_keep_their_own_headers() {
    let mut a = cw("a", Some(1));
    a.request_headers_to_add = vec![add("x-entry", "a")];
    let b = cw("b", Some(1));
    let r = translate_one(route(prefix("/"), weighted(vec![a, b], None)));
    let Action::Forward(Forward {
        target: Target::Weighted(w),
        ..
    }) = &r.action
    else {
        panic!("not weighted");
    };
    assert_eq!(w.entries.len(), 2);
    assert!(w.entries[0].request_headers.is_some());
    assert!(w.entries[1].request_headers.is_none());
    assert_eq!(w.pick_index(0), 0);
    assert_eq!(w.pick_index(1), 1);
}

#[test]
fn fault_overrides_layer_route_over_vhost() {
    use envoy_types::pb::envoy::extensions::filters::http::fault::v3 as fpb;
    use prost::Message;
    let fault = |status: u32| envoy_types::pb::google::protobuf::Any {
        type_url: fault::FAULT_TYPE.into(),
        value: fpb::HttpFault {
            abort: Some(fpb::FaultAbort {
                error_type: Some(fpb::fault_abort::ErrorType::HttpStatus(status)),
                ..Default::default()
            }),
            ..Default::default()
        }
        .encode_to_vec(),
    };
    let mut r = route(prefix("/a"), to("c"));
    r.typed_per_filter_config
        .insert("envoy.filters.http.fault".into(), fault(418));
    let mut vh = vhost("vh", &["*"], vec![r, route(prefix("/"), to("c"))]);
    vh.typed_per_filter_config
        .insert("envoy.filters.http.fault".into(), fault(503));
    let t = translate(&config("rc", vec![vh.clone()]));
    let status = |r: &Route| match r.filters.fault_override("envoy.filters.http.fault") {
        Some(crate::filters::fault::PerRoute {
            config: Some(c), ..
        }) => c.abort.as_ref().map(|a| a.kind.clone()),
        _ => None,
    };
    assert_eq!(
        status(&t.vhosts[0].routes[0]),
        Some(fault::AbortKind::Http(418))
    );
    assert_eq!(
        status(&t.vhosts[0].routes[1]),
        Some(fault::AbortKind::Http(503))
    );
    assert!(t.vhosts[0].routes[0]
        .filters
        .fault_override("other")
        .is_none());
    vh.routes[0]
        .typed_per_filter_config
        .insert("envoy.filters.http.fault".into(), fault(700));
    assert_eq!(
        rejection(&config("rc", vec![vh])).to_string(),
        "route 'rc': vhost 'vh' route 0: typed_per_filter_config['envoy.filters.http.fault']: abort: http_status: value 700 must be inside range [200, 600)"
    );
}

#[test]
fn hash_policy_is_translated_and_its_errors_name_the_route() {
    use rpb::route_action::hash_policy::{Header, PolicySpecifier};
    let hp = |name: &str| rpb::route_action::HashPolicy {
        policy_specifier: Some(PolicySpecifier::Header(Header {
            header_name: name.into(),
            regex_rewrite: None,
        })),
        terminal: false,
    };
    let with_policy = |names: &[&str]| {
        let mut ra = rpb::RouteAction {
            cluster_specifier: Some(CS::Cluster("c".into())),
            ..Default::default()
        };
        ra.hash_policy = names.iter().map(|n| hp(n)).collect();
        route(prefix("/"), rpb::route::Action::Route(ra))
    };
    let r = translate_one(with_policy(&["x-user", "x-tenant"]));
    let Action::Forward(f) = &r.action else {
        panic!("forward expected");
    };
    assert_eq!(f.hash_policy.len(), 2);
    let msg = assert_route_rejected(with_policy(&["x-user", ""]), "hash_policy[1]");
    assert!(
        msg.contains("header.header_name must not be empty"),
        "{msg}"
    );
}

#[test]
#[allow(deprecated)]
fn stream_timeouts_translate() {
    let d = |ms: i64| {
        Some(envoy_types::pb::google::protobuf::Duration {
            seconds: ms / 1000,
            nanos: (ms % 1000) as i32 * 1_000_000,
        })
    };
    let timeouts = |f: &dyn Fn(&mut rpb::RouteAction)| {
        let mut ra = rpb::RouteAction {
            cluster_specifier: Some(CS::Cluster("c".into())),
            ..Default::default()
        };
        f(&mut ra);
        let Action::Forward(fwd) =
            translate_one(route(prefix("/"), rpb::route::Action::Route(ra))).action
        else {
            panic!("not a forward");
        };
        fwd.timeouts
    };
    // Nothing set: the connection manager's idle timeout, the route timeout, no gRPC rules.
    assert_eq!(timeouts(&|_| {}), StreamTimeouts::default());
    let t = timeouts(&|ra| {
        ra.idle_timeout = d(0);
        ra.max_grpc_timeout = d(0);
        ra.grpc_timeout_offset = d(5);
    });
    assert_eq!(t.idle, Some(None), "zero switches the idle timeout off");
    assert_eq!(
        t.max_grpc,
        Some(Duration::ZERO),
        "zero: the header is not capped"
    );
    assert_eq!(t.grpc_offset, Some(Duration::from_millis(5)));
    let t = timeouts(&|ra| {
        ra.idle_timeout = d(1500);
        ra.max_stream_duration = Some(rpb::route_action::MaxStreamDuration {
            max_stream_duration: d(0),
            grpc_timeout_header_max: d(2000),
            ..Default::default()
        });
    });
    assert_eq!(t.idle, Some(Some(Duration::from_millis(1500))));
    assert_eq!(
        t.max_stream,
        Some(MaxStream {
            duration: Some(None),
            grpc_header_max: Some(Duration::from_secs(2)),
            grpc_header_offset: None,
        })
    );
    // An empty max_stream_duration still switches Envoy to the new timeouts.
    let t = timeouts(&|ra| ra.max_stream_duration = Some(Default::default()));
    assert_eq!(t.max_stream, Some(MaxStream::default()));
}

#[test]
fn negative_stream_timeouts_are_rejected() {
    let ra = rpb::RouteAction {
        cluster_specifier: Some(CS::Cluster("c".into())),
        idle_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: -1,
            nanos: 0,
        }),
        ..Default::default()
    };
    let rc = second_route(route(prefix("/"), rpb::route::Action::Route(ra)));
    assert!(rejection(&rc).to_string().contains("idle_timeout"));
}

#[test]
fn route_upgrade_configs_are_kept_and_checked() {
    let up = |t: &str, on: Option<bool>| rpb::route_action::UpgradeConfig {
        upgrade_type: t.into(),
        enabled: on.map(|value| BoolValue { value }),
        ..Default::default()
    };
    let with = |ups: Vec<rpb::route_action::UpgradeConfig>| {
        let mut r = route(prefix("/ws"), to("c"));
        if let Some(rpb::route::Action::Route(ra)) = r.action.as_mut() {
            ra.upgrade_configs = ups;
        }
        r
    };
    let r = translate_one(with(vec![up("websocket", Some(false)), up("foo", None)]));
    let Action::Forward(f) = &r.action else {
        panic!("not a forward: {:?}", r.action);
    };
    assert_eq!(f.upgrades.lookup(b"WebSocket"), Some(false));
    assert_eq!(f.upgrades.lookup(b"foo"), Some(true));
    assert_eq!(f.upgrades.lookup(b"bar"), None);
    let text = assert_route_rejected(
        with(vec![up("websocket", None), up("WEBSOCKET", None)]),
        "Duplicate upgrade WEBSOCKET",
    );
    assert!(text.contains("route 1"), "{text}");
}

#[test]
fn require_tls_is_kept_per_virtual_host() {
    let mut secure = vhost("secure", &["s.example"], vec![route(prefix("/"), to("c"))]);
    secure.require_tls = rpb::virtual_host::TlsRequirementType::ExternalOnly as i32;
    let plain = vhost("plain", &["p.example"], vec![route(prefix("/"), to("c"))]);
    let t =
        RouteTable::translate(&config("rc", vec![secure.clone(), plain.clone()])).expect("valid");
    assert!(t.any_require_tls);
    assert_eq!(
        t.vhost("s.example").map(|v| v.require_tls),
        Some(RequireTls::ExternalOnly)
    );
    assert_eq!(
        t.vhost("p.example").map(|v| v.require_tls),
        Some(RequireTls::None)
    );
    let t = RouteTable::translate(&config("rc", vec![plain])).expect("valid");
    assert!(!t.any_require_tls);
    secure.require_tls = 7;
    let e = RouteTable::translate(&config("rc", vec![secure]))
        .expect_err("unknown")
        .to_string();
    assert!(
        e.contains("vhost 'secure': require_tls: unknown value 7"),
        "{e}"
    );
}

#[test]
fn cluster_not_found_response_code_is_kept_and_an_undefined_one_refused() {
    use rpb::route_action::ClusterNotFoundResponseCode as C;
    for (code, want) in [
        (C::ServiceUnavailable, 503),
        (C::NotFound, 404),
        (C::InternalServerError, 500),
    ] {
        let mut ra = rpb::RouteAction {
            cluster_specifier: Some(CS::Cluster("c".into())),
            ..Default::default()
        };
        ra.cluster_not_found_response_code = code as i32;
        let r = translate_one(route(prefix("/x"), rpb::route::Action::Route(ra)));
        let Action::Forward(f) = &r.action else {
            panic!("a forwarding route: {r:?}")
        };
        assert_eq!(f.cluster_not_found, want);
    }
    let ra = rpb::RouteAction {
        cluster_specifier: Some(CS::Cluster("c".into())),
        cluster_not_found_response_code: 9,
        ..Default::default()
    };
    assert_route_rejected(
        route(prefix("/x"), rpb::route::Action::Route(ra)),
        "cluster_not_found_response_code: 9 is not a defined value",
    );
}

#[test]
fn the_direct_body_limit_is_the_configurations() {
    let body = || Some(DataSpecifier::InlineString("b".repeat(5000)));
    let mut rc = second_route(route(prefix("/big"), direct(200, body())));
    let e = rejection(&rc).to_string();
    assert!(
        e.contains("response body size is 5000 bytes; maximum is 4096"),
        "{e}"
    );
    rc.max_direct_response_body_size_bytes = Some(UInt32Value { value: 5000 });
    translate(&rc);
    rc.max_direct_response_body_size_bytes = Some(UInt32Value { value: 4999 });
    let e = rejection(&rc).to_string();
    assert!(e.contains("maximum is 4999"), "{e}");
}

#[test]
fn jwt_per_route_configs_take_the_most_specific_level_and_refuse_empty_ones() {
    use crate::filters::jwt_authn::{PerRoute, PER_ROUTE_TYPE};
    use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3 as jpb;
    use jpb::per_route_config::RequirementSpecifier as S;
    use prost::Message;
    let any = |s: Option<S>| envoy_types::pb::google::protobuf::Any {
        type_url: PER_ROUTE_TYPE.into(),
        value: jpb::PerRouteConfig {
            requirement_specifier: s,
        }
        .encode_to_vec(),
    };
    const NAME: &str = "envoy.filters.http.jwt_authn";
    let mut own = route(prefix("/own"), to("c"));
    own.typed_per_filter_config
        .insert(NAME.into(), any(Some(S::Disabled(true))));
    let inherits = route(prefix("/"), to("c"));
    let mut vh = vhost("vh", &["*"], vec![own, inherits]);
    vh.typed_per_filter_config
        .insert(NAME.into(), any(Some(S::RequirementName("r".into()))));
    let t = translate(&config("rc", vec![vh.clone()]));
    let routes = &t.vhosts[0].routes;
    assert_eq!(
        routes[0].filters.jwt_override(NAME),
        Some(&PerRoute::Disabled)
    );
    assert_eq!(
        routes[1].filters.jwt_override(NAME),
        Some(&PerRoute::Requirement("r".into()))
    );
    for (bad, needle) in [
        (None, "requirement_specifier is required"),
        (Some(S::Disabled(false)), "disabled: value must equal true"),
        (
            Some(S::RequirementName(String::new())),
            "requirement_name: value length",
        ),
    ] {
        let mut vh = vh.clone();
        vh.typed_per_filter_config.insert(NAME.into(), any(bad));
        let e = rejection(&config("rc", vec![vh])).to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn policy_per_route_configs_on_a_weighted_entry_are_refused() {
    let mut w = weighted(vec![cw("a", Some(1)), cw("b", Some(1))], None);
    if let rpb::route::Action::Route(ra) = &mut w {
        if let Some(CS::WeightedClusters(wc)) = &mut ra.cluster_specifier {
            wc.clusters[0].typed_per_filter_config.insert(
                "envoy.filters.http.rbac".into(),
                envoy_types::pb::google::protobuf::Any {
                    type_url: crate::filters::rbac::PER_ROUTE_TYPE.into(),
                    value: Vec::new(),
                },
            );
        }
    }
    assert_route_rejected(
        route(prefix("/w"), w),
        "on a weighted cluster is not supported",
    );
}

#[test]
fn route_fields_that_would_route_otherwise_are_refused_with_their_names() {
    use envoy_types::pb::envoy::r#type::v3::FractionalPercent;
    let with_ra = |f: fn(&mut rpb::RouteAction)| {
        let mut ra = rpb::RouteAction {
            cluster_specifier: Some(CS::Cluster("c".into())),
            ..Default::default()
        };
        f(&mut ra);
        route(prefix("/x"), rpb::route::Action::Route(ra))
    };
    assert_route_rejected(
        with_ra(|ra| ra.priority = 1),
        "priority: only DEFAULT is supported",
    );
    assert_route_rejected(
        with_ra(|ra| ra.path_rewrite = "/%REQ(x)%".into()),
        "path_rewrite (a format string) is not supported",
    );
    assert_route_rejected(
        with_ra(|ra| ra.internal_redirect_policy = Some(Default::default())),
        "internal redirects (internal_redirect_policy) are not supported",
    );
    assert_route_rejected(
        with_ra(|ra| {
            ra.hedge_policy = Some(rpb::HedgePolicy {
                hedge_on_per_try_timeout: true,
                ..Default::default()
            })
        }),
        "hedge_policy.hedge_on_per_try_timeout is not supported",
    );
    // Half the requests matching: refused; all of them: the route as without it.
    let mut half = prefix("/x");
    half.runtime_fraction = Some(corepb::RuntimeFractionalPercent {
        default_value: Some(FractionalPercent {
            numerator: 50,
            denominator: 0,
        }),
        runtime_key: "k".into(),
    });
    assert_route_rejected(
        route(half.clone(), to("c")),
        "match.runtime_fraction below 100% is not supported",
    );
    if let Some(f) = half
        .runtime_fraction
        .as_mut()
        .and_then(|f| f.default_value.as_mut())
    {
        f.numerator = 100;
    }
    translate_one(route(half, to("c")));
    let mut rc = second_route(route(prefix("/x"), to("c")));
    rc.internal_only_headers = vec!["X-Trusted".into()];
    assert_eq!(translate(&rc).internal_only, ["x-trusted"]);
    rc.internal_only_headers = vec!["bad name".into()];
    let e = rejection(&rc).to_string();
    assert!(
        e.contains("internal_only_headers: 'bad name' is not a valid header name"),
        "{e}"
    );
    let mut rc = second_route(route(prefix("/x"), to("c")));
    rc.vhost_header = "x-vhost".into();
    let e = rejection(&rc).to_string();
    assert!(e.contains("vhost_header is not supported"), "{e}");
}
