//! Unit tests for the downstream phase.

use super::*;

#[test]
fn downstream_remote_follows_envoys_xff_rules() {
    use crate::snapshot::listener::{Codec, Hcm, RouteSource};
    let hcm = |use_remote_address: bool, hops: u32| Hcm {
        stat_prefix: "p".into(),
        routes: RouteSource::Rds("r".into()),
        codec: Codec::Auto,
        use_remote_address,
        skip_xff_append: false,
        xff_num_trusted_hops: hops,
        generate_request_id: true,
        preserve_external_request_id: false,
        strip_any_host_port: false,
        strip_matching_host_port: false,
        server_name: "envoy".into(),
        server_header: Some(http::HeaderValue::from_static("envoy")),
        server_transformation: crate::snapshot::listener::ServerTransformation::Overwrite,
        via: None,
        always_set_request_id_in_response: false,
        suppress_envoy_headers: false,
        filters: Vec::new(),
        stream_idle_timeout: None,
        idle_timeout: None,
        max_stream_duration: None,
        conn_limits: Default::default(),
        h2: crate::snapshot::listener::H2Settings::from_proto(None, 60 * 1024).expect("defaults"),
        internal_ranges: Vec::new(),
        upgrades: Default::default(),
        xfcc: Default::default(),
        path: Default::default(),
        alpn: None,
        istio: Default::default(),
        underscores: Default::default(),
        max_request_headers_bytes: 60 * 1024,
        max_headers_count: 100,
        access_log: Default::default(),
        tracing: None,
        keep_header_case: false,
        allow_custom_methods: false,
    };
    let peer: Option<SocketAddr> = "127.0.0.1:5000".parse().ok();
    let mut h = http::HeaderMap::new();
    let ip = |a: Option<SocketAddr>| a.map(|a| a.to_string());
    // No XFF: the peer either way.
    assert_eq!(ip(downstream_remote(&h, peer, &hcm(false, 0))), ip(peer));
    h.insert(
        X_FORWARDED_FOR.clone(),
        http::HeaderValue::from_static("10.0.0.1, 10.0.0.2"),
    );
    // Without use_remote_address: the last entry (port 0), or `hops` back from it.
    assert_eq!(
        ip(downstream_remote(&h, peer, &hcm(false, 0))).as_deref(),
        Some("10.0.0.2:0")
    );
    assert_eq!(
        ip(downstream_remote(&h, peer, &hcm(false, 1))).as_deref(),
        Some("10.0.0.1:0")
    );
    // With use_remote_address: the peer, unless hops are trusted.
    assert_eq!(ip(downstream_remote(&h, peer, &hcm(true, 0))), ip(peer));
    assert_eq!(
        ip(downstream_remote(&h, peer, &hcm(true, 1))).as_deref(),
        Some("10.0.0.2:0")
    );
    // Too few entries or garbage: the peer.
    assert_eq!(ip(downstream_remote(&h, peer, &hcm(false, 5))), ip(peer));
    h.insert(
        X_FORWARDED_FOR.clone(),
        http::HeaderValue::from_static("junk"),
    );
    assert_eq!(ip(downstream_remote(&h, peer, &hcm(false, 0))), ip(peer));
    // Several XFF lines read as one list: the last entry of the last line, then back.
    h.insert(
        X_FORWARDED_FOR.clone(),
        http::HeaderValue::from_static("1.1.1.1, 2.2.2.2"),
    );
    h.append(
        X_FORWARDED_FOR.clone(),
        http::HeaderValue::from_static("3.3.3.3"),
    );
    assert_eq!(
        ip(downstream_remote(&h, peer, &hcm(false, 0))).as_deref(),
        Some("3.3.3.3:0")
    );
    assert_eq!(
        ip(downstream_remote(&h, peer, &hcm(false, 1))).as_deref(),
        Some("2.2.2.2:0")
    );
}

#[test]
fn hop_by_hop_headers_are_removed() {
    let mut h = RequestHeader::build("GET", b"/", None).expect("valid request");
    h.insert_header("connection", "close, x-private")
        .expect("valid");
    h.insert_header("x-private", "1").expect("valid");
    h.insert_header("keep-alive", "timeout=5").expect("valid");
    h.insert_header("te", "gzip, trailers").expect("valid");
    h.insert_header("x-keep", "1").expect("valid");
    strip_request(&mut h).expect("strip");
    assert!(h.headers.get("connection").is_none());
    assert!(h.headers.get("x-private").is_none());
    assert!(h.headers.get("keep-alive").is_none());
    assert_eq!(
        h.headers.get("te").and_then(|v| v.to_str().ok()),
        Some("trailers")
    );
    assert!(h.headers.get("x-keep").is_some());
}

#[test]
fn response_hop_by_hop_goes_as_removing_every_name_removes_it() {
    // The reference: every connection-level name removed whether present or not (a removal
    // reorders what is left, so the order is compared too).
    let reference = |resp: &mut ResponseHeader| {
        for n in ["connection", "keep-alive", "proxy-connection", "upgrade"] {
            resp.remove_header(n);
        }
    };
    let heads: [&[(&str, &str)]; 4] = [
        &[("Server", "nginx"), ("Content-Length", "3")],
        &[
            ("Server", "nginx"),
            ("Connection", "keep-alive"),
            ("X-A", "1"),
            ("Keep-Alive", "timeout=5"),
            ("Content-Length", "3"),
        ],
        &[
            ("Upgrade", "h2c"),
            ("Proxy-Connection", "x"),
            ("X-B", "2"),
            ("Connection", "upgrade"),
        ],
        &[("X-C", "3"), ("TE", "trailers"), ("Trailer", "x")],
    ];
    for head in heads {
        let build = || {
            let mut r = ResponseHeader::build(200, None).expect("resp");
            for (n, v) in head {
                r.append_header(n.to_string(), *v).expect("header");
            }
            r
        };
        let (mut ours, mut theirs) = (build(), build());
        strip_response(&mut ours);
        reference(&mut theirs);
        let wire = |r: &ResponseHeader| {
            let mut w = Vec::new();
            r.header_to_h1_wire(&mut w);
            String::from_utf8(w).expect("utf8")
        };
        assert_eq!(wire(&ours), wire(&theirs), "{head:?}");
    }
}

#[test]
fn split_port_takes_the_last_colon_or_the_one_after_a_bracket() {
    assert_eq!(split_port("a.b:80"), ("a.b", Some("80")));
    assert_eq!(split_port("127.0.0.1:19380"), ("127.0.0.1", Some("19380")));
    assert_eq!(split_port("a.b"), ("a.b", None));
    assert_eq!(split_port("a.b:"), ("a.b", Some("")));
    assert_eq!(split_port("[::1]:443"), ("[::1]", Some("443")));
    assert_eq!(split_port("[::1]"), ("[::1]", None));
    assert_eq!(split_port("[::1]:"), ("[::1]", Some("")));
    assert_eq!(split_port(""), ("", None));
    assert_eq!(split_port("ä:1"), ("ä", Some("1")));
}

#[test]
fn present_finds_what_a_lookup_finds_for_few_names_and_many() {
    // As long as `x-request-id`, another name.
    static XRJ: HeaderName = HeaderName::from_static("x-request-ie");
    let many: [&HeaderName; 6] = [
        &X_FORWARDED_PROTO,
        &X_REQUEST_ID,
        &XRJ,
        &http::header::HOST,
        &http::header::CONTENT_LENGTH,
        &http::header::TRANSFER_ENCODING,
    ];
    let heads: [&[&str]; 5] = [
        &[],
        &["host", "user-agent", "accept"],
        &["x-request-id", "x-request-id", "content-length"],
        // Same length as a name looked for, another name; a standard name's text as custom.
        &[
            "x-request-ie",
            "x-forwarded-prot",
            "transfer-encoding",
            "host",
        ],
        &["x-forwarded-proto", "a", "b", "c", "d", "e", "f", "g", "h"],
    ];
    for head in heads {
        let mut map = http::HeaderMap::new();
        for n in head {
            map.append(
                HeaderName::from_bytes(n.as_bytes()).expect("name"),
                http::HeaderValue::from_static("v"),
            );
        }
        let expected = many.map(|n| map.contains_key(n));
        assert_eq!(present(&map, &many), expected, "{head:?}");
        let few = [many[0], many[1], many[2], many[3]];
        assert_eq!(
            present(&map, &few),
            few.map(|n| map.contains_key(n)),
            "{head:?}"
        );
        assert_eq!(
            has(&map, &X_REQUEST_ID),
            map.contains_key(&X_REQUEST_ID),
            "{head:?}"
        );
    }
}

#[test]
fn known_methods_are_envoys_http1_list() {
    // Envoy's balsa parser's list, in its order.
    let envoy = [
        "ACL",
        "BIND",
        "CHECKOUT",
        "CONNECT",
        "COPY",
        "DELETE",
        "GET",
        "HEAD",
        "LINK",
        "LOCK",
        "MERGE",
        "MKACTIVITY",
        "MKCALENDAR",
        "MKCOL",
        "MOVE",
        "MSEARCH",
        "NOTIFY",
        "OPTIONS",
        "PATCH",
        "POST",
        "PROPFIND",
        "PROPPATCH",
        "PURGE",
        "PUT",
        "REBIND",
        "REPORT",
        "SEARCH",
        "SOURCE",
        "SUBSCRIBE",
        "TRACE",
        "UNBIND",
        "UNLINK",
        "UNLOCK",
        "UNSUBSCRIBE",
    ];
    for m in envoy {
        let method = http::Method::from_bytes(m.as_bytes()).expect("a method");
        assert!(known_method(&method), "{m}");
        // One letter more, fewer or in lower case is another method.
        for other in [format!("{m}X"), m[1..].to_string(), m.to_ascii_lowercase()] {
            if envoy.contains(&other.as_str()) {
                continue;
            }
            let method = http::Method::from_bytes(other.as_bytes()).expect("a method");
            assert!(!known_method(&method), "{other}");
        }
    }
    for other in ["M-SEARCH", "FOO", "G#T", "QUERY", "Get"] {
        let method = http::Method::from_bytes(other.as_bytes()).expect("a method");
        assert!(!known_method(&method), "{other}");
    }
}

#[test]
fn a_fragment_is_a_hash_in_the_target_only() {
    for (line, fragment) in [
        (&b"GET /a#b HTTP/1.1\r"[..], true),
        (b"GET /# HTTP/1.1", true),
        (b"GET /a?b#c HTTP/1.1", true),
        (b"G#T /a HTTP/1.1", false),
        (b"GET /a HTTP/1.1#", false),
        (b"GET /a%23 HTTP/1.1", false),
        // No version: the target runs to the line's end.
        (b"GET /a#b", true),
        (b"GET", false),
    ] {
        assert_eq!(
            fragment_in_target(line),
            fragment,
            "{}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn authority_characters_are_envoys() {
    // Every byte alone, and in a name: what Envoy's check takes (RFC 3986's characters for a
    // host and port, `@` and `%`), as the conformance tests found it answer.
    for b in 0u8..=255 {
        let valid = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@[]%".contains(&b);
        assert_eq!(authority_chars_valid(&[b]), valid, "{b:#x}");
        assert_eq!(
            authority_chars_valid(&[b'a', b, b'.', b'b']),
            valid,
            "{b:#x}"
        );
    }
    for ok in [
        &b"example.com:8080"[..],
        b"[::1]:80",
        b"a%20b",
        b"user@host",
        b"",
    ] {
        assert!(authority_chars_valid(ok), "{ok:?}");
    }
    for bad in [
        &b"a b"[..],
        b"a/b",
        b"a?b",
        b"a#b",
        b"a\"b",
        b"a\x80b",
        b"a\\b",
    ] {
        assert!(!authority_chars_valid(bad), "{bad:?}");
    }
}
