use super::*;
use crate::filters::Connection;
use base64::Engine;
use envoy_types::pb::envoy::config::core::v3::DataSource;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, Ed25519KeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::json;

const NOW: u64 = 1_800_000_000;

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// A signer and the JWK of its public key.
enum Signer {
    Es256(EcdsaKeyPair),
    Ed(Ed25519KeyPair),
    Hs(Vec<u8>),
}

impl Signer {
    fn es256() -> Self {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        Signer::Es256(
            EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
                .unwrap(),
        )
    }
    fn ed() -> Self {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        Signer::Ed(Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap())
    }
    fn alg(&self) -> &'static str {
        match self {
            Signer::Es256(_) => "ES256",
            Signer::Ed(_) => "EdDSA",
            Signer::Hs(_) => "HS256",
        }
    }
    fn jwk(&self, kid: &str) -> serde_json::Value {
        match self {
            Signer::Es256(k) => {
                let p = k.public_key().as_ref();
                json!({"kty":"EC","crv":"P-256","kid":kid,"x":b64(&p[1..33]),"y":b64(&p[33..65])})
            }
            Signer::Ed(k) => {
                json!({"kty":"OKP","crv":"Ed25519","kid":kid,"x":b64(k.public_key().as_ref())})
            }
            Signer::Hs(s) => json!({"kty":"oct","kid":kid,"alg":"HS256","k":b64(s)}),
        }
    }
    fn token(&self, kid: &str, claims: serde_json::Value) -> String {
        let h = b64(json!({"alg": self.alg(), "kid": kid})
            .to_string()
            .as_bytes());
        let p = b64(claims.to_string().as_bytes());
        let msg = format!("{h}.{p}");
        let sig = match self {
            Signer::Es256(k) => k
                .sign(&SystemRandom::new(), msg.as_bytes())
                .unwrap()
                .as_ref()
                .to_vec(),
            Signer::Ed(k) => k.sign(msg.as_bytes()).as_ref().to_vec(),
            Signer::Hs(s) => ring::hmac::sign(
                &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, s),
                msg.as_bytes(),
            )
            .as_ref()
            .to_vec(),
        };
        format!("{msg}.{}", b64(&sig))
    }
}

fn jwks(keys: &[serde_json::Value]) -> String {
    json!({ "keys": keys }).to_string()
}

fn provider_cfg(issuer: &str, jwks: String) -> jpb::JwtProvider {
    jpb::JwtProvider {
        issuer: issuer.into(),
        audiences: vec!["api".into()],
        payload_in_metadata: "payload".into(),
        jwks_source_specifier: Some(jpb::jwt_provider::JwksSourceSpecifier::LocalJwks(
            DataSource {
                specifier: Some(Specifier::InlineString(jwks)),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

fn prefix_rule(prefix: &str, r: Option<jpb::JwtRequirement>) -> jpb::RequirementRule {
    jpb::RequirementRule {
        r#match: Some(rpb::RouteMatch {
            path_specifier: Some(rpb::route_match::PathSpecifier::Prefix(prefix.into())),
            ..Default::default()
        }),
        requirement_type: r.map(jpb::requirement_rule::RequirementType::Requires),
    }
}

fn by_name(n: &str) -> jpb::JwtRequirement {
    jpb::JwtRequirement {
        requires_type: Some(jpb::jwt_requirement::RequiresType::ProviderName(n.into())),
    }
}

fn allow_missing_or_failed() -> jpb::JwtRequirement {
    jpb::JwtRequirement {
        requires_type: Some(jpb::jwt_requirement::RequiresType::AllowMissingOrFailed(
            Default::default(),
        )),
    }
}

fn one_provider(p: jpb::JwtProvider) -> JwtAuthnFilter {
    let c = jpb::JwtAuthentication {
        providers: [("p".to_string(), p)].into(),
        rules: vec![
            prefix_rule("/open", None),
            prefix_rule("/", Some(by_name("p"))),
        ],
        ..Default::default()
    };
    translate("jwt", &c).expect("translates")
}

/// The filter's word, with the state it left.
fn run(
    f: &JwtAuthnFilter,
    path: &str,
    headers: &[(&str, &str)],
) -> (Result<(), LocalReply>, FilterState) {
    let mut h = http::HeaderMap::new();
    for (k, v) in headers {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    let view = RequestView {
        host: "example.com",
        authority: "example.com",
        path,
        method: "GET",
        scheme: "http",
        headers: &h,
    };
    let req = Request {
        server: None,
        view: &view,
        route: None,
        picked: None,
        conn: Connection::default(),
        upstreams: None,
        body: None,
    };
    let mut st = FilterState::default();
    let r = match f.decode_at(&req, &mut st, NOW) {
        Decision::Continue => Ok(()),
        Decision::Reply(r) => Err(r),
        other => panic!("{other:?}"),
    };
    (r, st)
}

fn good_claims() -> serde_json::Value {
    json!({"iss":"https://issuer","aud":"api","sub":"alice","exp":NOW + 600,"scope":"read write"})
}

#[test]
fn every_algorithm_family_verifies_and_rejects_a_bad_signature() {
    for s in [
        Signer::es256(),
        Signer::ed(),
        Signer::Hs(b"a shared secret of 32 bytes!!!!!".to_vec()),
    ] {
        let f = one_provider(provider_cfg("https://issuer", jwks(&[s.jwk("k1")])));
        let t = s.token("k1", good_claims());
        let (r, st) = run(&f, "/x", &[("authorization", &format!("Bearer {t}"))]);
        assert!(r.is_ok(), "{}: {r:?}", s.alg());
        let payload = st
            .metadata(NAMESPACE)
            .and_then(|m| m.get("payload"))
            .expect("payload");
        assert_eq!(payload["sub"], "alice");
        // The token's header is removed (forward: false).
        assert!(st
            .request_header_ops
            .contains(&HeaderOp::Remove(http::header::AUTHORIZATION)));

        let mut bad = t.clone();
        let last = bad.pop().unwrap();
        bad.push(if last == 'A' { 'B' } else { 'A' });
        let bad = format!("{}.{}", &t[..t.rfind('.').unwrap()], b64(&[7u8; 64]));
        let (r, _) = run(&f, "/x", &[("authorization", &format!("Bearer {bad}"))]);
        let r = r.unwrap_err();
        assert_eq!(
            (r.status, r.body.as_deref()),
            (401, Some(&b"Jwt verification fails"[..])),
            "{}",
            s.alg()
        );
        assert_eq!(r.details, "jwt_authn_access_denied{Jwt_verification_fails}");
        assert_eq!(
            r.headers,
            vec![(
                http::header::WWW_AUTHENTICATE,
                "Bearer realm=\"http://example.com/x\", error=\"invalid_token\"".to_string()
            )]
        );
    }
}

#[test]
fn envoys_failures_and_their_codes() {
    let s = Signer::es256();
    let f = one_provider(provider_cfg("https://issuer", jwks(&[s.jwk("k1")])));
    let with = |claims: serde_json::Value, kid: &str| {
        let t = s.token(kid, claims);
        run(&f, "/x?a=1", &[("authorization", &format!("Bearer {t}"))])
            .0
            .unwrap_err()
    };
    let missing = run(&f, "/x?a=1", &[]).0.unwrap_err();
    assert_eq!(missing.status, 401);
    assert_eq!(missing.body.as_deref(), Some(&b"Jwt is missing"[..]));
    assert_eq!(
        missing.headers[0].1,
        "Bearer realm=\"http://example.com/x?a=1\""
    );

    let mut c = good_claims();
    c["exp"] = json!(NOW - 61);
    assert_eq!(with(c, "k1").body.as_deref(), Some(&b"Jwt is expired"[..]));
    let mut c = good_claims();
    c["exp"] = json!(NOW - 59);
    assert!(
        run(
            &f,
            "/x",
            &[("authorization", &format!("Bearer {}", s.token("k1", c)))]
        )
        .0
        .is_ok(),
        "within the clock skew"
    );
    let mut c = good_claims();
    c["nbf"] = json!(NOW + 120);
    assert_eq!(
        with(c, "k1").body.as_deref(),
        Some(&b"Jwt not yet valid"[..])
    );
    let mut c = good_claims();
    c["iss"] = json!("https://other");
    assert_eq!(
        with(c, "k1").body.as_deref(),
        Some(&b"Jwt issuer is not configured"[..])
    );
    let mut c = good_claims();
    c["aud"] = json!(["web", "mobile"]);
    let r = with(c, "k1");
    assert_eq!(
        (r.status, r.body.as_deref()),
        (403, Some(&b"Audiences in Jwt are not allowed"[..]))
    );
    assert_eq!(
        with(good_claims(), "k2").body.as_deref(),
        Some(&b"Jwks doesn't have key to match kid or alg from Jwt"[..])
    );
    let r = run(&f, "/x", &[("authorization", "Bearer not-a-jwt")])
        .0
        .unwrap_err();
    assert_eq!(
        r.body.as_deref(),
        Some(&b"Jwt is not in the form of Header.Payload.Signature"[..])
    );
    assert_eq!(f.stats().denied.load(Relaxed), 7);
    assert_eq!(f.stats().allowed.load(Relaxed), 1);
    // No rule requires a token here.
    assert!(run(&f, "/open/x", &[]).0.is_ok());
}

#[test]
fn extraction_locations_prefixes_and_outputs() {
    let s = Signer::ed();
    let mut p = provider_cfg("https://issuer", jwks(&[s.jwk("")]));
    p.from_headers = vec![jpb::JwtHeader {
        name: "X-Token".into(),
        value_prefix: "Tok ".into(),
    }];
    p.from_params = vec!["jwt".into()];
    p.from_cookies = vec!["session".into()];
    p.forward = true;
    p.forward_payload_header = "x-jwt-payload".into();
    p.claim_to_headers = vec![jpb::JwtClaimToHeader {
        header_name: "x-sub".into(),
        claim_name: "sub".into(),
        ..Default::default()
    }];
    p.normalize_payload_in_metadata = Some(jpb::jwt_provider::NormalizePayload {
        space_delimited_claims: vec!["scope".into()],
    });
    let f = one_provider(p);
    let t = s.token("", good_claims());
    for (path, headers) in [
        ("/x".to_string(), vec![("x-token", format!("Tok   {t}"))]),
        (format!("/x?a=b&jwt={t}"), vec![]),
        (
            "/x".to_string(),
            vec![("cookie", format!("a=b; session={t}"))],
        ),
    ] {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (r, st) = run(&f, &path, &h);
        assert!(r.is_ok(), "{path} {headers:?}: {r:?}");
        let payload = t.split('.').nth(1).unwrap();
        assert_eq!(
            st.request_header_ops,
            vec![
                HeaderOp::Remove(HeaderName::from_static("x-jwt-payload")),
                HeaderOp::Remove(HeaderName::from_static("x-sub")),
                HeaderOp::Append(
                    HeaderName::from_static("x-jwt-payload"),
                    payload.parse().unwrap()
                ),
                HeaderOp::Append(HeaderName::from_static("x-sub"), "alice".parse().unwrap()),
            ]
        );
        let m = &st.metadata(NAMESPACE).unwrap()["payload"];
        assert_eq!(m["scope"], json!(["read", "write"]));
    }
    // The default Authorization location is not one of this provider's.
    assert_eq!(
        run(&f, "/x", &[("authorization", &format!("Bearer {t}"))])
            .0
            .unwrap_err()
            .body
            .as_deref(),
        Some(&b"Jwt is missing"[..])
    );
    // Default locations: the access_token parameter.
    let f = one_provider(provider_cfg("https://issuer", jwks(&[s.jwk("")])));
    assert!(run(&f, &format!("/x?access_token={t}"), &[]).0.is_ok());
    // Two tokens: both must verify.
    let bad = s.token(
        "",
        json!({"iss":"https://issuer","aud":"api","exp": NOW - 1000}),
    );
    let r = run(
        &f,
        &format!("/x?access_token={t}"),
        &[("authorization", &format!("Bearer {bad}"))],
    )
    .0;
    assert_eq!(r.unwrap_err().body.as_deref(), Some(&b"Jwt is expired"[..]));
}

#[test]
fn requirements_any_all_allow_missing_and_allow_failed() {
    let a = Signer::es256();
    let b = Signer::ed();
    let mut pa = provider_cfg("https://a", jwks(&[a.jwk("a")]));
    pa.from_headers = vec![jpb::JwtHeader {
        name: "x-a".into(),
        value_prefix: String::new(),
    }];
    let mut pb = provider_cfg("https://b", jwks(&[b.jwk("b")]));
    pb.from_headers = vec![jpb::JwtHeader {
        name: "x-b".into(),
        value_prefix: String::new(),
    }];
    use jpb::jwt_requirement::RequiresType as T;
    let any = |rs: Vec<jpb::JwtRequirement>| jpb::JwtRequirement {
        requires_type: Some(T::RequiresAny(jpb::JwtRequirementOrList {
            requirements: rs,
        })),
    };
    let all = |rs: Vec<jpb::JwtRequirement>| jpb::JwtRequirement {
        requires_type: Some(T::RequiresAll(jpb::JwtRequirementAndList {
            requirements: rs,
        })),
    };
    let allow_missing = jpb::JwtRequirement {
        requires_type: Some(T::AllowMissing(Default::default())),
    };
    let c = jpb::JwtAuthentication {
        providers: [("a".to_string(), pa), ("b".to_string(), pb)].into(),
        requirement_map: [("either".to_string(), any(vec![by_name("a"), by_name("b")]))].into(),
        rules: vec![
            prefix_rule("/any", Some(any(vec![by_name("a"), by_name("b")]))),
            prefix_rule("/all", Some(all(vec![by_name("a"), by_name("b")]))),
            prefix_rule("/optional", Some(any(vec![by_name("a"), allow_missing]))),
            prefix_rule("/failed-ok", Some(allow_missing_or_failed())),
            jpb::RequirementRule {
                r#match: Some(rpb::RouteMatch {
                    path_specifier: Some(rpb::route_match::PathSpecifier::Path("/named".into())),
                    ..Default::default()
                }),
                requirement_type: Some(jpb::requirement_rule::RequirementType::RequirementName(
                    "either".into(),
                )),
            },
        ],
        ..Default::default()
    };
    let f = translate("jwt", &c).unwrap();
    let ta = a.token("a", json!({"iss":"https://a","aud":"api","exp":NOW + 60}));
    let tb = b.token("b", json!({"iss":"https://b","aud":"api","exp":NOW + 60}));
    let expired = a.token("a", json!({"iss":"https://a","aud":"api","exp":NOW - 600}));
    let status = |path: &str, h: &[(&str, &str)]| match run(&f, path, h).0 {
        Ok(()) => "ok".to_string(),
        Err(r) => String::from_utf8_lossy(r.body.as_deref().unwrap_or_default()).into_owned(),
    };
    assert_eq!(status("/any", &[("x-b", &tb)]), "ok");
    assert_eq!(status("/named", &[("x-a", &ta)]), "ok");
    assert_eq!(status("/any", &[]), "Jwt is missing");
    assert_eq!(status("/any", &[("x-a", &expired)]), "Jwt is expired");
    assert_eq!(status("/all", &[("x-a", &ta)]), "Jwt is missing");
    assert_eq!(status("/all", &[("x-a", &ta), ("x-b", &tb)]), "ok");
    assert_eq!(status("/optional", &[]), "ok");
    assert_eq!(status("/optional", &[("x-a", &expired)]), "Jwt is expired");
    assert_eq!(status("/optional", &[("x-a", &ta)]), "ok");
    assert_eq!(status("/failed-ok", &[("x-a", &expired)]), "ok");
    let (r, st) = run(&f, "/failed-ok", &[("x-b", &tb)]);
    assert!(r.is_ok());
    assert!(
        st.metadata(NAMESPACE).is_some(),
        "a good token's payload is kept"
    );
    assert_eq!(status("/elsewhere", &[]), "ok");
}

#[test]
fn translation_refusals_name_the_field() {
    let s = Signer::es256();
    let mut remote = provider_cfg("i", String::new());
    remote.jwks_source_specifier = Some(jpb::jwt_provider::JwksSourceSpecifier::RemoteJwks(
        Default::default(),
    ));
    let c = jpb::JwtAuthentication {
        providers: [("r".to_string(), remote)].into(),
        ..Default::default()
    };
    assert_eq!(
        translate("jwt", &c).unwrap_err(),
        "providers['r'].remote_jwks.http_uri: is required"
    );
    let remote_with = |uri: &str, retry: bool| {
        let mut p = provider_cfg("i", String::new());
        p.jwks_source_specifier = Some(jpb::jwt_provider::JwksSourceSpecifier::RemoteJwks(
            jpb::RemoteJwks {
                http_uri: Some(envoy_types::pb::envoy::config::core::v3::HttpUri {
                    uri: uri.into(),
                    http_upstream_type: Some(
                        envoy_types::pb::envoy::config::core::v3::http_uri::HttpUpstreamType::Cluster(
                            "jwks".into(),
                        ),
                    ),
                    timeout: Some(envoy_types::pb::google::protobuf::Duration {
                        seconds: 1,
                        nanos: 0,
                    }),
                }),
                retry_policy: retry.then(Default::default),
                ..Default::default()
            },
        ));
        jpb::JwtAuthentication {
            providers: [("r".to_string(), p)].into(),
            ..Default::default()
        }
    };
    let f = translate(
        "jwt",
        &remote_with("http://keys.local:8080/jwks.json?v=1", false),
    )
    .expect("remote_jwks translates");
    match &f.providers[0].keys {
        Keys::Remote(r) => {
            assert_eq!(r.authority, "keys.local:8080");
            assert_eq!(r.path, "/jwks.json?v=1");
            assert_eq!(r.cluster, "jwks");
            assert_eq!(r.cache_duration, std::time::Duration::from_secs(600));
        }
        other => panic!("{other:?}"),
    }
    assert!(translate("jwt", &remote_with("keys.local/jwks", false))
        .unwrap_err()
        .contains("remote_jwks.http_uri.uri"));
    assert!(translate("jwt", &remote_with("http://k/jwks", true))
        .unwrap_err()
        .contains("remote_jwks.retry_policy"));

    let c = jpb::JwtAuthentication {
        providers: [("p".to_string(), provider_cfg("i", jwks(&[s.jwk("k")])))].into(),
        rules: vec![prefix_rule("/", Some(by_name("nope")))],
        ..Default::default()
    };
    assert_eq!(
        translate("jwt", &c).unwrap_err(),
        "rules[0].requires.provider_name: Wrong requirement: provider 'nope' is not in providers"
    );
    let c = jpb::JwtAuthentication {
        rules: vec![jpb::RequirementRule {
            r#match: Some(Default::default()),
            requirement_type: Some(jpb::requirement_rule::RequirementType::RequirementName(
                "x".into(),
            )),
        }],
        ..Default::default()
    };
    assert!(translate("jwt", &c)
        .unwrap_err()
        .starts_with("rules[0].match: only prefix"));

    // A JWKS without a usable key translates; its tokens fail as Envoy's do.
    let f = one_provider(provider_cfg("https://issuer", "not json".into()));
    let t = s.token("k", good_claims());
    let r = run(&f, "/x", &[("authorization", &format!("Bearer {t}"))])
        .0
        .unwrap_err();
    assert_eq!(
        r.body.as_deref(),
        Some(&b"Jwks doesn't have any valid public key"[..])
    );
}

#[test]
fn cors_preflight_bypassed() {
    let f = {
        let mut c = jpb::JwtAuthentication {
            providers: [("p".to_string(), provider_cfg("i", jwks(&[])))].into(),
            rules: vec![prefix_rule("/", Some(by_name("p")))],
            bypass_cors_preflight: true,
            ..Default::default()
        };
        c.stat_prefix = "s".into();
        translate("jwt", &c).unwrap()
    };
    let mut h = http::HeaderMap::new();
    h.insert("origin", "https://a".parse().unwrap());
    h.insert("access-control-request-method", "GET".parse().unwrap());
    let view = RequestView {
        host: "h",
        authority: "h",
        path: "/",
        method: "OPTIONS",
        scheme: "http",
        headers: &h,
    };
    let req = Request {
        server: None,
        view: &view,
        route: None,
        picked: None,
        conn: Connection::default(),
        upstreams: None,
        body: None,
    };
    assert!(matches!(
        f.decode_at(&req, &mut FilterState::default(), NOW),
        Decision::Continue
    ));
    assert_eq!(f.stats().cors_preflight_bypassed.load(Relaxed), 1);
}
