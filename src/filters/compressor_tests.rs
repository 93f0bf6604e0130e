use super::*;

fn filter(algorithm: Algorithm, first: bool) -> CompressorFilter {
    CompressorFilter {
        name: format!("c.{}", algorithm.as_str()),
        algorithm,
        level: 3,
        enabled: true,
        min_length: 30,
        content_types: ContentTypes::List(DEFAULT_TYPES.iter().map(|s| s.to_string()).collect()),
        disable_on_etag: false,
        weaken_etag: false,
        remove_accept_encoding: false,
        uncompressible_codes: vec![206],
        choose_first: first,
        stats: Default::default(),
    }
}

fn chosen(accept: &str) -> Decision {
    let (b, z, g) = (
        filter(Algorithm::Brotli, false),
        filter(Algorithm::Zstd, false),
        filter(Algorithm::Gzip, false),
    );
    choose(&[&b, &z, &g], accept, Some("text/plain"))
}

#[test]
fn negotiation_as_envoy() {
    assert_eq!(chosen("gzip"), Decision::Valid("gzip".into()));
    // Equal q: the client's first.
    assert_eq!(
        chosen("deflate, gzip, br, zstd"),
        Decision::Valid("gzip".into())
    );
    assert_eq!(chosen("gzip;q=0.5, br;q=0.8"), Decision::Valid("br".into()));
    // `*` takes the first registered.
    assert_eq!(chosen("*"), Decision::Wildcard("br".into()));
    assert_eq!(chosen("br;q=0, *"), Decision::Wildcard("zstd".into()));
    assert_eq!(chosen("identity"), Decision::Identity);
    assert_eq!(chosen("deflate"), Decision::NotValid);
    assert_eq!(chosen("gzip;q=0"), Decision::NotValid);
    assert_eq!(chosen(""), Decision::NotValid);
    // choose_first wins a tie.
    let (b, g) = (
        filter(Algorithm::Brotli, true),
        filter(Algorithm::Gzip, false),
    );
    assert_eq!(
        choose(&[&g, &b], "gzip, br", Some("text/plain")),
        Decision::Valid("br".into())
    );
    // A filter whose content types exclude the response is not a candidate.
    let mut js_only = filter(Algorithm::Brotli, false);
    js_only.content_types = ContentTypes::List(vec!["application/javascript".into()]);
    let g = filter(Algorithm::Gzip, false);
    assert_eq!(
        choose(&[&js_only, &g], "br, gzip", Some("text/plain")),
        Decision::Valid("gzip".into())
    );
}

fn response(headers: &[(&str, &str)]) -> pingora_http::ResponseHeader {
    let mut r = pingora_http::ResponseHeader::build(200, None).expect("response");
    for (k, v) in headers {
        r.append_header(k.to_string(), *v).expect("header");
    }
    r
}

fn run(accept: Option<&str>, resp: &mut pingora_http::ResponseHeader) -> bool {
    let filters = vec![
        HttpFilter::Compressor(filter(Algorithm::Brotli, false)),
        HttpFilter::Compressor(filter(Algorithm::Gzip, false)),
    ];
    let mut st = CompressState {
        accept_encoding: accept.map(str::to_string),
        encoder: None,
    };
    response_headers(&filters, &mut st, resp, false);
    st.encoder.is_some()
}

#[test]
fn headers_of_a_compressed_response() {
    let mut r = response(&[
        ("content-type", "text/plain; charset=utf-8"),
        ("content-length", "100"),
        ("etag", "\"abc\""),
        ("vary", "origin"),
    ]);
    assert!(run(Some("gzip"), &mut r));
    assert_eq!(r.headers["content-encoding"], "gzip");
    assert!(r.headers.get("content-length").is_none());
    assert!(r.headers.get("etag").is_none());
    assert_eq!(r.headers["vary"], "origin, Accept-Encoding");

    let mut weak = response(&[("content-type", "text/html"), ("etag", "W/\"abc\"")]);
    assert!(run(Some("br"), &mut weak));
    assert_eq!(weak.headers["etag"], "W/\"abc\"");
    assert_eq!(weak.headers["content-encoding"], "br");
}

#[test]
fn responses_left_alone() {
    for (accept, headers) in [
        (None, vec![("content-type", "text/plain")]),
        (Some("gzip"), vec![("content-type", "image/png")]),
        (
            Some("gzip"),
            vec![("content-type", "text/plain"), ("content-length", "29")],
        ),
        (
            Some("gzip"),
            vec![("content-type", "text/plain"), ("content-encoding", "br")],
        ),
        (
            Some("gzip"),
            vec![
                ("content-type", "text/plain"),
                ("cache-control", "public, no-transform"),
            ],
        ),
    ] {
        let mut r = response(&headers);
        assert!(!run(accept, &mut r), "{accept:?} {headers:?}");
        assert!(r.headers.get("vary").is_none());
    }
    let mut partial = pingora_http::ResponseHeader::build(206, None).expect("response");
    partial
        .append_header("content-type", "text/plain")
        .expect("header");
    assert!(!run(Some("gzip"), &mut partial));
}

#[test]
fn a_stream_compresses_and_decodes_back() {
    let mut r = response(&[("content-type", "text/plain")]);
    let filters = vec![HttpFilter::Compressor(filter(Algorithm::Gzip, false))];
    let mut st = CompressState {
        accept_encoding: Some("gzip".into()),
        encoder: None,
    };
    response_headers(&filters, &mut st, &mut r, false);
    let mut out = Vec::new();
    for piece in ["hello ", "compressed ", "world"] {
        out.extend_from_slice(&st.body(piece.as_bytes(), false).expect("encoded"));
    }
    out.extend_from_slice(&st.body(b"", true).expect("finished"));
    let mut d = flate2::read::GzDecoder::new(out.as_slice());
    let mut text = String::new();
    std::io::Read::read_to_string(&mut d, &mut text).expect("gzip decodes");
    assert_eq!(text, "hello compressed world");
}
