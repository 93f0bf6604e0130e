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

/// A filter (proto-JSON, either case) as its proto, through the descriptor pool.
fn decode_any(filter: &Json) -> envoy_types::pb::google::protobuf::Any {
    let cfg = filter
        .get("typed_config")
        .or_else(|| filter.get("typedConfig"))
        .expect("typed config");
    let type_url = cfg["@type"].as_str().expect("@type").to_string();
    let mut cfg = cfg.clone();
    if let Json::Object(m) = &mut cfg {
        m.remove("@type");
    }
    crate::istio::translate::encode(&type_url, &cfg).unwrap_or_else(|e| panic!("{e}: {cfg}"))
}

/// Two filters' configs equal as protos (maps compared as maps).
fn same_filter(got: &Json, want: &Json) -> bool {
    use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::ExtAuthz;
    use prost::Message;
    let (g, w) = (decode_any(got), decode_any(want));
    if g.type_url != w.type_url {
        return false;
    }
    if g.type_url.ends_with("RBAC") {
        let d = |b: &[u8]| Rbac::decode(b).expect("RBAC decodes");
        return d(&g.value) == d(&w.value);
    }
    let d = |b: &[u8]| ExtAuthz::decode(b).expect("ExtAuthz decodes");
    d(&g.value) == d(&w.value)
}

fn mesh(yaml: &str) -> MeshConfig {
    serde_yaml::from_str(yaml).expect("mesh config")
}

/// istiod's CUSTOM goldens, with the mesh configs of its builder test.
#[test]
fn custom_filters_match_istiods_golden_output() {
    let grpc_no_ns = mesh(
        "extensionProviders: [{name: default, envoyExtAuthzGrpc: {service: my-custom-ext-authz.foo.svc.cluster.local, port: 9000, failOpen: true, statusOnError: '403'}}]",
    );
    let grpc = mesh(
        "extensionProviders: [{name: default, envoyExtAuthzGrpc: {service: foo/my-custom-ext-authz.foo.svc.cluster.local, port: 9000, timeout: 2ms, failOpen: true, statusOnError: '403', includeRequestBodyInCheck: {maxRequestBytes: 4096, allowPartialMessage: true}}}]",
    );
    let http = mesh(
        r#"extensionProviders:
- name: default
  envoyExtAuthzHttp:
    service: foo/my-custom-ext-authz.foo.svc.cluster.local
    port: 9000
    timeout: 10s
    failOpen: true
    statusOnError: "403"
    pathPrefix: /check
    includeRequestHeadersInCheck: [x-custom-id, x-prefix-*, "*-suffix"]
    includeHeadersInCheck: [should-not-include-when-IncludeRequestHeadersInCheck-is-set]
    includeAdditionalHeadersInCheck: {x-header-1: value-1, x-header-2: value-2}
    includeRequestBodyInCheck: {maxRequestBytes: 2048, allowPartialMessage: true, packAsBytes: true}
    headersToUpstreamOnAllow: [Authorization, x-prefix-*, "*-suffix"]
    headersToDownstreamOnDeny: [Set-cookie, x-prefix-*, "*-suffix"]
    headersToDownstreamOnAllow: [Set-cookie, x-prefix-*, "*-suffix"]
"#,
    );
    let invalid = mesh(
        "extensionProviders: [{name: default, envoyExtAuthzHttp: {service: foo/my-custom-ext-authz, port: 999999, pathPrefix: check, statusOnError: '999'}}]",
    );
    let lookup = |service: &str, port: u32| -> Result<(String, String), String> {
        let host = service.rsplit('/').next().unwrap_or(service);
        if host == "my-custom-ext-authz.foo.svc.cluster.local" {
            Ok((host.to_string(), format!("outbound|{port}||{host}")))
        } else {
            Err(format!("could not find service {service}"))
        }
    };
    let cases: &[(&str, &MeshConfig, &str, &[&str])] = &[
        (
            "grpc-no-namespace",
            &grpc_no_ns,
            "custom-simple-http-in.yaml",
            &[
                "custom-grpc-provider-no-namespace-out1.yaml",
                "custom-grpc-provider-no-namespace-out2.yaml",
            ],
        ),
        (
            "grpc",
            &grpc,
            "custom-simple-http-in.yaml",
            &[
                "custom-grpc-provider-out1.yaml",
                "custom-grpc-provider-out2.yaml",
            ],
        ),
        (
            "http",
            &http,
            "custom-simple-http-in.yaml",
            &[
                "custom-http-provider-out1.yaml",
                "custom-http-provider-out2.yaml",
            ],
        ),
        (
            "multiple-providers",
            &http,
            "custom-bad-multiple-providers-in.yaml",
            &[
                "custom-bad-multiple-providers-out1.yaml",
                "custom-bad-multiple-providers-out2.yaml",
            ],
        ),
        (
            "invalid",
            &invalid,
            "custom-simple-http-in.yaml",
            &["custom-bad-out.yaml"],
        ),
    ];
    for (case, mesh, input, wants) in cases {
        let text = std::fs::read_to_string(format!("{DIR}/{input}")).expect("input");
        let parsed = policies(&text);
        let list: Vec<Policy<'_>> = parsed
            .iter()
            .map(|(m, s)| Policy {
                namespace: m.namespace.as_deref().unwrap_or("default"),
                name: &m.name,
                spec: s,
                dry_run: false,
            })
            .collect();
        let (got, _tcp, _problems) = build_custom(&list, mesh, &lookup);
        assert_eq!(got.len(), wants.len(), "{case}: {got:#?}");
        for (g, w) in got.iter().zip(wants.iter()) {
            let want: Json =
                serde_yaml::from_str(&std::fs::read_to_string(format!("{DIR}/{w}")).expect("want"))
                    .expect("golden yaml");
            assert_eq!(g["name"], want["name"], "{case}: {w}");
            assert!(
                same_filter(g, &want),
                "{case}: {w}:\n got {g:#}\nwant {want:#}"
            );
        }
    }
}
