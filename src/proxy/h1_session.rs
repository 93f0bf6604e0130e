//! Portico's own HTTP/1.1 downstream session, for the requests its own loop (`h1`) serves:
//! pingora's proxy `Session` carries it as a custom session (`ServerSession::Custom`).
//!
//! pingora's HTTP/1 session reads a request into a head that keeps its names' case in a
//! second map (which the gateway drops again: Envoy keeps none), validates it a second time,
//! and is made and taken apart around every request; its writer needs a response head with a
//! case map to write names lower case as Envoy does. This session takes a head that `Plain::parse`
//! has already parsed and checked straight into a head without case, and writes response
//! names lower case from the head's one map, so the upstream's response needs no case either
//! (`h1_upstream`), and says `connection: close` on a response after which it closes the
//! connection and nothing on one it keeps, as Envoy's codec (pingora's writes `keep-alive`).
//! Otherwise it answers as pingora's session does (`tests/h1_loop.rs` holds the two to the
//! same bytes, but for those two and the date): `Date` set on a response head without one (an
//! upstream's is kept, as Envoy keeps it; pingora's sessions replace it), the same body framing (a
//! length, chunked, until close; none for HEAD, 204 and 304), the same flushes and the same
//! errors. A connection manager that keeps header case
//! (`header_key_format`) has pingora's session.
//!
//! What pingora's session learns through `set_keepalive` (which pingora ignores for a custom
//! session) this one learns from the [`Conn`] it shares with the request's context, and it
//! hands the connection back through that `Conn` when it is dropped with the connection kept
//! (pingora's `finish` gives a custom session's connection back to no one).

use std::future::pending;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use pingora_core::protocols::http::custom::server::Session as CustomSession;
use pingora_core::protocols::http::custom::CustomMessageWrite;
use pingora_core::protocols::http::HttpTask;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::l4::socket::SocketAddr;
use pingora_core::protocols::{
    Digest, GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, Ssl, UniqueID,
    UniqueIDType,
};
use pingora_error::{Error, ErrorType, OrErr, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::head::SetHeader;
use super::io::Downstream;

/// The most header fields a plain request may have (more go to pingora's session).
const MAX_FIELDS: usize = 100;

/// pingora's error for a body shorter than its `Content-Length` (its body writer's).
const PREMATURE_BODY_END: ErrorType = ErrorType::new("PrematureBodyEnd");

/// A header field of a plain request head: where its name and value are in the head's bytes.
#[derive(Clone, Copy, Default)]
struct Field {
    name: (u16, u16),
    value: (u16, u16),
}

/// A request head `Plain::parse` accepted, as offsets into the connection's buffered bytes: the
/// head is built from them once those bytes are taken off the connection, without copies.
pub(crate) struct Plain {
    end: usize,
    method: (u16, u16),
    path: (u16, u16),
    fields: [Field; MAX_FIELDS],
    n: usize,
    /// What the first `Connection` field says: keep-alive (true) or close (false).
    connection: Option<bool>,
}

/// Whether a request head (complete, through its blank line: `head`) is one the own loop
/// serves (`Plain::parse`), and the head as it read it.
#[cfg(test)]
pub(crate) fn plain(head: &[u8]) -> Option<Plain> {
    let mut plain = Plain::default();
    plain.parse(head).then_some(plain)
}

impl Default for Plain {
    fn default() -> Plain {
        Plain {
            end: 0,
            method: (0, 0),
            path: (0, 0),
            fields: [Field::default(); MAX_FIELDS],
            n: 0,
            connection: None,
        }
    }
}

impl Plain {
    /// Whether a request head (complete, through its blank line: `head`) is one the own loop
    /// serves: HTTP/1.1, origin-form, one Host, no body (no `transfer-encoding`, no
    /// `content-length` but 0), no upgrade or `Expect`, and a `Connection` header (if any)
    /// that only says `close` or `keep-alive`, so pingora's upstream request policy has
    /// nothing to strip that it names. Anything else, or anything httparse refuses, goes to
    /// pingora's loop. The head is read into `self`, one per connection: a `Plain` is large
    /// (its fields), and returned or moved it cost two copies and a fill a request.
    pub(crate) fn parse(&mut self, head: &[u8]) -> bool {
        self.parse_head(head).is_some()
    }

    fn parse_head(&mut self, head: &[u8]) -> Option<()> {
        let at = |s: &[u8]| -> Option<(u16, u16)> {
            let start = (s.as_ptr() as usize).checked_sub(head.as_ptr() as usize)?;
            Some((u16::try_from(start).ok()?, u16::try_from(s.len()).ok()?))
        };
        if head.len() > usize::from(u16::MAX) {
            return None;
        }
        // Uninitialised: the parse writes only the fields it finds (an initialised array of
        // 100 is 3.2 KB written per request).
        let mut headers =
            [const { std::mem::MaybeUninit::<httparse::Header>::uninit() }; MAX_FIELDS];
        let mut req = httparse::Request::new(&mut []);
        let parsed = httparse::ParserConfig::default().parse_request_with_uninit_headers(
            &mut req,
            head,
            &mut headers,
        );
        let end = match parsed {
            Ok(httparse::Status::Complete(end)) => end,
            _ => return None,
        };
        if req.version != Some(1) {
            return None;
        }
        let (Some(method), Some(path)) = (req.method, req.path) else {
            return None;
        };
        if method == "CONNECT" || !path.starts_with('/') {
            return None;
        }
        self.end = end;
        self.method = at(method.as_bytes())?;
        self.path = at(path.as_bytes())?;
        self.n = 0;
        self.connection = None;
        let (mut hosts, mut lengths) = (0, 0);
        for h in req.headers.iter() {
            let name = h.name;
            let is = |n: &str| super::head::token_is(name.as_bytes(), n.as_bytes());
            if is("host") {
                hosts += 1;
            } else if is("content-length") {
                lengths += 1;
                if h.value != b"0" {
                    return None;
                }
            } else if is("connection") {
                let v = h.value;
                let keep = super::head::token_is(v, b"keep-alive");
                if !(keep || super::head::token_is(v, b"close")) {
                    return None;
                }
                self.connection = self.connection.or(Some(keep));
            } else if is("transfer-encoding")
                || is("upgrade")
                || is("expect")
                || is("http2-settings")
                || is("close")
            {
                return None;
            }
            if !name.is_empty() {
                *self.fields.get_mut(self.n)? = Field {
                    name: at(name.as_bytes())?,
                    value: at(h.value)?,
                };
                self.n += 1;
            }
        }
        (hosts == 1 && lengths <= 1).then_some(())
    }
}

/// Envoy's codec refuses a request whose target holds a control byte, a space or DEL (a 400,
/// `Bad Request`, the connection closed); pingora's session instead percent-encodes them
/// (`%01`, `%20`) and serves the request, which no later check can tell from a client's own
/// `%20`. So before pingora's session reads a head, such bytes in its request line's target
/// (between the method's space and the last ` HTTP/`) are made `#`: pingora's parser takes
/// it, the URI drops what follows, and `downstream::reject` refuses the request (as a
/// fragment, should nothing else: `Downstream::refused_target` says which). Whether any was.
pub(crate) fn mark_refused_target(head: &mut [u8]) -> bool {
    let line_end = head.iter().position(|b| *b == b'\n').unwrap_or(head.len());
    let line = &head[..line_end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(method_end) = line.iter().position(|b| *b == b' ') else {
        return false;
    };
    let Some(version_at) = line
        .windows(6)
        .rposition(|w| w == b" HTTP/")
        .filter(|v| *v > method_end)
    else {
        return false;
    };
    let mut marked = false;
    for b in &mut head[method_end + 1..version_at] {
        if *b <= b' ' || *b == 0x7f {
            *b = b'#';
            marked = true;
        }
    }
    marked
}

impl Plain {
    /// The request head, as pingora's session would read it less its names' case, and its
    /// bytes, taken off the connection. None: they stay on it, for pingora's session to read
    /// (and answer as it does: an authority it refuses, a target it keeps verbatim).
    pub fn take(&self, d: &mut Downstream) -> Option<(RequestHeader, Bytes)> {
        let raw = d.take_ahead(self.end);
        match self.head(&raw) {
            Some(req) => Some((req, raw)),
            None => {
                d.unread(&raw);
                None
            }
        }
    }

    fn head(&self, raw: &Bytes) -> Option<RequestHeader> {
        let range = |(at, len): (u16, u16)| usize::from(at)..usize::from(at) + usize::from(len);
        let target = raw.slice(range(self.path));
        let method = raw.get(range(self.method))?;
        // A fragment pingora's session cuts off the target (and the connection manager then
        // refuses): pingora's to read. So an own session's target holds none
        // (`downstream::has_fragment`).
        if target.contains(&b'#') {
            return None;
        }
        // The head's parts as pingora's `build_no_case` makes them for an origin-form target
        // (the URI's path and query from the target's bytes, which it reproduces), without
        // its builder, a copy of the target or a case map; a target the URI refuses (bytes
        // that are not ASCII, say) is pingora's to read.
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.method = Method::from_bytes(method).ok()?;
        parts.uri = http::Uri::from(http::uri::PathAndQuery::from_maybe_shared(target).ok()?);
        parts.version = Version::HTTP_11;
        parts
            .headers
            .try_reserve(self.n + super::head::REQUEST_ADDED_HEADERS)
            .ok()?;
        for f in &self.fields[..self.n] {
            let name = super::head::parsed_name(raw.get(range(f.name))?)?;
            // httparse's request parser allows no fold: the bytes are a value's
            // (`head::parsed_value`).
            let value = super::head::parsed_value(raw.slice(range(f.value)));
            // pingora's `validate_request_authority`, for what `parse` lets through (one
            // Host, an origin-form target, whose URI has no authority): no userinfo in the
            // Host.
            if name == header::HOST && value.as_bytes().contains(&b'@') {
                return None;
            }
            parts.headers.try_append(name, value).ok()?;
        }
        Some(RequestHeader::from(parts))
    }

    /// pingora's `respect_keepalive` for HTTP/1.1: kept (no limit) unless it says close.
    pub fn keepalive(&self) -> Option<u64> {
        match self.connection {
            Some(false) => None,
            _ => Some(0),
        }
    }
}

/// What the request's hooks and its session share about the connection.
#[derive(Debug)]
pub(crate) struct Conn {
    /// pingora's keep-alive: `OFF`, else the seconds the connection may idle (0: no limit).
    keep: AtomicU64,
    /// The connection, handed back by a session dropped with the connection kept.
    parked: Mutex<Option<Box<Downstream>>>,
    /// The response is whole and flushed: nothing the session writes after that reaches
    /// the connection, so the loop's own `finish` at the request's end has nothing to do.
    finished: AtomicBool,
}

const OFF: u64 = u64::MAX;

impl Conn {
    pub fn new(keepalive: Option<u64>) -> Conn {
        Conn {
            keep: AtomicU64::new(keepalive.unwrap_or(OFF)),
            parked: Mutex::new(None),
            finished: AtomicBool::new(false),
        }
    }

    /// Whether the session's response was finished and flushed (`OwnSession::finish_body`).
    pub fn finished(&self) -> bool {
        self.finished.load(Relaxed)
    }

    /// pingora's `set_keepalive`: None closes the connection after this request.
    pub fn set_keepalive(&self, secs: Option<u64>) {
        self.keep
            .store(secs.map_or(OFF, |s| s.min(OFF - 1)), Relaxed);
    }

    pub fn keepalive(&self) -> Option<u64> {
        Some(self.keep.load(Relaxed)).filter(|k| *k != OFF)
    }

    /// The connection its session handed back, if it was kept.
    pub fn take(&self) -> Option<Box<Downstream>> {
        self.parked.lock().ok()?.take()
    }
}

/// Where a request's own session was boxed, so that the own loop can call it directly while
/// pingora's session holds it. Through pingora's custom-session trait (which offers no way
/// back to the type) each async method boxes its future: the response's write, the watch on
/// the client and the finish were three allocations a request, and each future's move into
/// its box a copy. 0: no own session.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OwnAt(usize);

impl OwnAt {
    pub fn of(own: &OwnSession) -> OwnAt {
        OwnAt(std::ptr::from_ref(own) as usize)
    }

    /// The own session `session` holds, when it is the one boxed at this address.
    pub fn get(self, session: &mut ServerSession) -> Option<&mut OwnSession> {
        let ServerSession::Custom(custom) = session else {
            return None;
        };
        let sized = std::mem::size_of_val(&**custom) == std::mem::size_of::<OwnSession>();
        let object: *mut dyn CustomSession = &mut **custom;
        let own = object.cast::<OwnSession>();
        if self.0 == 0 || own as usize != self.0 || !sized {
            return None;
        }
        // SAFETY: `own` points at the object pingora's session holds, and is derived from a
        // unique borrow of it, for as long as `session` is borrowed. That object is the own
        // session boxed at this address: Portico makes custom sessions of two types only
        // (`custom_sessions_are_own_sessions_or_empty` checks the source), its own and the
        // empty placeholder `()`, which has no size (the check above) and so no address an
        // own session could have. A request's own session stays in pingora's session while
        // the request runs (`h1::process` puts it there, and `h1::vacate` takes it out after
        // the request), so none other can have taken its place at its address meanwhile.
        Some(unsafe { &mut *own })
    }
}

/// pingora's `will_keepalive`.
pub(crate) fn will_keepalive(conn: &Conn, reuses: Option<u32>) -> bool {
    conn.keepalive().is_some() && reuses != Some(0)
}

/// How the response body is framed (pingora's body writer's modes).
#[derive(Debug, Clone, Copy)]
enum Body {
    /// No final response head yet.
    Select,
    Length {
        total: usize,
        written: usize,
    },
    Chunked(usize),
    UntilClose(usize),
    Complete,
}

/// The session of one request on a connection.
pub(crate) struct OwnSession {
    /// Always there until the session is dropped (then handed back through `conn`).
    stream: Option<Box<Downstream>>,
    req: RequestHeader,
    raw: Bytes,
    conn: Arc<Conn>,
    reuses: Option<u32>,
    digest: Digest,
    response_written: Option<Box<ResponseHeader>>,
    body: Body,
    /// Body bytes of several tasks, written at once (`response_duplex_vec`).
    body_buf: Vec<u8>,
    body_bytes_sent: usize,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    drain_timeout: Option<Duration>,
    /// The client closed its side while the response was pending.
    half_closed: bool,
    /// Bytes of the next request arrived while this one was answered (kept on the connection).
    stashed: bool,
}

impl OwnSession {
    pub fn new(
        stream: Box<Downstream>,
        req: RequestHeader,
        raw: Bytes,
        conn: Arc<Conn>,
        reuses: Option<u32>,
    ) -> OwnSession {
        // As pingora's session takes it from the connection when made.
        let digest = Digest {
            ssl_digest: stream.get_ssl_digest(),
            timing_digest: stream.get_timing_digest(),
            proxy_digest: stream.get_proxy_digest(),
            socket_digest: stream.get_socket_digest(),
        };
        OwnSession {
            stream: Some(stream),
            req,
            raw,
            conn,
            reuses,
            digest,
            response_written: None,
            body: Body::Select,
            body_buf: Vec::new(),
            body_bytes_sent: 0,
            // pingora's session's default.
            read_timeout: Some(Duration::from_secs(60)),
            write_timeout: None,
            drain_timeout: None,
            half_closed: false,
            stashed: false,
        }
    }

    fn io(&mut self) -> Result<&mut Downstream> {
        self.stream
            .as_deref_mut()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "the connection is gone"))
    }

    fn will_keepalive(&self) -> bool {
        will_keepalive(&self.conn, self.reuses)
    }

    fn body_finished(&self) -> bool {
        match self.body {
            Body::Complete => true,
            Body::Length { total, written } => written >= total,
            _ => false,
        }
    }

    /// pingora's `write_response_header` (with its `prepare_response_header`). Informational
    /// heads other than 101 are not relayed: Portico sets `ignore_info_resp` on every HTTP/1
    /// session (Envoy answers `Expect` itself, which this loop never sees).
    async fn write_head(&mut self, mut header: Box<ResponseHeader>) -> Result<()> {
        let informational = header.status.is_informational();
        if informational && header.status != StatusCode::SWITCHING_PROTOCOLS {
            tracing::debug!("ignoring informational headers");
            return Ok(());
        }
        if let Some(resp) = &self.response_written {
            if !resp.status.is_informational() {
                tracing::warn!("Respond header is already sent, cannot send again");
                return Ok(());
            }
        }
        if header.status == StatusCode::SWITCHING_PROTOCOLS {
            self.conn.set_keepalive(None);
        }
        let fields = HeadFields::of(&header.headers);
        let has_length = self.init_body_writer(&header, &fields);
        if matches!(self.body, Body::UntilClose(_)) {
            self.conn.set_keepalive(None);
        }
        if !informational {
            static DATE: HeaderName = header::DATE;
            static CONNECTION: HeaderName = header::CONNECTION;
            // An upstream's `Date` is kept, as Envoy keeps it (its connection manager adds one
            // only where there is none: local replies, upstreams that send none).
            let dated = fields.date;
            let date = || pingora_core::protocols::http::date::get_cached_date();
            // Decided once the framing is (a body until close closes the connection; pingora
            // decides before, and says `keep-alive` of a connection it then closes).
            if self.will_keepalive() {
                // Envoy's codec says nothing of a connection it keeps (pingora's writes
                // `connection: keep-alive`).
                if fields.connection {
                    header.remove_header(&header::CONNECTION);
                }
                if !dated {
                    header.set(&DATE, date())?;
                }
            } else if dated {
                header.set(&CONNECTION, HeaderValue::from_static("close"))?;
            } else {
                // Both in one write (a head without case is taken apart once for them).
                let close = HeaderValue::from_static("close");
                header.set_all([(&DATE, date()), (&CONNECTION, close)])?;
            }
        }
        let version = match header.version {
            Version::HTTP_09 => "HTTP/0.9 ",
            Version::HTTP_10 => "HTTP/1.0 ",
            Version::HTTP_11 => "HTTP/1.1 ",
            _ => return Error::e_explain(ErrorType::WriteError, "serializing response header"),
        };
        let flush = informational || !has_length;
        let finished = self.body_finished();
        let io = self.io()?;
        // Into the connection's write buffer, which the flush below (or the body's) sends.
        io.stage(|buf| {
            buf.extend_from_slice(version.as_bytes());
            buf.extend_from_slice(header.status.as_str().as_bytes());
            buf.push(b' ');
            // Envoy's codec writes its own phrase, never the upstream's.
            buf.extend_from_slice(super::head::envoy_reason(header.status).as_bytes());
            buf.extend_from_slice(b"\r\n");
            // Names lower case, as Envoy's codec writes them (a head's case, if it kept
            // one, is not read: a connection manager that keeps case has pingora's session).
            for (name, value) in header.headers.iter() {
                buf.extend_from_slice(name.as_str().as_bytes());
                buf.extend_from_slice(b": ");
                buf.extend_from_slice(value.as_bytes());
                buf.extend_from_slice(b"\r\n");
            }
            buf.extend_from_slice(b"\r\n");
        });
        if flush || finished {
            io.flush()
                .await
                .or_err(ErrorType::WriteError, "flushing response header")?;
        }
        self.response_written = Some(header);
        Ok(())
    }

    /// pingora's `init_body_writer` for a request that asked for no upgrade; whether the head
    /// has a `Content-Length` field (pingora flushes a head without one at once).
    fn init_body_writer(&mut self, header: &ResponseHeader, fields: &HeadFields) -> bool {
        if matches!(
            header.status,
            StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
        ) || self.req.method == Method::HEAD
        {
            self.body = Body::Length {
                total: 0,
                written: 0,
            };
            return fields.length_field;
        }
        if header.status.is_informational() && header.status != StatusCode::SWITCHING_PROTOCOLS {
            return fields.length_field;
        }
        self.body = if fields.chunked {
            Body::Chunked(0)
        } else {
            match fields.length {
                Some(total) => Body::Length { total, written: 0 },
                // No length, or one that cannot frame the body: until the connection closes.
                None => Body::UntilClose(0),
            }
        };
        fields.length_field
    }

    /// pingora's `write_body`: through the body's framing, within the write timeout.
    async fn write_body_timed(&mut self, buf: &[u8]) -> Result<Option<usize>> {
        let written = match self.write_timeout {
            Some(t) => match tokio::time::timeout(t, self.write_framed(buf)).await {
                Ok(r) => r,
                Err(_) => {
                    return Error::e_explain(
                        ErrorType::WriteTimedout,
                        format!("writing body, timeout: {t:?}"),
                    )
                }
            },
            None => self.write_framed(buf).await,
        }?;
        if let Some(n) = written {
            self.body_bytes_sent += n;
        }
        Ok(written)
    }

    /// pingora's body writer's `write_body`.
    async fn write_framed(&mut self, buf: &[u8]) -> Result<Option<usize>> {
        let body = self.body;
        let io = self.io()?;
        match body {
            Body::Select | Body::Complete => Ok(None),
            Body::Length { total, written } => {
                if written >= total {
                    return Ok(None);
                }
                let mut n = total - written;
                if n < buf.len() {
                    tracing::warn!("Trying to write data over content-length: {total}");
                } else {
                    n = buf.len();
                }
                io.write_all(&buf[..n])
                    .await
                    .or_err(ErrorType::WriteError, "while writing body")?;
                let flushed = if written + n >= total {
                    io.flush().await
                } else {
                    Ok(())
                };
                self.body = Body::Length {
                    total,
                    written: written + n,
                };
                flushed.or_err(ErrorType::WriteError, "flushing body")?;
                Ok(Some(n))
            }
            Body::Chunked(written) => {
                let mut size = [0u8; 18];
                let size = chunk_size(buf.len(), &mut size);
                let mut wrote = io.write_all(size).await;
                if wrote.is_ok() {
                    wrote = io.write_all(buf).await;
                }
                if wrote.is_ok() {
                    wrote = io.write_all(b"\r\n").await;
                }
                wrote.or_err(ErrorType::WriteError, "while writing body")?;
                io.flush()
                    .await
                    .or_err(ErrorType::WriteError, "flushing body")?;
                self.body = Body::Chunked(written + buf.len());
                Ok(Some(buf.len()))
            }
            Body::UntilClose(written) => {
                io.write_all(buf)
                    .await
                    .or_err(ErrorType::WriteError, "while writing body")?;
                let flushed = io.flush().await;
                self.body = Body::UntilClose(written + buf.len());
                flushed.or_err(ErrorType::WriteError, "flushing body")?;
                Ok(Some(buf.len()))
            }
        }
    }

    /// pingora's `finish_body`: the body's end (a last chunk), then a flush.
    pub async fn finish_body(&mut self) -> Result<Option<usize>> {
        let body = self.body;
        let io = self.io()?;
        let done = match body {
            Body::Select | Body::Complete => None,
            Body::Length { total, written } => {
                self.body = Body::Complete;
                if written < total {
                    return Error::e_explain(
                        PREMATURE_BODY_END,
                        format!("Content-length: {total} bytes written: {written}"),
                    );
                }
                Some(written)
            }
            Body::Chunked(written) => {
                let wrote = io.write_all(b"0\r\n\r\n").await;
                self.body = Body::Complete;
                wrote.or_err(ErrorType::WriteError, "while writing body")?;
                Some(written)
            }
            Body::UntilClose(written) => {
                self.body = Body::Complete;
                Some(written)
            }
        };
        self.io()?
            .flush()
            .await
            .or_err(ErrorType::WriteError, "flushing body")?;
        // A complete body after a final head takes no more writes (`write_framed`,
        // `write_head`): this flush was the response's last.
        let last = self
            .response_written
            .as_ref()
            .is_some_and(|r| !r.status.is_informational());
        if last && matches!(self.body, Body::Complete) {
            self.conn.finished.store(true, Relaxed);
        }
        Ok(done)
    }

    /// pingora's `response_duplex`, one task.
    async fn duplex(&mut self, task: HttpTask) -> Result<bool> {
        let end = match task {
            HttpTask::Header(header, end) => {
                self.write_head(header).await.map_err(|e| e.into_down())?;
                end
            }
            HttpTask::Body(data, end) => {
                if let Some(d) = data.filter(|d| !d.is_empty()) {
                    self.write_body_timed(&d).await.map_err(|e| e.into_down())?;
                }
                end
            }
            HttpTask::UpgradedBody(..) => return Err(not_upgraded()),
            HttpTask::Trailer(_) | HttpTask::Done => true,
            HttpTask::Failed(e) => return Err(e),
        };
        if end {
            self.finish_body().await.map_err(|e| e.into_down())?;
        }
        Ok(end || self.body_finished())
    }

    /// pingora's `write_body_buf`: the batched body bytes, as one write of the body.
    async fn write_body_buf(&mut self) -> Result<Option<usize>> {
        if self.body_buf.is_empty() {
            return Ok(None);
        }
        let buf = std::mem::take(&mut self.body_buf);
        let written = self.write_body_timed(&buf).await;
        self.body_buf = buf;
        self.body_buf.clear();
        written
    }

    /// pingora's `response_duplex_vec`: the tasks written, whether the response is done.
    pub async fn duplex_vec(&mut self, mut tasks: Vec<HttpTask>) -> Result<bool> {
        if tasks.len() == 1 {
            if let Some(task) = tasks.pop() {
                return self.duplex(task).await;
            }
        }
        // One body in the batch (a head and its body, the usual case) is written as it is:
        // the batch's copy is for several bodies, which pingora writes as one.
        let bodies = tasks
            .iter()
            .filter(|t| matches!(t, HttpTask::Body(Some(d), _) if !d.is_empty()))
            .count();
        let mut end = false;
        for task in tasks {
            end = match task {
                HttpTask::Body(Some(d), end) if bodies == 1 && !d.is_empty() => {
                    self.write_body_timed(&d).await.map_err(|e| e.into_down())?;
                    end
                }
                HttpTask::Header(header, end) => {
                    self.write_head(header).await.map_err(|e| e.into_down())?;
                    end
                }
                HttpTask::Body(data, end) => {
                    if let Some(d) = data.filter(|d| !d.is_empty()) {
                        if !self.body_finished() {
                            self.body_buf.extend_from_slice(&d);
                        }
                    }
                    end
                }
                HttpTask::UpgradedBody(..) => return Err(not_upgraded()),
                HttpTask::Trailer(_) | HttpTask::Done => true,
                HttpTask::Failed(e) => {
                    self.write_body_buf().await.map_err(|e| e.into_down())?;
                    self.io()?
                        .flush()
                        .await
                        .or_err(ErrorType::WriteError, "flushing response")?;
                    return Err(e);
                }
            };
        }
        self.write_body_buf().await.map_err(|e| e.into_down())?;
        if end {
            self.finish_body().await.map_err(|e| e.into_down())?;
        }
        Ok(end || self.body_finished())
    }

    /// pingora's, for a request without a body on a session with pipelining on (Portico
    /// turns it on for every HTTP/1 session): the client closing fails the request; bytes of
    /// a next request stay on the connection for it.
    pub async fn body_or_idle(&mut self) -> Result<Option<Bytes>> {
        if self.half_closed {
            return Error::e_explain(ErrorType::ConnectionClosed, self.premature());
        }
        if self.stashed {
            return pending().await;
        }
        let io = self.io()?;
        if !io.ahead().is_empty() {
            self.stashed = true;
            return pending().await;
        }
        let mut probe = [0u8; 1];
        let read = io
            .read(&mut probe)
            .await
            .or_err(ErrorType::ReadError, "during HTTP body-or-idle state")?;
        if read == 0 {
            self.half_closed = true;
            self.conn.set_keepalive(None);
            return Error::e_explain(ErrorType::ConnectionClosed, self.premature());
        }
        io.unread(&probe[..read]);
        self.stashed = true;
        pending().await
    }

    fn premature(&self) -> &'static str {
        if self.response_written.is_none() {
            "Prematurely before response header is sent"
        } else {
            "Prematurely before response body is complete"
        }
    }
}

fn not_upgraded() -> Box<Error> {
    Error::explain(
        ErrorType::InternalError,
        "an upgraded body for a session that was not upgraded",
    )
}

/// A chunk's size line as pingora writes it (upper-case hex).
fn chunk_size(n: usize, buf: &mut [u8; 18]) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    let mut v = n;
    loop {
        i -= 1;
        digits[i] = HEX[v & 0xf];
        v >>= 4;
        if v == 0 {
            break;
        }
    }
    let len = digits.len() - i;
    buf[..len].copy_from_slice(&digits[i..]);
    buf[len..len + 2].copy_from_slice(b"\r\n");
    &buf[..len + 2]
}

/// What the response head's writer reads of its fields, found in one pass over them (four
/// lookups by name hashed each name, and the framing walked the values they found again).
#[derive(Default)]
struct HeadFields {
    /// A `Content-Length` field is there.
    length_field: bool,
    /// The one length all its values agree on (pingora's `content_length_for_framing`; None:
    /// unparseable or in conflict).
    length: Option<usize>,
    /// Chunked is the final coding of the last `Transfer-Encoding` field (pingora's
    /// `is_chunked_encoding_from_headers`).
    chunked: bool,
    date: bool,
    connection: bool,
}

impl HeadFields {
    fn of(headers: &HeaderMap) -> Self {
        let mut f = HeadFields::default();
        // Err: the lengths cannot frame the body.
        let mut length: std::result::Result<Option<u64>, ()> = Ok(None);
        for (name, value) in headers {
            if *name == header::CONTENT_LENGTH {
                f.length_field = true;
                if let Ok(agreed) = length {
                    length = add_lengths(agreed, value);
                }
            } else if *name == header::TRANSFER_ENCODING {
                // A name's values come one after the other: the last one seen is the last.
                let bytes = value.as_bytes();
                let token = bytes
                    .iter()
                    .rposition(|b| *b == b',')
                    .map_or(bytes, |p| &bytes[p + 1..]);
                f.chunked = token.trim_ascii().eq_ignore_ascii_case(b"chunked");
            } else if *name == header::DATE {
                f.date = true;
            } else if *name == header::CONNECTION {
                f.connection = true;
            }
        }
        f.length = length.ok().flatten().and_then(|n| usize::try_from(n).ok());
        f
    }
}

/// The length so far and a `Content-Length` value's list of lengths, which must agree with it.
fn add_lengths(
    mut length: Option<u64>,
    value: &HeaderValue,
) -> std::result::Result<Option<u64>, ()> {
    // Visible ASCII only, as `to_str` takes it; then by bytes (a char searcher for `,` and a
    // Unicode trim cost more than the rest of the pass).
    let line = value.to_str().map_err(|_| ())?.as_bytes();
    for v in line.split(|b| *b == b',') {
        let v = v.trim_ascii();
        if v.is_empty() {
            return Err(());
        }
        let n = v
            .iter()
            .try_fold(0u64, |n, b| {
                b.is_ascii_digit().then_some(())?;
                n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
            })
            .ok_or(())?;
        match length {
            None => length = Some(n),
            Some(prev) if prev != n => return Err(()),
            Some(_) => {}
        }
    }
    Ok(length)
}

impl Drop for OwnSession {
    fn drop(&mut self) {
        if self.will_keepalive() {
            if let (Some(stream), Ok(mut parked)) = (self.stream.take(), self.conn.parked.lock()) {
                *parked = Some(stream);
            }
        }
    }
}

#[async_trait]
impl CustomSession for OwnSession {
    fn req_header(&self) -> &RequestHeader {
        &self.req
    }

    fn req_header_mut(&mut self) -> &mut RequestHeader {
        &mut self.req
    }

    async fn read_body_bytes(&mut self) -> Result<Option<Bytes>> {
        Ok(None)
    }

    async fn drain_request_body(&mut self) -> Result<()> {
        Ok(())
    }

    async fn write_response_header(&mut self, resp: Box<ResponseHeader>, _end: bool) -> Result<()> {
        self.write_head(resp).await
    }

    async fn write_response_header_ref(&mut self, resp: &ResponseHeader, _end: bool) -> Result<()> {
        self.write_head(Box::new(resp.clone())).await
    }

    /// As `ServerSession::write_response_body` writes to pingora's session.
    async fn write_body(&mut self, data: Bytes, end: bool) -> Result<()> {
        if !data.is_empty() {
            self.write_body_timed(&data).await?;
        }
        if end {
            self.finish_body().await?;
        }
        Ok(())
    }

    /// pingora's HTTP/1 session sends no trailers either.
    async fn write_trailers(&mut self, _trailers: HeaderMap) -> Result<()> {
        Ok(())
    }

    async fn response_duplex_vec(&mut self, tasks: Vec<HttpTask>) -> Result<bool> {
        self.duplex_vec(tasks).await
    }

    fn set_read_timeout(&mut self, timeout: Option<Duration>) {
        self.read_timeout = timeout;
    }

    fn get_read_timeout(&self) -> Option<Duration> {
        self.read_timeout
    }

    fn set_write_timeout(&mut self, timeout: Option<Duration>) {
        self.write_timeout = timeout;
    }

    fn get_write_timeout(&self) -> Option<Duration> {
        self.write_timeout
    }

    fn set_total_drain_timeout(&mut self, timeout: Option<Duration>) {
        self.drain_timeout = timeout;
    }

    fn get_total_drain_timeout(&self) -> Option<Duration> {
        self.drain_timeout
    }

    fn request_summary(&self) -> String {
        let host = self
            .req
            .headers
            .get(header::HOST)
            .map_or(&b""[..], |h| h.as_bytes());
        format!(
            "{} {}, Host: {}",
            self.req.method.as_str(),
            String::from_utf8_lossy(self.req.raw_path()),
            String::from_utf8_lossy(host)
        )
    }

    fn response_written(&self) -> Option<&ResponseHeader> {
        self.response_written.as_deref()
    }

    async fn shutdown(&mut self, _code: u32, _ctx: &str) {
        if let Ok(io) = self.io() {
            Shutdown::shutdown(io).await;
        }
    }

    fn is_body_done(&mut self) -> bool {
        true
    }

    async fn finish(&mut self) -> Result<()> {
        self.finish_body().await.map(|_| ())
    }

    fn is_body_empty(&mut self) -> bool {
        true
    }

    async fn read_body_or_idle(&mut self, _no_body_expected: bool) -> Result<Option<Bytes>> {
        self.body_or_idle().await
    }

    fn body_bytes_sent(&self) -> usize {
        self.body_bytes_sent
    }

    fn body_bytes_read(&self) -> usize {
        0
    }

    fn digest(&self) -> Option<&Digest> {
        Some(&self.digest)
    }

    fn digest_mut(&mut self) -> Option<&mut Digest> {
        Some(&mut self.digest)
    }

    fn client_addr(&self) -> Option<&SocketAddr> {
        self.digest.socket_digest.as_ref()?.peer_addr()
    }

    fn server_addr(&self) -> Option<&SocketAddr> {
        self.digest.socket_digest.as_ref()?.local_addr()
    }

    fn pseudo_raw_h1_request_header(&self) -> Bytes {
        self.raw.clone()
    }

    /// A request without a body leaves nothing to buffer (pingora's buffer stays empty and
    /// hands out nothing).
    fn enable_retry_buffering(&mut self) {}

    fn retry_buffer_truncated(&self) -> bool {
        false
    }

    fn get_retry_buffer(&self) -> Option<Bytes> {
        None
    }

    async fn finish_custom(&mut self) -> Result<()> {
        Ok(())
    }

    fn take_custom_message_reader(
        &mut self,
    ) -> Option<Box<dyn futures::Stream<Item = Result<Bytes>> + Unpin + Send + Sync + 'static>>
    {
        None
    }

    fn restore_custom_message_reader(
        &mut self,
        _reader: Box<dyn futures::Stream<Item = Result<Bytes>> + Unpin + Send + Sync + 'static>,
    ) -> Result<()> {
        Error::e_explain(ErrorType::InternalError, "HTTP/1 has no custom messages")
    }

    fn take_custom_message_writer(&mut self) -> Option<Box<dyn CustomMessageWrite>> {
        None
    }

    fn restore_custom_message_writer(
        &mut self,
        _writer: Box<dyn CustomMessageWrite>,
    ) -> Result<()> {
        Error::e_explain(ErrorType::InternalError, "HTTP/1 has no custom messages")
    }
}

/// A connection that is none: pingora's proxy session is made only around an HTTP/1 session
/// of its own, which this stands in for until the own session replaces it.
#[derive(Debug)]
pub(crate) struct Vacant;

impl tokio::io::AsyncRead for Vacant {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        _buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for Vacant {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        _buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Ready(Err(std::io::ErrorKind::NotConnected.into()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[async_trait]
impl Shutdown for Vacant {
    async fn shutdown(&mut self) {}
}

impl UniqueID for Vacant {
    fn id(&self) -> UniqueIDType {
        -1
    }
}

impl Ssl for Vacant {}
impl Peek for Vacant {}

impl GetTimingDigest for Vacant {
    fn get_timing_digest(&self) -> Vec<Option<pingora_core::protocols::TimingDigest>> {
        Vec::new()
    }
}

impl GetProxyDigest for Vacant {
    fn get_proxy_digest(&self) -> Option<Arc<pingora_core::protocols::raw_connect::ProxyDigest>> {
        None
    }
}

impl GetSocketDigest for Vacant {
    fn get_socket_digest(&self) -> Option<Arc<pingora_core::protocols::SocketDigest>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_upper_case_hex_as_pingora_writes_them() {
        for n in [0usize, 1, 9, 10, 15, 16, 255, 4096, 0xABCDEF, usize::MAX] {
            let mut buf = [0u8; 18];
            assert_eq!(chunk_size(n, &mut buf), format!("{n:X}\r\n").as_bytes());
        }
    }

    #[test]
    fn framing_reads_lengths_and_codings_as_pingora_does() {
        let map = |fields: &[(&str, &str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in fields {
                m.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            m
        };
        let cl = |fields: &[(&str, &str)]| HeadFields::of(&map(fields)).length;
        assert_eq!(cl(&[("content-length", "5")]), Some(5));
        assert_eq!(cl(&[("content-length", "5, 5")]), Some(5));
        assert_eq!(
            cl(&[("content-length", "5"), ("content-length", "5")]),
            Some(5)
        );
        assert_eq!(
            cl(&[("content-length", "5"), ("content-length", "6")]),
            None
        );
        assert_eq!(cl(&[("content-length", "+5")]), None);
        assert_eq!(cl(&[("content-length", "")]), None);
        assert_eq!(cl(&[("content-length", "5,")]), None);
        assert_eq!(cl(&[("content-length", "99999999999999999999999")]), None);
        assert_eq!(cl(&[]), None);
        assert!(HeadFields::of(&map(&[("content-length", "x")])).length_field);
        assert!(!HeadFields::of(&map(&[])).length_field);
        let chunked = |fields: &[(&str, &str)]| HeadFields::of(&map(fields)).chunked;
        assert!(chunked(&[("transfer-encoding", "chunked")]));
        assert!(chunked(&[("transfer-encoding", "gzip, Chunked ")]));
        assert!(chunked(&[
            ("transfer-encoding", "gzip"),
            ("transfer-encoding", "chunked")
        ]));
        assert!(!chunked(&[
            ("transfer-encoding", "chunked"),
            ("transfer-encoding", "gzip")
        ]));
        assert!(!chunked(&[("transfer-encoding", "chunked, gzip")]));
        assert!(!chunked(&[]));
        let f = HeadFields::of(&map(&[("date", "x"), ("content-length", "1")]));
        assert!(f.date && !f.connection && f.length == Some(1));
        let f = HeadFields::of(&map(&[("connection", "close")]));
        assert!(!f.date && f.connection && !f.length_field);
    }

    #[test]
    fn targets_envoy_refuses_are_marked_for_its_400() {
        let mark = |h: &[u8]| {
            let mut h = h.to_vec();
            let marked = mark_refused_target(&mut h);
            (marked, h)
        };
        // Each control byte, space and DEL inside the target; nothing else of the head.
        for b in (0u8..=b' ').chain([0x7f]).filter(|b| *b != b'\n') {
            let head = [&b"GET /a"[..], &[b], b"b?q HTTP/1.1\r\nHost: x y\r\n\r\n"].concat();
            let (marked, out) = mark(&head);
            assert!(marked, "{b:#x}");
            assert_eq!(out[6], b'#', "{b:#x}");
            assert_eq!(out[..6], head[..6]);
            assert_eq!(out[7..], head[7..]);
            // Marked, the head parses: the request reaches the check that answers Envoy's 400.
            assert!(plain(&out).is_some(), "{b:#x}");
        }
        for ok in [
            &b"GET /a<b>\"{}|^` HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"GET /a HTTP/1.1\r\nx: a b\r\n\r\n",
            b"GET / HTTP/1.1\nHost: x\n\n",
            b"nonsense\r\n\r\n",
            b"GET /a\nb HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(mark(ok), (false, ok.to_vec()));
        }
    }

    #[test]
    fn plain_heads_are_those_the_own_loop_serves() {
        let ok = |h: &str| plain(h.as_bytes()).is_some();
        assert!(ok("GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(ok(
            "GET /x?y HTTP/1.1\r\nhost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ));
        assert!(!ok("GET / HTTP/1.0\r\nHost: a\r\n\r\n"));
        assert!(!ok("GET / HTTP/1.1\r\n\r\n"));
        assert!(!ok("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"));
        assert!(!ok("GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(!ok(
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\n"
        ));
        assert!(!ok(
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: ws\r\n\r\n"
        ));
        assert!(!ok(
            "GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n"
        ));
        assert!(!ok(
            "GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        ));
        assert!(!ok("CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n"));
        let p = plain(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").unwrap();
        assert_eq!(p.keepalive(), None);
        let p = plain(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Keep-Alive\r\n\r\n").unwrap();
        assert_eq!(p.keepalive(), Some(0));
        let p = plain(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert_eq!(p.keepalive(), Some(0));
    }

    /// One `Plain` serves a connection's every request: each parse leaves only its own head
    /// in it, whatever an earlier one (longer, refused half-way) left.
    #[tokio::test]
    async fn a_plain_parsed_again_holds_only_the_latest_head() {
        let (mut d, _client) = connection().await;
        let mut p = Plain::default();
        let first: &[u8] =
            b"POST /first?q HTTP/1.1\r\nHost: one\r\nA: 1\r\nB: 2\r\nConnection: close\r\n\r\n";
        assert!(p.parse(first));
        assert_eq!(p.keepalive(), None);
        // Refused after some of its fields were read.
        assert!(!p.parse(b"GET /x HTTP/1.1\r\nHost: x\r\nC: 3\r\nExpect: 100-continue\r\n\r\n"));
        let second: &[u8] = b"GET /second HTTP/1.1\r\nhost: two\r\n\r\n";
        assert!(p.parse(second));
        assert_eq!(p.keepalive(), Some(0));
        d.unread(second);
        let (req, raw) = p.take(&mut d).expect("taken");
        assert_eq!(&raw[..], second);
        assert_eq!(req.method, Method::GET);
        assert_eq!(req.uri, "/second");
        let fields: Vec<_> = req
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(fields, [("host", &b"two"[..])]);
    }

    /// A `#` in the target is left on the connection for pingora's session, whose head the
    /// connection manager checks for it (`downstream::has_fragment` looks at no own
    /// session's); one in the method is not a fragment.
    #[tokio::test]
    async fn a_target_with_a_hash_is_left_to_pingoras_session() {
        for head in [
            &b"GET /a#b HTTP/1.1\r\nHost: a\r\n\r\n"[..],
            b"GET /#? HTTP/1.1\r\nHost: a\r\n\r\n",
            b"G#T /a#b HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            let (mut d, _client) = connection().await;
            let mut p = Plain::default();
            assert!(p.parse(head), "{head:?} parses");
            d.unread(head);
            assert!(p.take(&mut d).is_none(), "{head:?} taken");
            assert_eq!(d.ahead(), head, "{head:?} left whole");
        }
        for head in [
            &b"G-T /a?b=%23 HTTP/1.1\r\nHost: a\r\n\r\n"[..],
            b"G#T /a HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            let (mut d, _client) = connection().await;
            let mut p = Plain::default();
            assert!(p.parse(head));
            d.unread(head);
            assert!(p.take(&mut d).is_some(), "{head:?} left");
        }
    }

    /// `OwnAt` finds the own session it was taken from, and nothing in a session holding
    /// another (an own session boxed elsewhere, the empty placeholder, pingora's own).
    #[tokio::test]
    async fn own_at_finds_only_the_session_it_was_taken_from() {
        let head = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n";
        let (own, _conn, _client) = session(head, Some(0)).await;
        let own = Box::new(own);
        let at = OwnAt::of(&own);
        let mut s = ServerSession::new_custom(own);
        let found = at.get(&mut s).expect("the own session");
        assert_eq!(found.req.uri, "/a");
        found.body_bytes_sent = 7;
        // What was changed through it is what the trait sees.
        let ServerSession::Custom(c) = &s else {
            panic!("a custom session");
        };
        assert_eq!(c.body_bytes_sent(), 7);
        assert!(OwnAt::default().get(&mut s).is_none());

        let (other, _conn, _client) = session(head, Some(0)).await;
        let mut elsewhere = ServerSession::new_custom(Box::new(other));
        assert!(at.get(&mut elsewhere).is_none());
        let mut empty = ServerSession::new_custom(Box::new(()));
        assert!(at.get(&mut empty).is_none());
        // Taken from the placeholder's own address: its size tells it apart.
        let ServerSession::Custom(c) = &mut empty else {
            panic!("a custom session");
        };
        let placeholder = (&mut **c as *mut dyn CustomSession).cast::<u8>() as usize;
        assert!(OwnAt(placeholder).get(&mut empty).is_none());
        let (d, _client) = connection().await;
        let mut pingoras = ServerSession::new_http1(d);
        assert!(at.get(&mut pingoras).is_none());
    }

    /// A real connection as the listener hands it over, and the client's end.
    async fn connection() -> (Box<Downstream>, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (server, peer) = l.accept().await.expect("accept");
        (Box::new(Downstream::new(server, peer)), client)
    }

    /// A session over a real connection, for a request head; and the client's end.
    async fn session(
        head: &[u8],
        keep: Option<u64>,
    ) -> (OwnSession, Arc<Conn>, tokio::net::TcpStream) {
        let (mut d, client) = connection().await;
        d.unread(head);
        let p = plain(head).expect("a plain head");
        let (req, raw) = p.take(&mut d).expect("taken");
        let conn = Arc::new(Conn::new(keep));
        (
            OwnSession::new(d, req, raw, conn.clone(), None),
            conn,
            client,
        )
    }

    /// What the client has received, the `date` value masked.
    async fn received(mut c: tokio::net::TcpStream) -> String {
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(300), c.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf).into_owned();
        text.split("\r\n")
            .map(|l| match l.strip_prefix("date: ") {
                Some(_) => "date: *",
                None => l,
            })
            .collect::<Vec<_>>()
            .join("\r\n")
    }

    #[tokio::test]
    async fn heads_are_written_as_envoy_names_them_and_framed_as_pingora_frames_them() {
        // Kept: names lower case, `date` set, no `connection`; a length frames the body.
        let (mut s, conn, c) = session(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n", Some(0)).await;
        assert_eq!(s.req_header().uri, "/a");
        assert_eq!(s.req_header().headers["host"], "h");
        let mut resp = ResponseHeader::build(200, Some(4)).expect("head");
        resp.append_header("Content-Type", "text/plain")
            .expect("header");
        resp.append_header("Content-Length", "5").expect("header");
        let tasks = vec![
            HttpTask::Header(Box::new(resp), false),
            HttpTask::Body(Some(Bytes::from_static(b"hello")), true),
        ];
        assert!(s.response_duplex_vec(tasks).await.expect("written"));
        assert_eq!(s.body_bytes_sent(), 5);
        assert_eq!(s.response_written().map(|r| r.status.as_u16()), Some(200));
        drop(s);
        // Kept: the session handed the connection back.
        let d = conn.take().expect("parked");
        drop(d);
        assert_eq!(
            received(c).await,
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\ndate: *\r\n\r\nhello"
        );

        // Closing: `connection: close`; no length: chunked bodies in upper-case hex, one
        // chunk for a batch's bodies.
        let (mut s, conn, c) = session(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", None).await;
        let mut resp = ResponseHeader::build_no_case(200, None).expect("head");
        resp.insert_header("transfer-encoding", "chunked")
            .expect("header");
        let tasks = vec![
            HttpTask::Header(Box::new(resp), false),
            HttpTask::Body(Some(Bytes::from(vec![b'x'; 10])), false),
            HttpTask::Body(Some(Bytes::from(vec![b'y'; 16])), true),
        ];
        assert!(s.response_duplex_vec(tasks).await.expect("written"));
        drop(s);
        assert!(
            conn.take().is_none(),
            "a closed connection is not handed back"
        );
        assert_eq!(
            received(c).await,
            format!(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ndate: *\r\nconnection: close\r\n\r\n1A\r\n{}{}\r\n0\r\n\r\n",
                "x".repeat(10),
                "y".repeat(16)
            )
        );

        // HEAD: the head's length, no body; a 1xx other than 101 is not relayed.
        let (mut s, _conn, c) = session(b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n", Some(0)).await;
        s.write_response_header(
            Box::new(ResponseHeader::build(103, None).expect("head")),
            false,
        )
        .await
        .expect("ignored");
        let mut resp = ResponseHeader::build(200, None).expect("head");
        resp.insert_header("content-length", "5").expect("header");
        s.write_response_header(Box::new(resp), false)
            .await
            .expect("written");
        s.write_body(Bytes::from_static(b"hello"), true)
            .await
            .expect("nothing to write");
        assert_eq!(s.body_bytes_sent(), 0);
        drop(s);
        assert_eq!(
            received(c).await,
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ndate: *\r\n\r\n"
        );
    }

    #[tokio::test]
    async fn a_short_body_is_an_error_and_the_hooks_keep_alive_decides() {
        let (mut s, conn, _c) = session(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", Some(0)).await;
        let mut resp = ResponseHeader::build(200, None).expect("head");
        resp.insert_header("content-length", "5").expect("header");
        s.write_response_header(Box::new(resp), false)
            .await
            .expect("written");
        let e = s
            .write_body(Bytes::from_static(b"hel"), true)
            .await
            .expect_err("short");
        assert_eq!(e.etype(), &PREMATURE_BODY_END);
        // A hook's decision (through the context's `Conn`) is what the session reads.
        conn.set_keepalive(None);
        drop(s);
        assert!(conn.take().is_none());
    }

    #[test]
    fn conn_keeps_what_the_hooks_decide() {
        let c = Conn::new(Some(0));
        assert_eq!(c.keepalive(), Some(0));
        assert!(will_keepalive(&c, None));
        assert!(!will_keepalive(&c, Some(0)));
        c.set_keepalive(Some(30));
        assert_eq!(c.keepalive(), Some(30));
        c.set_keepalive(Some(u64::MAX));
        assert_eq!(
            c.keepalive(),
            Some(u64::MAX - 1),
            "a limit is never taken for none"
        );
        c.set_keepalive(None);
        assert_eq!(c.keepalive(), None);
        assert!(!will_keepalive(&c, Some(3)));
        assert!(c.take().is_none());
    }
}
