//! An HTTP/1 upstream's response framing held to what Envoy's HTTP/1 codec accepts.
//!
//! pingora's client session is lenient where Envoy's codec is strict: it reads a body by the
//! last transfer coding whatever comes before it, keeps one `Content-Length` of several, drops
//! the length when a transfer coding is there too, and relays a length or a transfer coding on
//! a 204. Envoy 1.40 answers each of those with a 502 (`upstream connect error or
//! disconnect/reset before headers. reset reason: protocol error`) and does not reuse the
//! connection; measured by relaying each response through it (`tests/conformance_http.rs`,
//! "odd upstream responses"):
//!
//! - `Transfer-Encoding` other than one field that says `chunked` (any case): a list, two
//!   fields, an empty value, `identity`, `gzip`; any `Transfer-Encoding` on a 1xx or a 204;
//! - a `Content-Length` on a 1xx or a 204 other than exactly `0` (that one is dropped);
//! - more than one `Content-Length` field (even equal ones), or one that is a list (`3, 3`)
//!   on any status but 304, whose length Envoy does not read (`3, 4` passes there; so does
//!   `abc`, which pingora's session refuses, as it does on every status);
//! - `Content-Length` together with `Transfer-Encoding`;
//! - a space or tab between a header name and its colon.
//!
//! What it accepts it relays as its codec writes it: the status line says `HTTP/1.1` when the
//! upstream said `HTTP/1.0`, and a transfer coding is written `chunked` (none on a 304, which
//! has no body).
//!
//! The last two need the bytes as they came, which pingora's session keeps only for the
//! exchanges of Portico's own loop (`h1_upstream`); the rest are read off the head pingora
//! parsed, on both loops.

use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderValue, Version};
use pingora_error::{Error, ErrorType, Result};
use pingora_http::ResponseHeader;

/// pingora's header count limit (`MAX_HEADERS`), for the second parse of a head it read.
const MAX_HEADERS: usize = 256;

/// The head of an HTTP/1 upstream's response made what Envoy relays, or the protocol error
/// Envoy answers it with. HTTP/2 heads are left alone (their framing is the codec's).
pub(crate) fn check_head(resp: &mut ResponseHeader) -> Result<()> {
    if !matches!(resp.version, Version::HTTP_10 | Version::HTTP_11) {
        return Ok(());
    }
    let status = resp.status.as_u16();
    let bodiless = status < 200 || status == 204;
    let mut codings = resp.headers.get_all(TRANSFER_ENCODING).iter();
    if let Some(coding) = codings.next() {
        if bodiless {
            return refuse("transfer encoding not allowed in 1xx or 204");
        }
        if codings.next().is_some() || !coding.as_bytes().eq_ignore_ascii_case(b"chunked") {
            return refuse("unsupported transfer encoding");
        }
        if status == 304 {
            resp.remove_header(&TRANSFER_ENCODING);
        } else if coding != "chunked" {
            resp.insert_header(TRANSFER_ENCODING, HeaderValue::from_static("chunked"))?;
        }
    }
    let mut lengths = resp.headers.get_all(CONTENT_LENGTH).iter();
    if let Some(length) = lengths.next() {
        let more = lengths.next().is_some();
        if bodiless {
            // Compared as text, as Envoy compares it: `00` is refused.
            if more || length != "0" {
                return refuse("content length not allowed in 1xx or 204");
            }
            resp.remove_header(&CONTENT_LENGTH);
        } else if more || (status != 304 && length.as_bytes().contains(&b',')) {
            return refuse("multiple content-length values");
        }
    }
    if resp.version == Version::HTTP_10 {
        resp.set_version(Version::HTTP_11);
    }
    Ok(())
}

/// Envoy's limits on an HTTP/1 upstream's response head (the cluster's
/// `common_http_protocol_options`): more than `fields` header fields, or a head (status line
/// through the blank line) of more than `bytes`, is a protocol error (Envoy 1.40 answers 502:
/// measured at 100 fields and 81,920 bytes, its defaults).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub fields: usize,
    pub bytes: usize,
}

impl Default for Limits {
    /// Envoy's defaults for HTTP/1.
    fn default() -> Limits {
        Limits {
            fields: 100,
            bytes: 80 * 1024,
        }
    }
}

impl Limits {
    /// A head of `fields` fields and `bytes` bytes as it came (the exchanges that read it know
    /// both).
    pub fn check(self, fields: usize, bytes: usize) -> Result<()> {
        if fields > self.fields {
            return refuse("too many response headers");
        }
        if bytes > self.bytes {
            return refuse("response headers too large");
        }
        Ok(())
    }

    /// `check` for a head pingora's loop parsed, whose bytes it does not keep: the size is the
    /// head as written back from its fields (`name: value` lines), which is the head as it
    /// came unless the upstream padded its values with spaces. HTTP/2 heads are the codec's.
    pub fn check_parsed(self, resp: &ResponseHeader) -> Result<()> {
        if !matches!(resp.version, Version::HTTP_10 | Version::HTTP_11) {
            return Ok(());
        }
        // `HTTP/1.1 200 ` and CRLF, the reason, the blank line; each field's `: ` and CRLF.
        let reason = resp
            .get_reason_phrase()
            .or_else(|| resp.status.canonical_reason())
            .map_or(0, str::len);
        let size = resp.headers.iter().fold(13 + reason + 2 + 2, |n, (k, v)| {
            n + k.as_str().len() + v.len() + 4
        });
        self.check(resp.headers.len(), size)
    }
}

/// What only the bytes of a head pingora's session parsed tell: a `Content-Length` it dropped
/// for a `Transfer-Encoding`, a space it allowed before a colon. `raw` holds one whole head.
pub(crate) fn check_raw(raw: &[u8]) -> Result<()> {
    let mut fields = [const { std::mem::MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    // pingora's parser config but for the spaces before a colon, which Envoy's refuses.
    let mut config = httparse::ParserConfig::default();
    config.allow_obsolete_multiline_headers_in_responses(true);
    match config.parse_response_with_uninit_headers(&mut resp, raw, &mut fields) {
        Ok(_) => {}
        Err(httparse::Error::HeaderName) => return refuse("invalid character in header name"),
        // What pingora's parser took and this one does not is not a name's space: pingora's
        // reading stands.
        Err(_) => return Ok(()),
    }
    let (mut length, mut coding) = (false, false);
    for h in resp.headers.iter() {
        length |= h.name.eq_ignore_ascii_case("content-length");
        coding |= h.name.eq_ignore_ascii_case("transfer-encoding");
    }
    if length && coding {
        return refuse("both content-length and transfer-encoding");
    }
    Ok(())
}

fn refuse(why: &'static str) -> Result<()> {
    let mut e = Error::explain(ErrorType::InvalidHTTPHeader, why);
    e.as_up();
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(version: Version, status: u16, fields: &[(&str, &str)]) -> ResponseHeader {
        let mut h = ResponseHeader::build(status, None).expect("status");
        h.set_version(version);
        for (k, v) in fields {
            h.append_header(k.to_string(), *v).expect("field");
        }
        h
    }

    type Fields<'a> = &'a [(&'a str, &'a str)];

    /// Each case: the status, the fields, and what comes of it: `None` for a refusal, else the
    /// fields that stay (`content-length`, `transfer-encoding`) in order.
    #[test]
    fn heads_are_refused_or_relayed_as_envoy_does() {
        let v11 = Version::HTTP_11;
        #[rustfmt::skip]
        let cases: &[(u16, Fields, Option<Fields>)] = &[
            (200, &[("content-length", "3")], Some(&[("content-length", "3")])),
            (200, &[("content-length", "03")], Some(&[("content-length", "03")])),
            (200, &[("content-length", "3"), ("content-length", "3")], None),
            (200, &[("content-length", "3, 3")], None),
            (200, &[("transfer-encoding", "chunked")], Some(&[("transfer-encoding", "chunked")])),
            (200, &[("transfer-encoding", "CHUNKED")], Some(&[("transfer-encoding", "chunked")])),
            (200, &[("transfer-encoding", "gzip, chunked")], None),
            (200, &[("transfer-encoding", "chunked, chunked")], None),
            (200, &[("transfer-encoding", "chunked,")], None),
            (200, &[("transfer-encoding", "identity")], None),
            (200, &[("transfer-encoding", "")], None),
            (200, &[("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")], None),
            (205, &[("transfer-encoding", "chunked")], Some(&[("transfer-encoding", "chunked")])),
            (204, &[("content-length", "0")], Some(&[])),
            (204, &[("content-length", "00")], None),
            (204, &[("content-length", "3")], None),
            (204, &[("content-length", "0"), ("content-length", "0")], None),
            (204, &[("transfer-encoding", "chunked")], None),
            (100, &[("content-length", "5")], None),
            (103, &[("content-length", "0")], Some(&[])),
            (304, &[("content-length", "3")], Some(&[("content-length", "3")])),
            (304, &[("content-length", "3, 3")], Some(&[("content-length", "3, 3")])),
            (304, &[("content-length", "3, 4")], Some(&[("content-length", "3, 4")])),
            (304, &[("content-length", "3"), ("content-length", "3")], None),
            (304, &[("transfer-encoding", "chunked")], Some(&[])),
            (304, &[("transfer-encoding", "gzip")], None),
        ];
        for (status, fields, want) in cases {
            let mut h = head(v11, *status, fields);
            let got = check_head(&mut h).ok().map(|()| {
                h.headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").to_string()))
                    .collect::<Vec<_>>()
            });
            let want = want.map(|w| {
                w.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<Vec<_>>()
            });
            assert_eq!(got, want, "{status} {fields:?}");
        }
    }

    #[test]
    fn a_refusal_is_an_upstream_protocol_error() {
        let mut h = head(Version::HTTP_11, 204, &[("content-length", "3")]);
        let e = check_head(&mut h).expect_err("refused");
        assert_eq!(*e.etype(), ErrorType::InvalidHTTPHeader);
        assert_eq!(*e.esource(), pingora_error::ErrorSource::Upstream);
    }

    #[test]
    fn http10_is_relayed_as_http11_and_http2_is_left_alone() {
        let mut h = head(Version::HTTP_10, 200, &[("content-length", "3")]);
        check_head(&mut h).expect("accepted");
        assert_eq!(h.version, Version::HTTP_11);
        // HTTP/2 framing is the codec's: nothing here applies.
        let mut h = head(Version::HTTP_2, 204, &[("content-length", "3")]);
        check_head(&mut h).expect("left alone");
        assert_eq!(h.version, Version::HTTP_2);
        assert!(h.headers.contains_key(CONTENT_LENGTH));
    }

    #[test]
    fn heads_beyond_the_clusters_limits_are_refused_at_envoys_bounds() {
        let envoy = Limits::default();
        let fields = |n: usize| {
            let mut h = ResponseHeader::build(200, None).expect("status");
            for i in 0..n {
                h.append_header(format!("x-h{i}"), "v").expect("field");
            }
            h
        };
        assert!(envoy.check_parsed(&fields(100)).is_ok());
        let e = envoy.check_parsed(&fields(101)).expect_err("101 fields");
        assert_eq!(*e.esource(), pingora_error::ErrorSource::Upstream);
        let more = Limits {
            fields: 200,
            ..envoy
        };
        assert!(more.check_parsed(&fields(101)).is_ok());
        // `HTTP/1.1 200 OK` with `x-big: <n>` and `content-length: 3`: Envoy 1.40 took n =
        // 81,873 (a head of 81,920 bytes) and refused 81,874.
        let big = |n: usize| {
            let mut h = ResponseHeader::build(200, None).expect("status");
            h.append_header("x-big", "a".repeat(n)).expect("field");
            h.append_header("content-length", "3").expect("field");
            h
        };
        assert!(envoy.check_parsed(&big(81873)).is_ok());
        assert!(envoy.check_parsed(&big(81874)).is_err());
        assert!(envoy.check(100, 81920).is_ok());
        assert!(envoy.check(101, 100).is_err());
        assert!(envoy.check(2, 81921).is_err());
        // HTTP/2 heads are the codec's.
        let mut h2 = fields(101);
        h2.set_version(Version::HTTP_2);
        assert!(envoy.check_parsed(&h2).is_ok());
    }

    #[test]
    fn raw_heads_are_refused_for_what_only_their_bytes_show() {
        #[rustfmt::skip]
        let cases: &[(&[u8], bool)] = &[
            (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n", true),
            (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", true),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", false),
            (b"HTTP/1.1 200 OK\r\nX-Bad : v\r\ncontent-length: 3\r\n\r\n", false),
            (b"HTTP/1.1 200 OK\r\nX-Bad\t: v\r\ncontent-length: 3\r\n\r\n", false),
            // A colon after a space inside a value is the value's.
            (b"HTTP/1.1 200 OK\r\nx: a :b\r\ncontent-length: 3\r\n\r\n", true),
            // A folded line, as pingora's parser and Envoy's take it.
            (b"HTTP/1.1 200 OK\r\nx: a\r\n b\r\ncontent-length: 3\r\n\r\n", true),
        ];
        for (raw, ok) in cases {
            assert_eq!(
                check_raw(raw).is_ok(),
                *ok,
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }
}
