use super::*;
use crate::filters::{Connection, FilterState, PeerIdentity, RouteFilters};
use crate::matcher::RequestView;

fn engine(yaml: &str) -> Engine {
    let json: serde_json::Value = serde_yaml::from_str(yaml).expect("yaml");
    let _pool = crate::protojson::pool();
    let r: rpb::Rbac = crate::protojson::dynamic_from_json("envoy.config.rbac.v3.RBAC", &json)
        .expect("proto json")
        .transcode_to()
        .expect("transcode");
    Engine::translate(&r, "rules").expect("translates")
}

fn engine_err(yaml: &str) -> String {
    let json: serde_json::Value = serde_yaml::from_str(yaml).expect("yaml");
    let _pool = crate::protojson::pool();
    let r: rpb::Rbac = crate::protojson::dynamic_from_json("envoy.config.rbac.v3.RBAC", &json)
        .expect("proto json")
        .transcode_to()
        .expect("transcode");
    Engine::translate(&r, "rules").expect_err("refused")
}

struct Peer;
impl PeerIdentity for Peer {
    fn uri_sans(&self) -> &[String] {
        static U: std::sync::LazyLock<Vec<String>> =
            std::sync::LazyLock::new(|| vec!["spiffe://cluster.local/ns/foo/sa/bar".to_string()]);
        &U
    }
    fn dns_sans(&self) -> &[String] {
        &[]
    }
    fn subject(&self) -> &str {
        "CN=client"
    }
}

/// Evaluates `e` for a request to `path` from `direct` (trusted client `remote`).
fn check(
    e: &Engine,
    path: &str,
    headers: &[(&str, &str)],
    conn: Connection<'_>,
    st: &FilterState,
) -> (bool, Option<String>) {
    let mut map = http::HeaderMap::new();
    for (k, v) in headers {
        map.append(
            http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
            http::HeaderValue::from_str(v).expect("value"),
        );
    }
    let view = RequestView {
        host: "example.com",
        authority: "example.com",
        path,
        method: "GET",
        scheme: "http",
        headers: &map,
    };
    let req = Request {
        view: &view,
        route: None,
        picked: None,
        server: None,
        conn,
        upstreams: None,
        body: None,
    };
    let s = Subject {
        req: Some(&req),
        conn: &req.conn,
        state: st,
    };
    let (ok, p) = e.allows(&s);
    (ok, p.map(str::to_string))
}

fn conn(ip: &str) -> Connection<'static> {
    Connection {
        direct_remote: Some(format!("{ip}:5000").parse().expect("addr")),
        remote: None,
        local: Some("10.0.0.1:8080".parse().expect("addr")),
        ..Default::default()
    }
}

#[test]
fn allow_and_deny_report_the_first_matching_policy_by_name() {
    let e = engine(
        r#"
action: DENY
policies:
  b-admin: {permissions: [{urlPath: {path: {prefix: /admin}}}], principals: [{any: true}]}
  a-admin: {permissions: [{urlPath: {path: {exact: /admin}}}], principals: [{any: true}]}
"#,
    );
    let st = FilterState::default();
    assert_eq!(
        check(&e, "/admin?x=1", &[], conn("1.2.3.4"), &st),
        (false, Some("a-admin".into())),
        "the query is not part of url_path; names in order"
    );
    assert_eq!(
        check(&e, "/admin/x", &[], conn("1.2.3.4"), &st),
        (false, Some("b-admin".into()))
    );
    assert_eq!(
        check(&e, "/public", &[], conn("1.2.3.4"), &st),
        (true, None)
    );
    let allow = engine(
        r#"
policies:
  office: {permissions: [{any: true}], principals: [{remoteIp: {addressPrefix: 10.0.0.0, prefixLen: 8}}]}
"#,
    );
    assert!(check(&allow, "/", &[], conn("10.1.2.3"), &st).0);
    assert!(!check(&allow, "/", &[], conn("11.1.2.3"), &st).0);
    // remote_ip is the trusted client, not the socket's peer.
    let mut c = conn("10.1.2.3");
    c.remote = Some("11.0.0.1".parse().expect("ip"));
    assert!(!check(&allow, "/", &[], c, &st).0);
}

#[test]
fn combinators_headers_ports_and_templates() {
    let e = engine(
        r#"
policies:
  p:
    permissions:
    - andRules:
        rules:
        - header: {name: ":method", stringMatch: {exact: GET}}
        - notRule: {header: {name: x-block, presentMatch: true}}
        - orRules: {rules: [{destinationPort: 8080}, {destinationPort: 9090}]}
    - uriTemplate:
        name: uri-template
        typedConfig:
          "@type": type.googleapis.com/envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig
          pathTemplate: /**/templated/*
    principals: [{any: true}]
"#,
    );
    let st = FilterState::default();
    assert!(check(&e, "/x", &[], conn("1.1.1.1"), &st).0);
    assert!(!check(&e, "/x", &[("x-block", "1")], conn("1.1.1.1"), &st).0);
    assert!(
        check(
            &e,
            "/a/b/templated/c",
            &[("x-block", "1")],
            conn("1.1.1.1"),
            &st
        )
        .0
    );
    assert!(
        check(
            &e,
            "/templated/c",
            &[("x-block", "1")],
            conn("1.1.1.1"),
            &st
        )
        .0
    );
    assert!(
        !check(
            &e,
            "/a/templated/c/d",
            &[("x-block", "1")],
            conn("1.1.1.1"),
            &st
        )
        .0
    );
}

#[test]
fn jwt_metadata_as_istiod_matches_it() {
    let e = engine(
        r#"
policies:
  p:
    permissions: [{any: true}]
    principals:
    - metadata:
        filter: envoy.filters.http.jwt_authn
        path: [{key: payload}, {key: groups}]
        value:
          orMatch:
            valueMatchers:
            - listMatch: {oneOf: {stringMatch: {exact: admins}}}
            - stringMatch: {exact: admins}
"#,
    );
    let mut st = FilterState::default();
    assert!(
        !check(&e, "/", &[], conn("1.1.1.1"), &st).0,
        "no token, no metadata"
    );
    st.set_metadata(
        "envoy.filters.http.jwt_authn",
        "payload".into(),
        serde_json::json!({"groups": ["dev", "admins"]}),
    );
    assert!(check(&e, "/", &[], conn("1.1.1.1"), &st).0);
    st.set_metadata(
        "envoy.filters.http.jwt_authn",
        "payload".into(),
        serde_json::json!({"groups": "admins"}),
    );
    assert!(check(&e, "/", &[], conn("1.1.1.1"), &st).0);
}

#[test]
fn authenticated_principals_read_uri_sans_then_subject() {
    let e = engine(
        r#"
policies:
  p:
    permissions: [{any: true}]
    principals:
    - authenticated: {principalName: {safeRegex: {regex: "spiffe://.+/ns/foo/(.+/|)sa/bar(/.+)?"}}}
"#,
    );
    let st = FilterState::default();
    let peer = Peer;
    let mut c = conn("1.1.1.1");
    assert!(!check(&e, "/", &[], c, &st).0, "plaintext");
    c.tls = true;
    c.peer = Some(&peer);
    assert!(check(&e, "/", &[], c, &st).0);
}

#[test]
fn unsupported_matchers_are_refused_with_their_field() {
    let err = engine_err(
        r#"
policies:
  p:
    permissions: [{any: true}]
    principals: [{filterState: {key: io.istio.peer_principal, stringMatch: {exact: x}}}]
"#,
    );
    assert_eq!(
        err,
        "rules.policies[p].principals[0].filter_state: filter state matchers are not supported"
    );
    let err = engine_err("policies: {p: {permissions: [], principals: [{any: true}]}}");
    assert!(err.contains("at least one permission"), "{err}");
}

/// Every RBAC filter istiod rendered in its builder goldens and in the authz config dump
/// translates.
#[test]
fn istiods_rbac_filters_translate() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/istio-authz/http");
    let mut n = 0;
    for e in std::fs::read_dir(dir).expect("dir") {
        let path = e.expect("entry").path();
        if !path.to_string_lossy().contains("-out") {
            continue;
        }
        let v: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&path).expect("read")).expect("yaml");
        if v["name"] != "envoy.filters.http.rbac" {
            continue;
        }
        let mut cfg = v["typedConfig"].clone();
        if let serde_json::Value::Object(m) = &mut cfg {
            m.remove("@type");
        }
        let _pool = crate::protojson::pool();
        let r: hpb::Rbac =
            crate::protojson::dynamic_from_json("envoy.extensions.filters.http.rbac.v3.RBAC", &cfg)
                .expect("proto json")
                .transcode_to()
                .expect("transcode");
        RbacFilter::from_proto("rbac", &r).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 15, "{n} filters");
}

#[test]
fn per_route_override_disables_or_replaces() {
    let f = RbacFilter::from_proto(
        "envoy.filters.http.rbac",
        &hpb::Rbac {
            rules: Some(rpb::Rbac {
                action: 1,
                policies: [(
                    "all".to_string(),
                    rpb::Policy {
                        permissions: vec![rpb::Permission {
                            rule: Some(rpb::permission::Rule::Any(true)),
                        }],
                        principals: vec![rpb::Principal {
                            identifier: Some(rpb::principal::Identifier::Any(true)),
                        }],
                        ..Default::default()
                    },
                )]
                .into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .expect("filter");
    let named = crate::filters::counters::NamedCounters::default();
    let map = http::HeaderMap::new();
    let view = RequestView {
        host: "h",
        authority: "h",
        path: "/",
        method: "GET",
        scheme: "http",
        headers: &map,
    };
    let decide = |route: Option<&RouteFilters>| {
        let req = Request {
            view: &view,
            route,
            picked: None,
            server: None,
            conn: conn("1.1.1.1"),
            upstreams: None,
            body: None,
        };
        let mut st = FilterState::default();
        matches!(f.decode(&req, &mut st, &named), Decision::Continue)
    };
    assert!(!decide(None));
    let off = RouteFilters {
        rbac: vec![(
            "envoy.filters.http.rbac".into(),
            Arc::new(PerRoute { rbac: None }),
        )],
        ..Default::default()
    };
    assert!(decide(Some(&off)));
    assert_eq!(named.get("rbac.denied").load(Relaxed), 1);
}
