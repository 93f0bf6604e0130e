//! Header case as Envoy sends it upstream, and header writes that cost what a map insert costs.
//!
//! Envoy's HTTP/1 codec keeps header names lower case and writes them so, unless the
//! connection manager's `http_protocol_options.header_key_format` asks for something else.
//! pingora keeps every HTTP/1 name as received, in a second map beside the values, and its
//! `insert_header` / `append_header` pay for that on every call, case kept or not: the name is
//! turned into a case-keeping copy, parsed back into a `HeaderName` (an allocation for a custom
//! name) and inserted into both maps, 1-2k instructions where one map insert is a few hundred.
//!
//! So a request Portico's own HTTP/1 loop serves, when the connection manager asks for no
//! `header_key_format`, drops the case pingora read ([`drop_case`]); [`SetHeader`] inserts a
//! `HeaderName` the caller already has straight into the one map such a head holds, and
//! [`request_wire`] writes the names lower case, as Envoy does, unless the request kept their
//! case and the cluster has a `header_key_format` too (Envoy keeps case end to end only with a
//! formatter on both sides; istiod's preserve-case option sets both). `proper_case_words` is
//! taken as "keep the case": Envoy would capitalise each word. Where pingora's client session
//! writes the request (a TLS upstream), it writes a head without case as it does an HTTP/2
//! client's: the names it knows capitalised (`Host`), the rest lower case. Responses keep the
//! case they came with: pingora's downstream writer cannot lower the names it knows, and in a
//! mesh the upstream is a sidecar that sends them lower case already. The names the gateway
//! itself adds (`server`, `x-envoy-upstream-service-time`) go lower case, as Envoy writes them,
//! into a head that keeps case too.

use http::{HeaderName, HeaderValue};
use pingora_error::{Error, ErrorType, OrErr, Result};
use pingora_http::{RequestHeader, ResponseHeader};

/// Inserts and appends by a `HeaderName` the caller has: a static (the gateway's own headers)
/// or one from config (`set_name` / `add_name`).
pub(crate) trait SetHeader {
    /// `insert_header`: replaces every value under `name`.
    fn set(&mut self, name: &'static HeaderName, value: impl TryInto<HeaderValue>) -> Result<()>;
    /// `append_header`: adds a value under `name`, keeping those there.
    fn add(&mut self, name: &'static HeaderName, value: impl TryInto<HeaderValue>) -> Result<()>;
    /// `set` by a name that is not static.
    fn set_name(&mut self, name: &HeaderName, value: impl TryInto<HeaderValue>) -> Result<()>;
    /// `add` by a name that is not static.
    fn add_name(&mut self, name: &HeaderName, value: impl TryInto<HeaderValue>) -> Result<()>;
    /// `set` of several headers in order, the head taken apart once for all of them.
    fn set_all<V: TryInto<HeaderValue>>(
        &mut self,
        headers: impl IntoIterator<Item = (&'static HeaderName, V)>,
    ) -> Result<()>;
}

fn value(v: impl TryInto<HeaderValue>) -> Result<HeaderValue> {
    v.try_into()
        .map_err(|_| Error::explain(ErrorType::InvalidHTTPHeader, "invalid header value"))
}

/// A head pingora's own conversions rebuild without loss: no case kept, and (requests) a
/// target the URI reproduces and the default `send_end_stream`, (responses) the standard
/// reason phrase. Converting such a head into its `http` parts and back is a move.
fn plain_request(req: &RequestHeader) -> bool {
    !req.has_case() && rebuildable(req)
}

/// A request head whose parts are all its `http` parts, case aside: a target the URI
/// reproduces and the default `send_end_stream`.
fn rebuildable(req: &RequestHeader) -> bool {
    req.send_end_stream() != Some(false) && target_from_uri(req)
}

/// Whether `raw_path` is read from the URI (origin- and asterisk-form) rather than from a
/// verbatim copy of the target (absolute-form, CONNECT, bytes that are not UTF-8), which a
/// rebuild from the URI would lose.
fn target_from_uri(req: &RequestHeader) -> bool {
    req.uri
        .path_and_query()
        .is_some_and(|pq| std::ptr::eq(pq.as_str().as_ptr(), req.raw_path().as_ptr()))
}

fn plain_response(resp: &ResponseHeader) -> bool {
    !resp.has_case() && resp.get_reason_phrase() == resp.status.canonical_reason()
}

/// A request or response head, taken apart into its `http` parts (a move, for a head
/// `plain` says pingora rebuilds without loss) to reach its one map, or written through
/// pingora's own methods.
trait OneMap {
    fn plain(&self) -> bool;
    fn with_map(&mut self, f: impl FnOnce(&mut http::HeaderMap) -> Result<()>) -> Result<()>;
    /// The one map of a head without case, in place (`parts_mut`).
    fn map_mut(&mut self) -> Option<&mut http::HeaderMap>;
    fn pingora_put(&mut self, name: Name, v: HeaderValue, append: bool) -> Result<()>;
}

macro_rules! one_map {
    ($head:ty, $parts:ty, $plain:ident) => {
        impl OneMap for $head {
            fn plain(&self) -> bool {
                $plain(self)
            }

            // Inlined: out of line, the head moves through the call (two more copies of a
            // few hundred bytes a write; measured +470 instructions a request when the
            // compiler stopped inlining it).
            #[inline(always)]
            fn with_map(
                &mut self,
                f: impl FnOnce(&mut http::HeaderMap) -> Result<()>,
            ) -> Result<()> {
                // Moved out and back in place: a placeholder to swap in cost more than the
                // insert (built, then dropped, ~500 instructions a write). A panic between
                // the two moves aborts (the head would be gone); `f` is one map insert.
                replace_with::replace_with_or_abort_and_return(self, |head| {
                    let mut parts = <$parts>::from(head);
                    let out = f(&mut parts.headers);
                    (out, <$head>::from(parts))
                })
            }

            fn map_mut(&mut self) -> Option<&mut http::HeaderMap> {
                if self.has_case() {
                    return None;
                }
                parts_mut::<$head, $parts>(self).map(|p| &mut p.headers)
            }

            fn pingora_put(&mut self, name: Name, v: HeaderValue, append: bool) -> Result<()> {
                // By a static name's text: pingora keeps a `HeaderName`'s case as a titled
                // copy (`Server`, and an allocation for a name it does not know), and a
                // `&'static str` as it is, lower case, as Envoy writes the headers it adds.
                match (name, append) {
                    (Name::Static(n), true) => self.append_header(n.as_str(), v).map(|_| ()),
                    (Name::Static(n), false) => self.insert_header(n.as_str(), v),
                    (Name::Other(n), true) => self.append_header(n.clone(), v).map(|_| ()),
                    (Name::Other(n), false) => self.insert_header(n.clone(), v),
                }
            }
        }
    };
}

/// The `http` parts a pingora head keeps inside itself, for writing to its map in place.
///
/// pingora gives out only `&Parts` (`Deref`), so that its case map and raw target stay in step
/// with the parts; a head without case has no case map to keep in step, and writes to its map
/// touch neither its target nor its reason phrase. Taking such a head apart and rebuilding it
/// through pingora's own conversions (`with_map`) does the same write at the cost of two moves
/// of the whole head and a rebuild (about 450 instructions a write, three writes a request).
///
/// Where the parts lie is read off `Deref` itself, not assumed: only parts wholly inside the
/// head's own bytes (so a field of it; distinct objects do not overlap) are written in place,
/// and otherwise the caller takes the head apart as before.
fn parts_mut<H: std::ops::Deref<Target = P>, P>(head: &mut H) -> Option<&mut P> {
    let offset = {
        let shared: &H = head;
        let parts: &P = shared;
        (parts as *const P as usize).checked_sub(shared as *const H as usize)?
    };
    if std::mem::size_of::<P>() == 0
        || offset.checked_add(std::mem::size_of::<P>())? > std::mem::size_of::<H>()
    {
        return None;
    }
    // SAFETY: `offset` is where `Deref` found a `P` inside `*head`'s bytes (checked above), so
    // the pointer is in bounds of the object `head` uniquely borrows, aligned and initialised
    // as that `P` is; the returned borrow is tied to `head`'s, so nothing else reads or writes
    // the head meanwhile.
    Some(unsafe { &mut *(head as *mut H).cast::<u8>().add(offset).cast::<P>() })
}

one_map!(RequestHeader, http::request::Parts, plain_request);
one_map!(ResponseHeader, http::response::Parts, plain_response);

/// A header name to write: a static one's text lives as long as pingora's case map.
#[derive(Clone, Copy)]
enum Name<'a> {
    Static(&'static HeaderName),
    Other(&'a HeaderName),
}

impl Name<'_> {
    fn header(&self) -> &HeaderName {
        match self {
            Name::Static(n) => n,
            Name::Other(n) => n,
        }
    }
}

/// Writes `headers` in order: through pingora's methods into a head that keeps case, else into
/// its one map with the head taken apart once for all of them. A value that is not a valid
/// header value stops the writes there, those before it made.
fn put<'a, H: OneMap>(
    head: &mut H,
    headers: impl IntoIterator<Item = Result<(Name<'a>, HeaderValue)>>,
    append: bool,
) -> Result<()> {
    if !head.plain() {
        for h in headers {
            let (name, v) = h?;
            head.pingora_put(name, v, append)?;
        }
        return Ok(());
    }
    if let Some(map) = head.map_mut() {
        return write_map(map, headers, append);
    }
    head.with_map(|map| write_map(map, headers, append))
}

fn write_map<'a>(
    map: &mut http::HeaderMap,
    headers: impl IntoIterator<Item = Result<(Name<'a>, HeaderValue)>>,
    append: bool,
) -> Result<()> {
    for h in headers {
        let (name, v) = h?;
        let name = name.header().clone();
        let added = if append {
            map.try_append(name, v).map(|_| ())
        } else {
            map.try_insert(name, v).map(|_| ())
        };
        added.or_err(ErrorType::InvalidHTTPHeader, "too many headers")?;
    }
    Ok(())
}

impl<H: OneMap> SetHeader for H {
    fn set(&mut self, name: &'static HeaderName, v: impl TryInto<HeaderValue>) -> Result<()> {
        put(self, [value(v).map(|v| (Name::Static(name), v))], false)
    }

    fn add(&mut self, name: &'static HeaderName, v: impl TryInto<HeaderValue>) -> Result<()> {
        put(self, [value(v).map(|v| (Name::Static(name), v))], true)
    }

    fn set_name(&mut self, name: &HeaderName, v: impl TryInto<HeaderValue>) -> Result<()> {
        put(self, [value(v).map(|v| (Name::Other(name), v))], false)
    }

    fn add_name(&mut self, name: &HeaderName, v: impl TryInto<HeaderValue>) -> Result<()> {
        put(self, [value(v).map(|v| (Name::Other(name), v))], true)
    }

    fn set_all<V: TryInto<HeaderValue>>(
        &mut self,
        headers: impl IntoIterator<Item = (&'static HeaderName, V)>,
    ) -> Result<()> {
        // Written in place (`map_mut`): nothing to write costs nothing.
        let headers = headers
            .into_iter()
            .map(|(name, v)| value(v).map(|v| (Name::Static(name), v)));
        put(self, headers, false)
    }
}

/// `n` as a header value, as `HeaderValue::from(n)` makes it. That formats into a buffer of
/// its own, an allocation and about 190 instructions a header, for values that repeat: a
/// route's expected timeout on every request, upstream service times of a few milliseconds.
/// So the values below 1,024 are made once, as static text (a clone is a copy), and each
/// thread keeps the last larger one it made (a clone is a reference count).
pub(crate) fn int_value(n: u64) -> HeaderValue {
    const SMALL: usize = 1024;
    static TABLE: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    thread_local! {
        static LAST: std::cell::RefCell<Option<(u64, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    if let Some(i) = usize::try_from(n).ok().filter(|i| *i < SMALL) {
        let table = TABLE.get_or_init(|| {
            // One text for all of them, kept for the process's life: the values borrow it.
            let mut text = String::with_capacity(4 * SMALL);
            let mut ends = Vec::with_capacity(SMALL);
            for i in 0..SMALL {
                text.push_str(&i.to_string());
                ends.push(text.len());
            }
            let text: &'static str = Box::leak(text.into_boxed_str());
            let mut start = 0;
            ends.into_iter()
                .map(|end| {
                    let v = HeaderValue::from_static(&text[start..end]);
                    start = end;
                    v
                })
                .collect()
        });
        return table[i].clone();
    }
    LAST.with_borrow_mut(|last| match last {
        Some((m, v)) if *m == n => v.clone(),
        _ => {
            let v = HeaderValue::from(n);
            *last = Some((n, v.clone()));
            v
        }
    })
}

/// A header value of a head httparse parsed without line folds (obs-fold: neither
/// `h1_session::Plain::parse`'s parser nor `h1_upstream::parse_head`'s allows them): httparse lets
/// through only bytes a value may hold (horizontal tab, visible ASCII, space, obs-text; the
/// tests below try every byte), so neither the `http` crate's check (about 140 instructions
/// a value) nor pingora's normalisation (about 110) has anything to do.
pub(crate) fn parsed_value(bytes: bytes::Bytes) -> HeaderValue {
    debug_assert!(HeaderValue::from_maybe_shared(bytes.clone()).is_ok());
    // SAFETY: the bytes are valid for a header value (above); the `http` crate relies on
    // nothing else.
    unsafe { HeaderValue::from_maybe_shared_unchecked(bytes) }
}

/// `HeaderName::from_bytes` for a name httparse parsed (a token), with the names most heads
/// carry found in a table: `from_bytes` lowercases every name into a buffer and matches it
/// against the standard names (about 115 instructions a name), and copies a name it does not
/// know into an allocation of its own (`x-request-id`, a sidecar's
/// `x-envoy-upstream-service-time`), where a name from the table is a copy of a static one.
pub(crate) fn parsed_name(bytes: &[u8]) -> Option<HeaderName> {
    for (text, name) in known_names(bytes.len()) {
        if token_is(bytes, text.as_bytes()) {
            return Some(name.clone());
        }
    }
    HeaderName::from_bytes(bytes).ok()
}

/// `parsed_name`'s table: the names of `len` bytes it knows, each with its text (read from a
/// `HeaderName`, a standard name's text is a lookup of its own).
fn known_names(len: usize) -> &'static [(&'static str, HeaderName)] {
    use http::header as h;
    macro_rules! custom {
        ($text:literal) => {
            ($text, HeaderName::from_static($text))
        };
    }
    type Known<const N: usize> = [(&'static str, HeaderName); N];
    static L4: Known<4> = [
        ("host", h::HOST),
        ("date", h::DATE),
        ("vary", h::VARY),
        ("etag", h::ETAG),
    ];
    static L6: Known<4> = [
        ("server", h::SERVER),
        ("accept", h::ACCEPT),
        ("cookie", h::COOKIE),
        ("origin", h::ORIGIN),
    ];
    static L7: Known<2> = [("referer", h::REFERER), ("expires", h::EXPIRES)];
    static L8: Known<1> = [("location", h::LOCATION)];
    static L10: Known<3> = [
        ("user-agent", h::USER_AGENT),
        ("set-cookie", h::SET_COOKIE),
        ("connection", h::CONNECTION),
    ];
    static L11: Known<1> = [custom!("traceparent")];
    static L12: Known<2> = [("content-type", h::CONTENT_TYPE), custom!("x-request-id")];
    static L13: Known<4> = [
        ("cache-control", h::CACHE_CONTROL),
        ("authorization", h::AUTHORIZATION),
        ("last-modified", h::LAST_MODIFIED),
        ("accept-ranges", h::ACCEPT_RANGES),
    ];
    static L14: Known<1> = [("content-length", h::CONTENT_LENGTH)];
    static L15: Known<3> = [
        ("accept-encoding", h::ACCEPT_ENCODING),
        ("accept-language", h::ACCEPT_LANGUAGE),
        custom!("x-forwarded-for"),
    ];
    static L16: Known<1> = [("content-encoding", h::CONTENT_ENCODING)];
    static L17: Known<2> = [
        ("transfer-encoding", h::TRANSFER_ENCODING),
        custom!("x-forwarded-proto"),
    ];
    static L29: Known<1> = [custom!("x-envoy-upstream-service-time")];
    match len {
        4 => &L4,
        6 => &L6,
        7 => &L7,
        8 => &L8,
        10 => &L10,
        11 => &L11,
        12 => &L12,
        13 => &L13,
        14 => &L14,
        15 => &L15,
        16 => &L16,
        17 => &L17,
        29 => &L29,
        _ => &[],
    }
}

/// `HeaderValue::to_str`, eight bytes at a time: the value as text when each byte is visible
/// ASCII or a tab, else None. `to_str` tests byte after byte (about 120 instructions for a
/// Host like `127.0.0.1:8080`), and a request's Host is read as text four times on its way
/// (the codec checks, the route's view, the authority, the upstream's).
pub(crate) fn value_str(v: &HeaderValue) -> Option<&str> {
    let bytes = v.as_bytes();
    if !visible_ascii(bytes) {
        return None;
    }
    // SAFETY: every byte is ASCII (`visible_ascii`), and ASCII is UTF-8.
    Some(unsafe { std::str::from_utf8_unchecked(bytes) })
}

/// Whether every byte is visible ASCII (a space to `~`) or a tab, `to_str`'s test. A word
/// with no byte below a space and none above `~` passes whole; the tests for either find
/// every such byte (they may also flag a byte next to one, never miss one), and a word they
/// flag is judged byte by byte, which is exact and lets tabs through. The last word overlaps
/// the one before it rather than be padded (a copy of a length known only at run time is a
/// call of `memcpy`).
fn visible_ascii(bytes: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let exact = |s: &[u8]| s.iter().all(|b| (b' '..=b'~').contains(b) || *b == b'\t');
    let n = bytes.len();
    if n < 8 {
        return exact(bytes);
    }
    let word_ok = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[at..at + 8]);
        let w = u64::from_le_bytes(w);
        let below_space = w.wrapping_sub(ONES * 0x20) & !w & HIGH;
        let above_tilde = (w.wrapping_add(ONES) | w) & HIGH;
        below_space | above_tilde == 0 || exact(&bytes[at..at + 8])
    };
    let mut at = 0;
    while at + 8 < n {
        if !word_ok(at) {
            return false;
        }
        at += 8;
    }
    word_ok(n - 8)
}

/// Whether the token `bytes` is `lower` (as long, lower case, letters, digits and `-` only)
/// whatever its case, eight bytes at a time. Setting bit 5 lowercases a letter and leaves a
/// digit or `-` as it is; the only other bytes it would turn into one of those are control
/// bytes (`\r` into `-`, say), which a token does not hold, nor a header value httparse
/// parsed (`parsed_value`): so it compares such a value too.
pub(crate) fn token_is(bytes: &[u8], lower: &[u8]) -> bool {
    const CASE: u64 = 0x2020_2020_2020_2020;
    let n = lower.len();
    if bytes.len() != n {
        return false;
    }
    if n < 4 {
        return bytes.iter().zip(lower).all(|(b, l)| b | 0x20 == *l);
    }
    if n <= 8 {
        // Two four-byte words, overlapping for fewer than eight bytes.
        let half = |s: &[u8], at: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&s[at..at + 4]);
            u32::from_le_bytes(w)
        };
        const HALF: u32 = 0x2020_2020;
        return half(bytes, 0) | HALF == half(lower, 0)
            && half(bytes, n - 4) | HALF == half(lower, n - 4);
    }
    let word = |s: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mut at = 0;
    while at + 8 < n {
        if word(bytes, at) | CASE != word(lower, at) {
            return false;
        }
        at += 8;
    }
    // The last eight bytes, overlapping those compared when the length is not a multiple.
    word(bytes, n - 8) | CASE == word(lower, n - 8)
}

/// The reason phrase Envoy's HTTP/1 codec writes for `status`: its own, never the
/// upstream's. Envoy 1.40 names the statuses below (measured: every status from 200 to 999
/// relayed through it) and writes `Unknown` for the rest, 418 and 451 among them; 1xx heads
/// (100 and 101 are the ones it writes) take the standard phrase.
pub(crate) fn envoy_reason(status: http::StatusCode) -> &'static str {
    match status.as_u16() {
        c @ 100..=199 => http::StatusCode::from_u16(c)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Unknown"),
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        203 => "Non-Authoritative Information",
        204 => "No Content",
        205 => "Reset Content",
        206 => "Partial Content",
        207 => "Multi-Status",
        208 => "Already Reported",
        226 => "IM Used",
        300 => "Multiple Choices",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        305 => "Use Proxy",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Payload Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Entity",
        423 => "Locked",
        424 => "Failed Dependency",
        425 => "Too Early",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        506 => "Variant Also Negotiates",
        507 => "Insufficient Storage",
        508 => "Loop Detected",
        510 => "Not Extended",
        511 => "Network Authentication Required",
        599 => "Last Unassigned Server Error Code",
        _ => "Unknown",
    }
}

/// Drops the case pingora kept for an HTTP/1 request's header names (module comment): the
/// connection manager asked for no `header_key_format`. A target the URI does not reproduce
/// keeps its head as it is (case included): a rebuild would lose it.
pub(crate) fn drop_case(req: &mut RequestHeader) {
    if !req.has_case() || !rebuildable(req) {
        return;
    }
    // Through its parts, which keep no case. Room for what the connection manager adds
    // (x-forwarded-proto, x-request-id, x-envoy-expected-rq-timeout-ms and the like, and with
    // Istio's telemetry the B3 context and the peer metadata): the map grows once, here, not
    // on several of those inserts; without it, only a later insert's growth is lost.
    let _ = req.with_map(|map| {
        let _ = map.try_reserve(REQUEST_ADDED_HEADERS);
        Ok(())
    });
}

/// A copy of a request head (the upstream request's start): a head without case made from
/// its parts directly, where pingora's `clone` goes through the request builder (callgrind's
/// profile: 1.08k instructions a request against 1.48k).
pub(crate) fn clone_request(req: &RequestHeader) -> RequestHeader {
    if !plain_request(req) {
        return req.clone();
    }
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = req.method.clone();
    parts.uri = req.uri.clone();
    parts.version = req.version;
    parts.headers = req.headers.clone();
    parts.extensions = req.extensions.clone();
    RequestHeader::from(parts)
}

/// How many headers the gateway may add to a request, the Istio chain's included (four of
/// its own, four of the B3 context, two of peer metadata, the forwarded-for pair): growing
/// the map once more on the way cost ~700 instructions a request.
pub(crate) const REQUEST_ADDED_HEADERS: usize = 12;

/// About how many headers the gateway adds to a response: room made for them at once.
pub(crate) const ADDED_HEADERS: usize = 4;

/// The request line and headers for an HTTP/1 upstream, in one buffer of the exact size: names
/// lower case (Envoy's), unless the head kept their case and the cluster takes it (`keep_case`,
/// its `header_key_format`), which pingora's writer writes. None: a target or version HTTP/1
/// cannot carry (pingora's refusals).
pub(crate) fn request_wire(req: &RequestHeader, keep_case: bool) -> Option<bytes::BytesMut> {
    use bytes::BufMut;
    if keep_case && req.has_case() {
        return pingora_core::protocols::http::v1::client::http_req_header_to_wire(req);
    }
    let path = req.raw_path();
    if path
        .iter()
        .any(|&b| matches!(b, 0x00 | b'\n' | b'\r' | b' '))
    {
        return None;
    }
    let version: &[u8] = match req.version {
        http::Version::HTTP_09 => b"HTTP/0.9",
        http::Version::HTTP_10 => b"HTTP/1.0",
        http::Version::HTTP_11 => b"HTTP/1.1",
        http::Version::HTTP_2 => b"HTTP/2",
        _ => return None,
    };
    let method = req.method.as_str().as_bytes();
    let fields: usize = req
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    let mut buf =
        bytes::BytesMut::with_capacity(method.len() + path.len() + version.len() + 6 + fields);
    buf.put_slice(method);
    buf.put_u8(b' ');
    buf.put_slice(path);
    buf.put_u8(b' ');
    buf.put_slice(version);
    buf.put_slice(b"\r\n");
    for (name, value) in &req.headers {
        buf.put_slice(name.as_str().as_bytes());
        buf.put_slice(b": ");
        buf.put_slice(value.as_bytes());
        buf.put_slice(b"\r\n");
    }
    buf.put_slice(b"\r\n");
    Some(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_in_place_reach_the_head_and_only_heads_without_case() {
        // The parts `Deref` shows are found inside both kinds of head, and a write there is
        // what the head then holds.
        let mut req = RequestHeader::build_no_case("GET", b"/a?b", None).expect("a head");
        req.set(&http::header::ACCEPT, "1").expect("set");
        req.map_mut()
            .expect("a head without case")
            .append(http::header::ACCEPT, HeaderValue::from_static("2"));
        let values: Vec<_> = req.headers.get_all(&http::header::ACCEPT).iter().collect();
        assert_eq!(values, ["1", "2"]);
        assert_eq!(req.raw_path(), b"/a?b");
        assert_eq!(req.method, http::Method::GET);
        let mut resp = ResponseHeader::build_no_case(404, None).expect("a head");
        resp.set(&http::header::ACCEPT, "3").expect("set");
        resp.add(&http::header::ACCEPT, "4").expect("add");
        assert!(resp.map_mut().is_some());
        let values: Vec<_> = resp.headers.get_all(&http::header::ACCEPT).iter().collect();
        assert_eq!(values, ["3", "4"]);
        assert_eq!(resp.status, 404);
        // A head that keeps case has a second map the first must stay in step with: written
        // through pingora's methods.
        let mut cased = RequestHeader::build("GET", b"/", None).expect("a head");
        assert!(cased.has_case());
        assert!(cased.map_mut().is_none());
        cased.set(&http::header::ACCEPT, "5").expect("set");
        assert_eq!(cased.headers[&http::header::ACCEPT], "5");
    }

    #[test]
    fn a_value_as_text_is_what_to_str_gives() {
        // Every byte a value may hold, at every place of values of every length up to three
        // words, among `a`s, `~`s, spaces or tabs (the edges of the visible range, next to
        // which the word tests may flag a byte): the same answer as `to_str`.
        let mut tried = 0;
        for len in 1..=24 {
            for fill in [b'a', b'~', b' ', b'\t'] {
                for at in 0..len {
                    for b in 0u8..=255 {
                        let mut bytes = vec![fill; len];
                        bytes[at] = b;
                        // Control bytes but the tab, and DEL, are no value's.
                        let Ok(v) = HeaderValue::from_bytes(&bytes) else {
                            continue;
                        };
                        assert_eq!(value_str(&v), v.to_str().ok(), "{bytes:?}");
                        tried += 1;
                    }
                }
            }
        }
        assert!(tried > 100_000);
        let empty = HeaderValue::from_static("");
        assert_eq!(value_str(&empty), Some(""));
        // Two bytes out of range in one word, one in each of two words, and the edges.
        for bytes in [
            &b"ab\x80\xffcd"[..],
            b"\x80bcdefgh\x80",
            b"\xffabcdefg",
            b"abcdefg\x80",
        ] {
            let v = HeaderValue::from_bytes(bytes).expect("a value");
            assert_eq!(value_str(&v), None, "{bytes:?}");
        }
    }

    #[test]
    fn a_parsed_name_is_the_name_from_bytes_makes() {
        // Every token byte in every place of every name the table knows, and each such name
        // in upper and lower case: the table's answer is `from_bytes`'s.
        let token: Vec<u8> = (0u8..=255)
            .filter(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b))
            .collect();
        let mut tried = 0;
        for len in 0..64 {
            for (text, name) in known_names(len) {
                assert_eq!(*text, name.as_str(), "the text filed with {name}");
                let text = text.as_bytes();
                assert_eq!(text.len(), len, "{name} is filed under {len}");
                for case in [text.to_vec(), text.to_ascii_uppercase()] {
                    assert_eq!(parsed_name(&case).as_ref(), Some(name));
                    for at in 0..len {
                        for b in &token {
                            let mut other = case.clone();
                            other[at] = *b;
                            let expect = HeaderName::from_bytes(&other).ok();
                            assert_eq!(parsed_name(&other), expect, "{other:?}");
                            tried += 1;
                        }
                    }
                }
            }
        }
        assert!(tried > 10_000);
        // Names the table does not hold, and what `from_bytes` refuses.
        for other in [
            &b"x-custom"[..],
            b"X-Envoy-Decorator-Operation",
            b"",
            b"a b",
            b"k\x80",
        ] {
            assert_eq!(parsed_name(other), HeaderName::from_bytes(other).ok());
        }
    }

    #[test]
    fn an_integer_value_is_what_http_makes_of_it_from_the_table_the_memo_or_afresh() {
        // Below, at and above the table's end; a larger value twice (the memo), then another
        // (the memo replaced), then the first again.
        let ns = (0..1100u64)
            .chain([
                1023,
                1024,
                15000,
                15000,
                15001,
                15000,
                u64::from(u32::MAX),
                u64::MAX,
            ])
            .chain([7, 15000, 15000]);
        for n in ns {
            let v = int_value(n);
            assert_eq!(v, HeaderValue::from(n), "{n}");
            assert_eq!(v.to_str().ok(), Some(n.to_string().as_str()), "{n}");
            assert!(!v.is_sensitive());
        }
    }

    fn wire(req: &RequestHeader) -> Vec<u8> {
        let mut buf = bytes::BytesMut::new();
        req.header_to_h1_wire(&mut buf);
        buf.to_vec()
    }

    fn read(target: &[u8], headers: &[(&str, &str)]) -> RequestHeader {
        let mut req = RequestHeader::build("GET", target, None).expect("request");
        for (n, v) in headers {
            req.append_header(n.to_string(), *v).expect("header");
        }
        req
    }

    /// The same request twice (one for the gateway's writes, one for pingora's), with its case
    /// kept and with it dropped.
    fn twins(headers: &[(&str, &str)]) -> [(bool, RequestHeader, RequestHeader); 2] {
        [true, false].map(|keep_case| {
            let mut req = read(b"/", headers);
            if !keep_case {
                drop_case(&mut req);
            }
            (keep_case, req.clone(), req)
        })
    }

    #[test]
    fn drop_case_keeps_headers_order_and_target() {
        let mut req = read(
            b"/a/b?c=d",
            &[("Host", "h"), ("X-Mixed-Case", "1"), ("x-mixed-case", "2")],
        );
        assert!(req.has_case());
        drop_case(&mut req);
        assert!(!req.has_case());
        assert_eq!(req.raw_path(), b"/a/b?c=d");
        assert_eq!(req.method, http::Method::GET);
        let all: Vec<_> = req.headers.get_all("x-mixed-case").iter().collect();
        assert_eq!(all, ["1", "2"]);
        assert_eq!(
            wire(&req),
            b"Host: h\r\nx-mixed-case: 1\r\nx-mixed-case: 2\r\n"
        );
    }

    #[test]
    fn drop_case_leaves_targets_the_uri_does_not_keep() {
        for target in [&b"http://example.com/p?q"[..], b"/caf\xc3"] {
            let mut req = read(target, &[("Host", "h")]);
            let before = req.raw_path().to_vec();
            drop_case(&mut req);
            assert!(req.has_case(), "{:?}", String::from_utf8_lossy(target));
            assert_eq!(req.raw_path(), &before[..]);
        }
    }

    #[test]
    fn set_and_add_match_pingora_on_either_head() {
        static NAME: HeaderName = HeaderName::from_static("x-envoy-thing");
        for (keep_case, mut ours, mut theirs) in twins(&[("Host", "h"), ("X-Envoy-Thing", "old")]) {
            ours.set(&NAME, "a").expect("set");
            ours.add(&NAME, "b").expect("add");
            ours.set(&http::header::HOST, "other").expect("set");
            // A static name is written as its text, lower case, where the head keeps case.
            theirs.insert_header("x-envoy-thing", "a").expect("insert");
            theirs.append_header("x-envoy-thing", "b").expect("append");
            theirs.insert_header("host", "other").expect("insert");
            assert_eq!(ours.has_case(), keep_case);
            assert_eq!(wire(&ours), wire(&theirs), "keep_case {keep_case}");
            assert_eq!(ours.raw_path(), b"/");
        }
    }

    #[test]
    fn set_all_is_set_after_set() {
        static A: HeaderName = HeaderName::from_static("x-a");
        static B: HeaderName = HeaderName::from_static("x-b");
        for (keep_case, mut ours, mut theirs) in twins(&[("Host", "h"), ("X-A", "old")]) {
            ours.set_all([(&A, "1"), (&B, "2"), (&A, "3")])
                .expect("set_all");
            for (n, v) in [(&A, "1"), (&B, "2"), (&A, "3")] {
                theirs.set(n, v).expect("set");
            }
            assert_eq!(wire(&ours), wire(&theirs), "keep_case {keep_case}");
            // A bad value is an error, and the head is still whole.
            assert!(ours.set_all([(&B, "a\nb")]).is_err());
            assert_eq!(ours.raw_path(), b"/");
            assert_eq!(ours.headers["x-b"], "2");
            // Nothing to set leaves the head as it was.
            let before = wire(&ours);
            ours.set_all(std::iter::empty::<(&'static HeaderName, &str)>())
                .expect("empty set_all");
            assert_eq!(wire(&ours), before);
        }
    }

    #[test]
    fn names_not_static_match_pingora_on_either_head() {
        let name = HeaderName::from_static("x-envoy-thing");
        for (keep_case, mut ours, mut theirs) in twins(&[("Host", "h"), ("X-Envoy-Thing", "old")]) {
            ours.set_name(&name, "a").expect("set");
            ours.add_name(&name, "b").expect("add");
            ours.set_name(&http::header::HOST, "other").expect("set");
            theirs.insert_header(name.clone(), "a").expect("insert");
            theirs.append_header(name.clone(), "b").expect("append");
            theirs
                .insert_header(http::header::HOST, "other")
                .expect("insert");
            assert_eq!(wire(&ours), wire(&theirs), "keep_case {keep_case}");
        }
    }

    #[test]
    fn added_names_go_lower_case_on_a_head_that_keeps_case() {
        let mut resp = ResponseHeader::build(200, None).expect("response");
        resp.append_header("Content-Type", "text/plain")
            .expect("header");
        assert!(resp.has_case());
        resp.set(&http::header::SERVER, "envoy").expect("set");
        let mut buf = bytes::BytesMut::new();
        resp.header_to_h1_wire(&mut buf);
        assert_eq!(&buf[..], b"Content-Type: text/plain\r\nserver: envoy\r\n");
    }

    #[test]
    fn set_on_a_verbatim_target_keeps_it() {
        let mut req =
            RequestHeader::build_no_case("GET", b"http://example.com/p", None).expect("request");
        req.set(&http::header::HOST, "example.com").expect("set");
        assert_eq!(req.raw_path(), b"http://example.com/p");
        assert_eq!(req.headers["host"], "example.com");
    }

    #[test]
    fn invalid_values_are_errors() {
        let mut req = read(b"/", &[]);
        drop_case(&mut req);
        assert!(req.set(&http::header::HOST, "a\nb").is_err());
        let mut resp = ResponseHeader::from(http::Response::new(()).into_parts().0);
        assert!(resp.set(&http::header::SERVER, "a\rb").is_err());
    }

    #[test]
    fn request_wire_writes_names_lower_case_without_case_and_as_pingora_with_it() {
        let mut req = read(
            b"/p?q=1",
            &[
                ("Host", "h"),
                ("X-Mixed", "1"),
                ("User-Agent", "t"),
                ("x-mixed", "2"),
            ],
        );
        let cased = request_wire(&req, true).expect("wire");
        assert_eq!(
            &cased[..],
            &pingora_core::protocols::http::v1::client::http_req_header_to_wire(&req)
                .expect("wire")[..]
        );
        assert_eq!(
            &cased[..],
            b"GET /p?q=1 HTTP/1.1\r\nHost: h\r\nX-Mixed: 1\r\nx-mixed: 2\r\nUser-Agent: t\r\n\r\n"
        );
        // A cluster without `header_key_format`: lower case, case kept or not.
        let lower = request_wire(&req, false).expect("wire");
        assert_eq!(
            &lower[..],
            b"GET /p?q=1 HTTP/1.1\r\nhost: h\r\nx-mixed: 1\r\nx-mixed: 2\r\nuser-agent: t\r\n\r\n"
        );
        drop_case(&mut req);
        req.set(&http::header::HOST, "other").expect("set");
        let wire = request_wire(&req, true).expect("wire");
        assert_eq!(
            &wire[..],
            b"GET /p?q=1 HTTP/1.1\r\nhost: other\r\nx-mixed: 1\r\nx-mixed: 2\r\nuser-agent: t\r\n\r\n"
        );
        assert_eq!(wire.len(), wire.capacity());
        let mut req = RequestHeader::build_no_case("POST", b"/", None).expect("request");
        req.set_version(http::Version::HTTP_10);
        assert_eq!(
            &request_wire(&req, false).expect("wire")[..],
            b"POST / HTTP/1.0\r\n\r\n"
        );
    }

    #[test]
    fn request_wire_refuses_a_version_http1_cannot_carry() {
        let mut req = RequestHeader::build_no_case("GET", b"/", None).expect("request");
        req.set_version(http::Version::HTTP_3);
        assert!(request_wire(&req, false).is_none());
    }

    /// What `parsed_value` relies on, for every byte anywhere in a value, in requests
    /// (`h1_session::Plain::parse`'s parser) and responses (`h1_upstream::parse_head`'s); and that
    /// neither lets a fold through.
    #[test]
    fn httparse_passes_only_bytes_a_header_value_may_hold() {
        let mut response_config = httparse::ParserConfig::default();
        response_config.allow_spaces_after_header_name_in_responses(true);
        for b in 0..=255u8 {
            for at in 0..3 {
                let mut v = b"ab".to_vec();
                v.insert(at, b);
                let mut head = b"GET / HTTP/1.1\r\nhost: a\r\nx: ".to_vec();
                head.extend_from_slice(&v);
                head.extend_from_slice(b"\r\n\r\n");
                let mut fields = [httparse::EMPTY_HEADER; 4];
                let mut req = httparse::Request::new(&mut fields);
                let config = httparse::ParserConfig::default();
                if let Ok(httparse::Status::Complete(_)) = config.parse_request(&mut req, &head) {
                    let value = req.headers[1].value;
                    assert!(
                        HeaderValue::from_bytes(value).is_ok(),
                        "{b} at {at}: {value:?}"
                    );
                }
                let mut head = b"HTTP/1.1 200 OK\r\nx: ".to_vec();
                head.extend_from_slice(&v);
                head.extend_from_slice(b"\r\ncontent-length: 0\r\n\r\n");
                let mut fields = [httparse::EMPTY_HEADER; 4];
                let mut resp = httparse::Response::new(&mut fields);
                if let Ok(httparse::Status::Complete(_)) =
                    response_config.parse_response(&mut resp, &head)
                {
                    let value = resp.headers[0].value;
                    assert!(
                        HeaderValue::from_bytes(value).is_ok(),
                        "{b} at {at}: {value:?}"
                    );
                }
            }
        }
        let mut fields = [httparse::EMPTY_HEADER; 4];
        let mut resp = httparse::Response::new(&mut fields);
        let folded = b"HTTP/1.1 200 OK\r\nx: a\r\n b\r\ncontent-length: 0\r\n\r\n";
        assert!(response_config.parse_response(&mut resp, folded).is_err());
        let mut fields = [httparse::EMPTY_HEADER; 4];
        let mut req = httparse::Request::new(&mut fields);
        let folded = b"GET / HTTP/1.1\r\nhost: a\r\nx: a\r\n b\r\n\r\n";
        assert!(httparse::ParserConfig::default()
            .parse_request(&mut req, folded)
            .is_err());
    }

    #[test]
    fn reason_phrases_are_envoys_not_the_http_crates() {
        let reason = |c: u16| envoy_reason(http::StatusCode::from_u16(c).expect("status"));
        // Where Envoy 1.40 and the `http` crate agree, and where they do not.
        assert_eq!(reason(200), "OK");
        assert_eq!(reason(101), "Switching Protocols");
        assert_eq!(reason(100), "Continue");
        assert_eq!(reason(413), "Payload Too Large");
        assert_eq!(reason(418), "Unknown");
        assert_eq!(reason(451), "Unknown");
        assert_eq!(reason(306), "Unknown");
        assert_eq!(reason(599), "Last Unassigned Server Error Code");
        assert_eq!(reason(999), "Unknown");
    }

    #[test]
    fn response_keeps_a_reason_phrase_other_than_the_standard_one() {
        let mut resp = ResponseHeader::from(http::Response::new(()).into_parts().0);
        resp.set(&http::header::SERVER, "portico").expect("set");
        assert_eq!(resp.get_reason_phrase(), Some("OK"));
        resp.set_reason_phrase(Some("Fine")).expect("reason");
        resp.set(&http::header::SERVER, "envoy").expect("set");
        assert_eq!(resp.get_reason_phrase(), Some("Fine"));
        assert_eq!(resp.headers["server"], "envoy");
    }
}
