//! Hash policies: translation (every rejection), evaluation per kind, combination and terminal.

use super::*;
use envoy_types::pb::envoy::config::route::v3::route_action::hash_policy::{
    ConnectionProperties, Cookie, FilterState, Header, PolicySpecifier as P, QueryParameter,
};
use envoy_types::pb::envoy::config::route::v3::route_action::HashPolicy as Pb;
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatchAndSubstitute, RegexMatcher};

fn pb(spec: P, terminal: bool) -> Pb {
    Pb {
        policy_specifier: Some(spec),
        terminal,
    }
}

fn header(name: &str) -> P {
    P::Header(Header {
        header_name: name.into(),
        regex_rewrite: None,
    })
}

fn cookie(name: &str, ttl: Option<u64>) -> P {
    P::Cookie(Cookie {
        name: name.into(),
        ttl: ttl.map(|s| envoy_types::pb::google::protobuf::Duration {
            seconds: s as i64,
            nanos: 0,
        }),
        path: "/".into(),
        attributes: vec![],
    })
}

fn query(name: &str) -> P {
    P::QueryParameter(QueryParameter { name: name.into() })
}

fn source_ip(on: bool) -> P {
    P::ConnectionProperties(ConnectionProperties { source_ip: on })
}

struct Req {
    headers: http::HeaderMap,
    path: String,
    ip: Option<IpAddr>,
}

impl Req {
    fn new(headers: &[(&str, &str)], path: &str) -> Req {
        let mut h = http::HeaderMap::new();
        for (k, v) in headers {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                http::HeaderValue::from_str(v).expect("value"),
            );
        }
        Req {
            headers: h,
            path: path.into(),
            ip: Some([10, 1, 2, 3].into()),
        }
    }

    fn input(&self) -> HashInput<'_> {
        HashInput {
            headers: &self.headers,
            authority: "example.com",
            path: &self.path,
            method: "GET",
            scheme: "http",
            source_ip: self.ip,
        }
    }
}

fn hash_of(policies: &[Pb], req: &Req) -> Option<u64> {
    let p = translate(policies).expect("valid");
    generate(&p, &req.input(), |_| panic!("no cookie expected"))
}

#[test]
fn header_hash_is_xxhash_of_the_value_and_ignores_order() {
    let one = Req::new(&[("x-user", "alice")], "/");
    assert_eq!(
        hash_of(&[pb(header("X-User"), false)], &one),
        Some(xx64(b"alice", 0))
    );
    let ab = Req::new(&[("x-user", "a"), ("x-user", "b")], "/");
    let ba = Req::new(&[("x-user", "b"), ("x-user", "a")], "/");
    let h = hash_of(&[pb(header("x-user"), false)], &ab);
    assert_eq!(h, hash_of(&[pb(header("x-user"), false)], &ba));
    assert_eq!(h, Some(xx64(b"b", xx64(b"a", 0))));
    assert_eq!(hash_of(&[pb(header("x-other"), false)], &one), None);
    assert_eq!(
        hash_of(&[pb(header(":authority"), false)], &one),
        Some(xx64(b"example.com", 0))
    );
}

#[test]
fn header_regex_rewrite_applies_before_hashing() {
    let p = pb(
        P::Header(Header {
            header_name: "x-session".into(),
            regex_rewrite: Some(RegexMatchAndSubstitute {
                pattern: Some(RegexMatcher {
                    regex: "^(\\w+)-\\d+$".into(),
                    ..Default::default()
                }),
                substitution: "\\1".into(),
            }),
        }),
        false,
    );
    let a = Req::new(&[("x-session", "user-1")], "/");
    let b = Req::new(&[("x-session", "user-2")], "/");
    let p = std::slice::from_ref(&p);
    assert_eq!(hash_of(p, &a), Some(xx64(b"user", 0)));
    assert_eq!(hash_of(p, &a), hash_of(p, &b));
    assert_eq!(re2_substitution("\\1-$x\\\\"), "${1}-$$x\\");
}

#[test]
fn cookie_hash_reads_the_cookie_or_generates_one_with_a_ttl() {
    let with = Req::new(&[("cookie", "a=1; session=\"abc\"; z=2")], "/");
    assert_eq!(
        hash_of(&[pb(cookie("session", None), false)], &with),
        Some(xx64(b"abc", 0))
    );
    let without = Req::new(&[("cookie", "other=1")], "/");
    // No ttl: no cookie, no hash.
    assert_eq!(
        hash_of(&[pb(cookie("session", None), false)], &without),
        None
    );
    // A ttl: a cookie is generated and its value hashed.
    let p = translate(&[pb(cookie("session", Some(3600)), false)]).expect("valid");
    let mut set = Vec::new();
    let h = generate(&p, &without.input(), |c| {
        let v = generated_cookie("10.1.2.3:5555", "10.0.0.1:8080");
        set.push(set_cookie_value(c, &v));
        v
    });
    let value = generated_cookie("10.1.2.3:5555", "10.0.0.1:8080");
    assert_eq!(value.len(), 16);
    assert_eq!(h, Some(xx64(value.as_bytes(), 0)));
    assert_eq!(
        set,
        vec![format!(
            "session=\"{value}\"; Max-Age=3600; Path=/; HttpOnly"
        )]
    );
    // Sending that cookie back hashes the same.
    let back = Req::new(&[("cookie", &format!("session=\"{value}\""))], "/");
    assert_eq!(
        hash_of(&[pb(cookie("session", Some(3600)), false)], &back),
        h
    );
}

#[test]
fn set_cookie_omits_zero_max_age_and_empty_path_and_adds_attributes() {
    let c = CookiePolicy {
        name: "s".into(),
        path: String::new(),
        ttl: Some(Duration::ZERO),
        attributes: vec![
            ("SameSite".into(), "Lax".into()),
            ("Secure".into(), String::new()),
        ],
    };
    assert_eq!(
        set_cookie_value(&c, "v"),
        "s=\"v\"; SameSite=Lax; Secure; HttpOnly"
    );
}

#[test]
fn cookie_parsing() {
    let h = Req::new(
        &[("cookie", "a=1;b=2"), ("cookie", " c = 3; d=\"4\"; e=")],
        "/",
    )
    .headers;
    assert_eq!(cookie_value(&h, "a"), Some("1"));
    assert_eq!(cookie_value(&h, "b"), Some("2"));
    assert_eq!(cookie_value(&h, "d"), Some("4"));
    assert_eq!(cookie_value(&h, "e"), Some(""));
    assert_eq!(cookie_value(&h, "c"), None, "the name is compared as sent");
}

#[test]
fn query_parameter_and_source_ip() {
    let r = Req::new(&[], "/p?x=1&user=bob&user=eve&flag");
    assert_eq!(
        hash_of(&[pb(query("user"), false)], &r),
        Some(xx64(b"bob", 0))
    );
    assert_eq!(hash_of(&[pb(query("flag"), false)], &r), Some(xx64(b"", 0)));
    assert_eq!(hash_of(&[pb(query("none"), false)], &r), None);
    assert_eq!(
        hash_of(&[pb(source_ip(true), false)], &r),
        Some(xx64(b"10.1.2.3", 0))
    );
    let mut v6 = Req::new(&[], "/");
    v6.ip = Some(std::net::Ipv6Addr::LOCALHOST.into());
    assert_eq!(
        hash_of(&[pb(source_ip(true), false)], &v6),
        Some(xx64(b"::1", 0))
    );
    // source_ip: false adds no policy at all, as in Envoy.
    assert!(translate(&[pb(source_ip(false), true)])
        .expect("valid")
        .is_empty());
}

#[test]
fn filter_state_never_hashes() {
    let p = pb(P::FilterState(FilterState { key: "k".into() }), false);
    assert_eq!(hash_of(&[p], &Req::new(&[], "/")), None);
}

#[test]
fn policies_combine_by_rotate_and_xor_and_terminal_stops() {
    let r = Req::new(&[("x-a", "1"), ("x-b", "2")], "/");
    let (a, b) = (xx64(b"1", 0), xx64(b"2", 0));
    assert_eq!(
        hash_of(&[pb(header("x-a"), false), pb(header("x-b"), false)], &r),
        Some(a.rotate_left(1) ^ b)
    );
    // Two identical policies do not cancel out.
    assert_eq!(
        hash_of(&[pb(header("x-a"), false), pb(header("x-a"), false)], &r),
        Some(a.rotate_left(1) ^ a)
    );
    // A terminal policy that hashed ends the list.
    assert_eq!(
        hash_of(&[pb(header("x-a"), true), pb(header("x-b"), false)], &r),
        Some(a)
    );
    // A terminal policy that found nothing does not end it...
    assert_eq!(
        hash_of(&[pb(header("x-none"), true), pb(header("x-b"), false)], &r),
        Some(b)
    );
    // ...unless an earlier policy already hashed.
    assert_eq!(
        hash_of(
            &[
                pb(header("x-a"), false),
                pb(header("x-none"), true),
                pb(header("x-b"), false)
            ],
            &r
        ),
        Some(a)
    );
    assert_eq!(hash_of(&[], &r), None);
}

#[test]
fn every_rejection_reason() {
    let bad_regex = P::Header(Header {
        header_name: "x".into(),
        regex_rewrite: Some(RegexMatchAndSubstitute {
            pattern: Some(RegexMatcher {
                regex: "(".into(),
                ..Default::default()
            }),
            substitution: String::new(),
        }),
    });
    let no_pattern = P::Header(Header {
        header_name: "x".into(),
        regex_rewrite: Some(RegexMatchAndSubstitute::default()),
    });
    let empty_pattern = P::Header(Header {
        header_name: "x".into(),
        regex_rewrite: Some(RegexMatchAndSubstitute {
            pattern: Some(RegexMatcher::default()),
            substitution: String::new(),
        }),
    });
    let bad_ttl = P::Cookie(Cookie {
        name: "c".into(),
        ttl: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: -1,
            nanos: 0,
        }),
        ..Default::default()
    });
    let bad_attr = P::Cookie(Cookie {
        name: "c".into(),
        attributes: vec![Default::default()],
        ..Default::default()
    });
    let cases: Vec<(Pb, &str)> = vec![
        (pb(header(""), false), "header.header_name must not be empty"),
        (
            pb(header("a\nb"), false),
            "header.header_name 'a\\nb' is not a valid header name",
        ),
        (
            pb(bad_regex, false),
            "header.regex_rewrite: invalid regex '(':",
        ),
        (pb(no_pattern, false), "header.regex_rewrite.pattern is required"),
        (
            pb(empty_pattern, false),
            "header.regex_rewrite.pattern.regex must not be empty",
        ),
        (pb(cookie("", None), false), "cookie.name must not be empty"),
        (pb(bad_ttl, false), "cookie.ttl: invalid duration"),
        (pb(bad_attr, false), "cookie.attributes[0].name must not be empty"),
        (pb(query(""), false), "query_parameter.name must not be empty"),
        (
            pb(P::FilterState(FilterState { key: String::new() }), false),
            "filter_state.key must not be empty",
        ),
        (
            Pb {
                policy_specifier: None,
                terminal: false,
            },
            "one of header, cookie, connection_properties, query_parameter or filter_state is required",
        ),
    ];
    for (p, want) in cases {
        let err = translate(&[pb(header("ok"), false), p]).expect_err(want);
        assert!(
            err.starts_with("hash_policy[1]: ") && err.contains(want),
            "{err:?} does not say {want:?}"
        );
    }
}
