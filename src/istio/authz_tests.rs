use super::*;

use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/istio-authz/http");
const RBAC_TYPE: &str = "envoy.extensions.filters.http.rbac.v3.RBAC";

/// A filter's `typed_config` (proto-JSON, either case) as the RBAC proto.
fn decode(filter: &Json) -> Rbac {
    let cfg = filter
        .get("typed_config")
        .or_else(|| filter.get("typedConfig"))
        .expect("typed config");
    let mut cfg = cfg.clone();
    if let Json::Object(m) = &mut cfg {
        m.remove("@type");
    }
    let _pool = crate::protojson::pool();
    crate::protojson::dynamic_from_json(RBAC_TYPE, &cfg)
        .unwrap_or_else(|e| panic!("{e}: {cfg}"))
        .transcode_to()
        .expect("transcode")
}

/// The policies of an input file that select istiod's test node (namespace foo, labels
/// app=httpbin, version=v1).
fn policies(text: &str) -> Vec<(crate::istio::model::Metadata, AuthorizationPolicySpec)> {
    let (objects, bad) = crate::istio::model::parse_file("in.yaml", text);
    assert!(bad.is_empty(), "{bad:?}");
    let labels: BTreeMap<String, String> = [("app", "httpbin"), ("version", "v1")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    objects
        .into_iter()
        .filter_map(|o| match o {
            crate::istio::model::Object::AuthorizationPolicy(m, s) => Some((m, s)),
            _ => None,
        })
        .filter(|(m, s)| {
            let ns = m.namespace.as_deref().unwrap_or("default");
            let selected = s.selector.as_ref().is_none_or(|sel| {
                sel.match_labels
                    .iter()
                    .all(|(k, v)| labels.get(k) == Some(v))
            });
            (ns == "foo" || ns == "istio-system") && selected
        })
        .collect()
}

/// istiod's own builder tests: the same policies give the same RBAC filters.
#[test]
fn rbac_filters_match_istiods_golden_output() {
    let cases: &[(&str, &[&str])] = &[
        ("allow-empty-rule", &["allow-empty-rule-out.yaml"]),
        ("allow-full-rule", &["allow-full-rule-out.yaml"]),
        ("allow-nil-rule", &["allow-nil-rule-out.yaml"]),
        ("allow-path", &["allow-path-out.yaml"]),
        ("audit-full-rule", &["audit-full-rule-out.yaml"]),
        (
            "deny-and-allow",
            &["deny-and-allow-out1.yaml", "deny-and-allow-out2.yaml"],
        ),
        ("deny-empty-rule", &["deny-empty-rule-out.yaml"]),
        (
            "dry-run-allow-and-deny",
            &[
                "dry-run-allow-and-deny-out1.yaml",
                "dry-run-allow-and-deny-out2.yaml",
            ],
        ),
        ("dry-run-allow", &["dry-run-allow-out.yaml"]),
        ("dry-run-mix", &["dry-run-mix-out.yaml"]),
        ("multiple-policies", &["multiple-policies-out.yaml"]),
        ("single-policy", &["single-policy-out.yaml"]),
        ("trust-domains", &["trust-domains-out.yaml"]),
    ];
    for (case, wants) in cases {
        let input = std::fs::read_to_string(format!("{DIR}/{case}-in.yaml")).expect("input");
        let parsed = policies(&input);
        let list: Vec<Policy<'_>> = parsed
            .iter()
            .map(|(m, s)| Policy {
                namespace: m.namespace.as_deref().unwrap_or("default"),
                name: &m.name,
                spec: s,
                dry_run: m.annotations.get("istio.io/dry-run").map(String::as_str) == Some("true"),
            })
            .collect();
        let (got, _problems) = build_http(&list, false);
        assert_eq!(got.len(), wants.len(), "{case}: {got:#?}");
        for (g, w) in got.iter().zip(wants.iter()) {
            let text = std::fs::read_to_string(format!("{DIR}/{w}")).expect("want");
            let want: Json = serde_yaml::from_str(&text).expect("golden yaml");
            assert_eq!(g["name"], "envoy.filters.http.rbac");
            let (g, w_rbac) = (decode(g), decode(&want));
            if g != w_rbac {
                let (a, b) = (format!("{g:?}"), format!("{w_rbac:?}"));
                let at = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
                let from = at.saturating_sub(300);
                panic!(
                    "{case}: {w} differs at {at}:\n got: {}\nwant: {}",
                    &a[from..(at + 300).min(a.len())],
                    &b[from..(at + 300).min(b.len())]
                );
            }
        }
    }
}

#[test]
fn matchers_as_istiod_writes_them() {
    assert_eq!(
        string_matcher("*", ""),
        json!({"safe_regex": {"regex": ".+"}})
    );
    assert_eq!(string_matcher("*x", ""), json!({"suffix": "x"}));
    assert_eq!(
        string_matcher("*x.y", "spiffe://"),
        json!({"safe_regex": {"regex": "spiffe://.*x\\.y"}})
    );
    assert_eq!(
        string_matcher("x*", "spiffe://"),
        json!({"prefix": "spiffe://x"})
    );
    assert_eq!(
        cidr("10.0.0.0/8"),
        Ok(json!({"address_prefix": "10.0.0.0", "prefix_len": 8}))
    );
    assert!(cidr("10.0.0.0/33").is_err());
    assert!(cidr("nope").is_err());
    assert_eq!(
        nested_brackets("[a][b]"),
        Ok(vec!["a".to_string(), "b".to_string()])
    );
    assert_eq!(nested_brackets("[a.b]"), Ok(vec!["a.b".to_string()]));
    assert!(nested_brackets("a]").is_err());
}

#[test]
fn an_allow_rule_with_a_bad_value_is_dropped_a_deny_rule_keeps_the_rest() {
    let spec = |action: &str| AuthorizationPolicySpec {
        action: Some(action.into()),
        rules: vec![Some(Rule {
            from: vec![From {
                source: Some(Source {
                    ip_blocks: vec!["1.2.3.4".into(), "bad".into()],
                    ..Default::default()
                }),
            }],
            ..Default::default()
        })],
        ..Default::default()
    };
    let allow = spec("ALLOW");
    let p = [Policy {
        namespace: "foo",
        name: "p",
        spec: &allow,
        dry_run: false,
    }];
    let (f, problems) = build_http(&p, false);
    assert_eq!(decode(&f[0]).rules.expect("rules").policies.len(), 0);
    assert!(problems[0].2.contains("invalid IP address"), "{problems:?}");
    let deny = spec("DENY");
    let p = [Policy {
        namespace: "foo",
        name: "p",
        spec: &deny,
        dry_run: false,
    }];
    let (f, problems) = build_http(&p, false);
    assert_eq!(decode(&f[0]).rules.expect("rules").policies.len(), 1);
    assert!(problems.is_empty());
}
