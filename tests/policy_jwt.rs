//! `envoy.filters.http.jwt_authn` as Envoy runs it: a missing, expired, badly signed or
//! foreign token is refused with Envoy's 401 and `www-authenticate`, a good one goes through
//! (its claims as headers, its payload for RBAC's metadata matcher), keys come inline or from
//! a JWKS server through a cluster (fetched when first needed, fetched again after
//! `cache_duration`, so a rotated key set is used), and an unreachable JWKS server is
//! `Jwks remote fetch is failed`. Runs against Envoy too:
//! `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test policy_jwt`.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::jwt::{now, Signer};
use common::*;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource, HttpUri};
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, Permission, Policy, Principal, Rbac as Rules,
};
use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3 as jpb;
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    metadata_matcher, string_matcher, value_matcher, MetadataMatcher, StringMatcher, ValueMatcher,
};
use http_body_util::Full;
use serde_json::json;

const HOST: &str = "example.com";
const ISSUER: &str = "https://issuer.example";

fn claims(sub: &str, group: &str, exp: u64) -> serde_json::Value {
    json!({"iss": ISSUER, "sub": sub, "aud": "api", "group": group, "exp": exp})
}

fn filter(name: &str, config: impl prost::Name) -> HttpFilter {
    HttpFilter {
        name: name.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(config))),
        ..Default::default()
    }
}

fn provider(jwks: jpb::jwt_provider::JwksSourceSpecifier) -> jpb::JwtProvider {
    jpb::JwtProvider {
        issuer: ISSUER.into(),
        audiences: vec!["api".into()],
        payload_in_metadata: ISSUER.into(),
        claim_to_headers: vec![jpb::JwtClaimToHeader {
            header_name: "x-jwt-sub".into(),
            claim_name: "sub".into(),
            ..Default::default()
        }],
        jwks_source_specifier: Some(jwks),
        ..Default::default()
    }
}

fn local(jwks: String) -> jpb::jwt_provider::JwksSourceSpecifier {
    jpb::jwt_provider::JwksSourceSpecifier::LocalJwks(DataSource {
        specifier: Some(data_source::Specifier::InlineString(jwks)),
        ..Default::default()
    })
}

fn remote(cluster: &str, cache: Duration) -> jpb::jwt_provider::JwksSourceSpecifier {
    jpb::jwt_provider::JwksSourceSpecifier::RemoteJwks(jpb::RemoteJwks {
        http_uri: Some(HttpUri {
            uri: format!("http://{cluster}.local/keys.json"),
            http_upstream_type: Some(
                envoy_types::pb::envoy::config::core::v3::http_uri::HttpUpstreamType::Cluster(
                    cluster.into(),
                ),
            ),
            timeout: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 2,
                nanos: 0,
            }),
        }),
        cache_duration: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: cache.as_secs() as i64,
            nanos: cache.subsec_nanos() as i32,
        }),
        ..Default::default()
    })
}

/// jwt_authn requiring the provider on `/api`, then RBAC allowing `/api/admin` only to
/// tokens whose `group` claim is `admins` (istiod's `request.auth.claims[group]`).
fn snapshot(port: u16, p: jpb::JwtProvider, web: SocketAddr, jwks: Option<SocketAddr>) -> Snapshot {
    let jwt = jpb::JwtAuthentication {
        providers: [("origins".to_string(), p)].into(),
        rules: vec![jpb::RequirementRule {
            r#match: Some(rpb::RouteMatch {
                path_specifier: Some(rpb::route_match::PathSpecifier::Prefix("/api".into())),
                ..Default::default()
            }),
            requirement_type: Some(jpb::requirement_rule::RequirementType::Requires(
                jpb::JwtRequirement {
                    requires_type: Some(jpb::jwt_requirement::RequiresType::ProviderName(
                        "origins".into(),
                    )),
                },
            )),
        }],
        ..Default::default()
    };
    let admins = Policy {
        permissions: vec![Permission {
            rule: Some(permission::Rule::NotRule(Box::new(Permission {
                rule: Some(permission::Rule::UrlPath(
                    envoy_types::pb::envoy::r#type::matcher::v3::PathMatcher {
                        rule: Some(
                            envoy_types::pb::envoy::r#type::matcher::v3::path_matcher::Rule::Path(
                                StringMatcher {
                                    match_pattern: Some(string_matcher::MatchPattern::Prefix(
                                        "/api/admin".into(),
                                    )),
                                    ..Default::default()
                                },
                            ),
                        ),
                    },
                )),
            }))),
        }],
        principals: vec![Principal {
            identifier: Some(principal::Identifier::Any(true)),
        }],
        ..Default::default()
    };
    // `metadata` is deprecated for `sourced_metadata`, but it is what istiod renders.
    #[allow(deprecated)]
    let claim = Policy {
        permissions: vec![Permission {
            rule: Some(permission::Rule::Any(true)),
        }],
        principals: vec![Principal {
            identifier: Some(principal::Identifier::Metadata(MetadataMatcher {
                filter: "envoy.filters.http.jwt_authn".into(),
                path: vec![
                    metadata_matcher::PathSegment {
                        segment: Some(metadata_matcher::path_segment::Segment::Key(ISSUER.into())),
                    },
                    metadata_matcher::PathSegment {
                        segment: Some(metadata_matcher::path_segment::Segment::Key("group".into())),
                    },
                ],
                value: Some(ValueMatcher {
                    match_pattern: Some(value_matcher::MatchPattern::StringMatch(StringMatcher {
                        match_pattern: Some(string_matcher::MatchPattern::Exact("admins".into())),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
        }],
        ..Default::default()
    };
    let rbac = Rbac {
        rules: Some(Rules {
            action: 0,
            policies: [
                ("not-admin-path".to_string(), admins),
                ("admins".to_string(), claim),
            ]
            .into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut h = hcm(port);
    let router = h.http_filters.pop().expect("router");
    h.http_filters = vec![
        filter("envoy.filters.http.jwt_authn", jwt),
        filter("envoy.filters.http.rbac", rbac),
        router,
    ];
    let mut s = Snapshot {
        listeners: vec![listener_with(port, h)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), to_cluster("web"))],
            )],
        )],
        clusters: vec![eds_cluster("web")],
        endpoints: vec![cla("web", &[web])],
        ..Default::default()
    };
    if let Some(addr) = jwks {
        s.clusters.push(eds_cluster("jwks"));
        s.endpoints.push(cla("jwks", &[addr]));
    }
    s
}

async fn serving(mesh: &Mesh) {
    eventually("listener", Duration::from_secs(15), || async {
        let r = mesh.get("/public", HOST, &[]).await;
        (r.status == 200)
            .then_some(())
            .ok_or(format!("{}", r.status))
    })
    .await;
}

async fn get(mesh: &Mesh, path: &str, token: Option<&str>) -> Resp {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    mesh.get(path, HOST, &headers).await
}

fn assert_refused(r: &Resp, status: u16, body: &str) {
    assert_eq!((r.status, r.body.as_str()), (status, body));
    let expected = if body == "Jwt is missing" {
        "Bearer realm=\"http://example.com/api\"".to_string()
    } else {
        "Bearer realm=\"http://example.com/api\", error=\"invalid_token\"".to_string()
    };
    assert_eq!(r.header("www-authenticate"), Some(expected.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_jwks_verifies_and_rbac_reads_the_claims() {
    let web = header_echo().await;
    let signer = Signer::new();
    let other = Signer::new();
    let p = provider(local(signer.jwks("k1")));
    let mesh = Mesh::start_raw(|port| snapshot(port, p, web, None)).await;
    serving(&mesh).await;

    let good = signer.token("k1", claims("alice", "users", now() + 600));
    let r = get(&mesh, "/api", Some(&good)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-req-x-jwt-sub"), Some("alice"));
    // Without `forward`, the token does not go upstream.
    assert_eq!(r.header("x-req-authorization"), None);

    assert_refused(&get(&mesh, "/api", None).await, 401, "Jwt is missing");
    let expired = signer.token("k1", claims("alice", "users", now() - 600));
    assert_refused(
        &get(&mesh, "/api", Some(&expired)).await,
        401,
        "Jwt is expired",
    );
    let forged = other.token("k1", claims("alice", "users", now() + 600));
    assert_refused(
        &get(&mesh, "/api", Some(&forged)).await,
        401,
        "Jwt verification fails",
    );
    let mut foreign = claims("alice", "users", now() + 600);
    foreign["iss"] = json!("https://elsewhere.example");
    let foreign = signer.token("k1", foreign);
    assert_refused(
        &get(&mesh, "/api", Some(&foreign)).await,
        401,
        "Jwt issuer is not configured",
    );

    // RBAC on the payload: only the admins group reaches /api/admin.
    let r = get(&mesh, "/api/admin", Some(&good)).await;
    assert_eq!((r.status, r.body.as_str()), (403, "RBAC: access denied"));
    let admin = signer.token("k1", claims("bob", "admins", now() + 600));
    assert_eq!(get(&mesh, "/api/admin", Some(&admin)).await.status, 200);
    assert_eq!(mesh.gw.stat_ending("jwt_authn.denied").await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_jwks_is_fetched_cached_and_rotated() {
    let web = header_echo().await;
    let first = Signer::new();
    let second = Signer::new();
    let served = Arc::new(Mutex::new(first.jwks("k1")));
    let fetches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let jwks = {
        let (served, fetches) = (served.clone(), fetches.clone());
        serve_fn(move |req| {
            fetches.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let body = if req.uri().path() == "/keys.json" {
                served.lock().expect("lock").clone()
            } else {
                String::new()
            };
            hyper::Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("response")
        })
        .await
    };
    let p = provider(remote("jwks", Duration::from_secs(2)));
    let mesh = Mesh::start_raw(|port| snapshot(port, p, web, Some(jwks))).await;
    serving(&mesh).await;

    let t1 = first.token("k1", claims("alice", "users", now() + 600));
    let r = get(&mesh, "/api", Some(&t1)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-req-x-jwt-sub"), Some("alice"));
    assert_eq!(get(&mesh, "/api", Some(&t1)).await.status, 200);

    // The server rotates its keys; once the cache has expired the new set is fetched.
    *served.lock().expect("lock") = second.jwks("k2");
    let t2 = second.token("k2", claims("carol", "users", now() + 600));
    let r = eventually("rotated keys", Duration::from_secs(15), || async {
        let r = get(&mesh, "/api", Some(&t2)).await;
        (r.status == 200).then_some(r).ok_or("old keys".to_string())
    })
    .await;
    assert_eq!(r.header("x-req-x-jwt-sub"), Some("carol"));
    assert!(fetches.load(std::sync::atomic::Ordering::SeqCst) >= 2);
    assert!(mesh.gw.stat_ending("jwt_authn.jwks_fetch_success").await >= 2);
    // The old token's key id is gone from the set.
    assert_refused(
        &get(&mesh, "/api", Some(&t1)).await,
        401,
        "Jwks doesn't have key to match kid or alg from Jwt",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_jwks_server_fails_the_request() {
    let web = header_echo().await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let signer = Signer::new();
    let p = provider(remote("jwks", Duration::from_secs(60)));
    let mesh = Mesh::start_raw(|port| snapshot(port, p, web, Some(closed))).await;
    serving(&mesh).await;
    let t = signer.token("k1", claims("alice", "users", now() + 600));
    assert_refused(
        &get(&mesh, "/api", Some(&t)).await,
        401,
        "Jwks remote fetch is failed",
    );
    // A request without a token never needs the keys.
    assert_refused(&get(&mesh, "/api", None).await, 401, "Jwt is missing");
    assert_eq!(mesh.gw.stat_ending("jwt_authn.jwks_fetch_failed").await, 1);
}

/// Envoy Gateway's way: no `rules`, a `requirement_map`, and each route's `PerRouteConfig`
/// naming the requirement (or disabling the filter); the virtual host's word for routes
/// without their own. A name the map does not hold is Envoy's 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_route_config_names_the_requirement_or_disables_it() {
    let web = header_echo().await;
    let signer = Signer::new();
    let p = provider(local(signer.jwks("k1")));
    let per_route = |s: jpb::per_route_config::RequirementSpecifier| {
        any(jpb::PerRouteConfig {
            requirement_specifier: Some(s),
        })
    };
    use jpb::per_route_config::RequirementSpecifier as S;
    let mesh = Mesh::start_raw(|port| {
        let jwt = jpb::JwtAuthentication {
            providers: [("origins".to_string(), p)].into(),
            requirement_map: [(
                "need-origins".to_string(),
                jpb::JwtRequirement {
                    requires_type: Some(jpb::jwt_requirement::RequiresType::ProviderName(
                        "origins".into(),
                    )),
                },
            )]
            .into(),
            ..Default::default()
        };
        let mut h = hcm(port);
        let router = h.http_filters.pop().expect("router");
        h.http_filters = vec![filter("envoy.filters.http.jwt_authn", jwt), router];
        let with = |mut r: rpb::Route, s: S| {
            r.typed_per_filter_config
                .insert("envoy.filters.http.jwt_authn".into(), per_route(s));
            r
        };
        let mut vh = vhost(
            "all",
            &["*"],
            vec![
                with(
                    rt(prefix("/secure"), to_cluster("web")),
                    S::RequirementName("need-origins".into()),
                ),
                with(rt(prefix("/open"), to_cluster("web")), S::Disabled(true)),
                with(rt(prefix("/public"), to_cluster("web")), S::Disabled(true)),
                with(
                    rt(prefix("/wrong"), to_cluster("web")),
                    S::RequirementName("nope".into()),
                ),
                rt(prefix("/"), to_cluster("web")),
            ],
        );
        vh.typed_per_filter_config.insert(
            "envoy.filters.http.jwt_authn".into(),
            per_route(S::RequirementName("need-origins".into())),
        );
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(&route_name(port), vec![vh])],
            clusters: vec![eds_cluster("web")],
            endpoints: vec![cla("web", &[web])],
            ..Default::default()
        }
    })
    .await;
    serving(&mesh).await;
    let good = signer.token("k1", claims("alice", "users", now() + 600));

    let r = get(&mesh, "/secure", None).await;
    assert_eq!((r.status, r.body.as_str()), (401, "Jwt is missing"));
    let r = get(&mesh, "/secure", Some(&good)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-req-x-jwt-sub"), Some("alice"));
    assert_eq!(get(&mesh, "/open", None).await.status, 200);
    // The virtual host's word, for a route with none of its own.
    let r = get(&mesh, "/elsewhere", None).await;
    assert_eq!((r.status, r.body.as_str()), (401, "Jwt is missing"));
    assert_eq!(get(&mesh, "/elsewhere", Some(&good)).await.status, 200);
    let r = get(&mesh, "/wrong", Some(&good)).await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (
            403,
            "Failed JWT authentication: Wrong requirement_name: nope. It should be one of [need-origins]"
        )
    );
}
