//! The upstream half of the own HTTP/1.1 loop (`h1`): the request head written and a response
//! with a `Content-Length` read without pingora's client session.
//!
//! pingora's `HttpSession` (client) reads a response head into one buffer, parses it, builds
//! the header, then clones it for the task it hands over, and reads each part of the body under
//! a timer of its own; for the common answer (HTTP/1.1, a length, a status that has a body) that
//! was a fifth of the instructions a proxied request costs. Here the head is parsed once, the
//! header built as pingora builds it (same names with their case, same value normalization,
//! same reason phrase) and handed over without a copy, and the body sliced out of the bytes
//! already read.
//!
//! Everything else goes to pingora's session, exactly: a request it must frame (HEAD, a body,
//! a `Connection` header other than `close`), a stream that cannot take bytes back (not plain
//! TCP), and any response head this reader does not take whole (partial after the first read,
//! HTTP/1.0, 1xx, 101, 204, 304, chunked, no length or one pingora would reconcile or refuse, a
//! `Connection` header other than a lone `close` or `keep-alive`, anything httparse refuses).
//! The bytes read so far are put back in front of the stream and pingora's session reads them
//! as it would have, errors and all.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora_core::protocols::http::v1::client::HttpSession as ClientV1;
use pingora_core::protocols::http::HttpTask;
use pingora_core::protocols::UniqueID;
use pingora_error::{Error, ErrorType, OrErr, Result, RetryType};
use pingora_http::{RequestHeader, ResponseHeader};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{timeout, Instant};

use super::framing::Limits;
use super::timeouts::LazyTimer;
use super::up_io::Io;

/// pingora's first read of a response head (`INIT_HEADER_BUF_SIZE`).
const HEAD_BUF: usize = 4096;
/// pingora's body reads (`BODY_BUF_LIMIT`): an upstream read takes up to this much.
const BODY_BUF: usize = 64 * 1024;
/// Headers one parse takes (pingora's `MAX_HEADERS`); more goes to pingora's session.
const MAX_HEADERS: usize = 256;

/// One upstream exchange on an HTTP/1 connection.
// The large variant is the common one: boxing it would add an allocation to every request.
#[allow(clippy::large_enum_variant)]
pub(super) enum Upstream {
    Own(Exchange),
    /// Boxed: the rare case's room (472 bytes) is not carried by the common one.
    Pingora(Box<ClientV1>),
    /// Only while the exchange moves to pingora's session.
    Moving,
}

pub(super) struct Exchange {
    stream: Io,
    /// What was read of a response head this exchange leaves to pingora's session, which
    /// reads it again.
    unread: Bytes,
    /// Body bytes read with the head, not yet handed over.
    pre: Bytes,
    state: State,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    /// When the read timeout was worked out (`Upstream::read_from`): the response head's
    /// deadline counts from there, without another reading of the clock.
    head_from: Option<Instant>,
    /// The peer's tolerance of an invalid `Content-Length`, for pingora's session should the
    /// response go to it.
    allow_invalid_length: bool,
    /// The connection is closed after this exchange (the request or the response said so).
    close: bool,
    /// The response head's length as it came (for `Limits::check`).
    head_len: usize,
    /// The cluster takes header names in the case the request kept (`head::request_wire`).
    keep_case: bool,
    /// The response head keeps its names' case: pingora's downstream session writes them so.
    /// Portico's own session writes them lower case, as Envoy does, and needs none.
    response_case: bool,
}

enum State {
    /// Before the request is written.
    Request,
    /// Reading the response head.
    Head,
    /// The body's bytes still to hand over (`pre` holds those already read).
    Body { left: usize },
    /// The whole response read; whether the connection may carry another request.
    Done { reusable: bool },
}

impl Upstream {
    /// An exchange on a connection (pooled or new) to `peer`.
    pub fn new<P: pingora_core::upstreams::peer::Peer>(stream: Io, peer: &P) -> Upstream {
        // Only a plain TCP stream can take read bytes back for pingora's session.
        if !stream.is_plain() {
            return Upstream::Pingora(Box::new(ClientV1::new_with_options(
                stream.into_stream(),
                peer,
            )));
        }
        let options = peer.get_peer_options();
        Upstream::Own(Exchange {
            stream,
            unread: Bytes::new(),
            pre: Bytes::new(),
            state: State::Request,
            read_timeout: None,
            write_timeout: None,
            head_from: None,
            allow_invalid_length: options
                .is_some_and(|o| o.allow_h1_response_invalid_content_length),
            close: false,
            head_len: 0,
            keep_case: false,
            response_case: true,
        })
    }

    /// The read timeout (`set_timeouts`) was worked out at `at`, moments before the request
    /// is written: the response head's deadline is `at` plus it. For a pooled connection
    /// (a new one's connect comes between).
    pub fn read_from(&mut self, at: std::time::Instant) {
        if let Upstream::Own(x) = self {
            x.head_from = Some(Instant::from_std(at));
        }
    }

    pub fn set_timeouts(&mut self, read: Option<Duration>, write: Option<Duration>) {
        match self {
            Upstream::Own(x) => {
                x.read_timeout = read;
                x.write_timeout = write;
            }
            Upstream::Pingora(c) => {
                c.read_timeout = read;
                c.write_timeout = write;
            }
            Upstream::Moving => {}
        }
    }

    /// Whether the cluster takes header names in their case (its `header_key_format`); pingora's
    /// session, for what goes to it, writes them as the request keeps them.
    pub fn set_keep_case(&mut self, keep: bool) {
        if let Upstream::Own(x) = self {
            x.keep_case = keep;
        }
    }

    /// Whether the response head keeps its names' case (see `Exchange::response_case`).
    pub fn set_response_case(&mut self, keep: bool) {
        if let Upstream::Own(x) = self {
            x.response_case = keep;
        }
    }

    pub fn id(&self) -> i32 {
        match self {
            Upstream::Own(x) => x.stream.id(),
            Upstream::Pingora(c) => c.id(),
            Upstream::Moving => -1,
        }
    }

    /// The connection's own address (`%UPSTREAM_LOCAL_ADDRESS%`), without a whole digest
    /// made for it (its timing part is an allocation).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        let socket = match self {
            Upstream::Own(x) => return x.stream.local_addr(),
            Upstream::Pingora(c) => c.digest().socket_digest.clone(),
            Upstream::Moving => None,
        }?;
        socket.local_addr()?.as_inet().copied()
    }

    /// pingora's `write_request_header`: a request this exchange does not frame itself goes to
    /// pingora's session from here on.
    pub async fn write_request_header(&mut self, req: Box<RequestHeader>) -> Result<usize> {
        if let Some(written) = self.write_own(&req).await {
            return written;
        }
        match self {
            Upstream::Pingora(c) => c.write_request_header(req).await,
            _ => Err(moving()),
        }
    }

    /// `write_request_header` of the client's head itself (no copy edited for the upstream):
    /// pingora's session, which keeps the head it writes, gets a copy.
    pub async fn write_request(&mut self, req: &RequestHeader) -> Result<usize> {
        if let Some(written) = self.write_own(req).await {
            return written;
        }
        let copy = Box::new(super::head::clone_request(req));
        self.write_request_header(copy).await
    }

    /// The head written by this exchange when it frames the request itself; None: handed to
    /// pingora's session (or there is none), which is to write it.
    async fn write_own(&mut self, req: &RequestHeader) -> Option<Result<usize>> {
        let Upstream::Own(x) = self else {
            return None;
        };
        match own_request(req) {
            Some(close) => {
                x.close = close;
                Some(x.write_head(req).await)
            }
            None => {
                self.hand_to_pingora();
                None
            }
        }
    }

    /// pingora's `write_body` for what a body filter made of an empty body: the request said
    /// no length, which pingora's writer frames as zero bytes, so nothing is written.
    pub async fn write_body(&mut self, data: &[u8]) -> Result<Option<usize>> {
        match self {
            Upstream::Own(_) => Ok(None),
            Upstream::Pingora(c) => c.write_body(data).await,
            Upstream::Moving => Err(moving()),
        }
    }

    pub async fn finish_body(&mut self) -> Result<Option<usize>> {
        match self {
            Upstream::Own(x) => {
                x.stream
                    .flush()
                    .await
                    .or_err(ErrorType::WriteError, "flushing body")?;
                Ok(Some(0))
            }
            Upstream::Pingora(c) => c.finish_body().await,
            Upstream::Moving => Err(moving()),
        }
    }

    /// pingora's `read_response_task`. Cancel safe: a read that has not completed took nothing.
    /// `timer` times the reads (the connection's, kept from one request to the next); a head
    /// beyond `limits` is refused (`framing::Limits`), counted as it came.
    pub async fn read_response_task(
        &mut self,
        timer: &mut LazyTimer,
        limits: Limits,
    ) -> Result<HttpTask> {
        if let Upstream::Own(x) = self {
            match x.task(timer).await? {
                Some(task) => {
                    if let HttpTask::Header(head, _) = &task {
                        limits.check(head.headers.len(), x.head_len)?;
                    }
                    return Ok(task);
                }
                None => self.hand_to_pingora(),
            }
        }
        match self {
            Upstream::Pingora(c) => {
                let mut task = c.read_response_task().await?;
                if let HttpTask::Header(head, _) = &mut task {
                    // The heads this exchange reads itself are ones Envoy takes as they are.
                    let raw = c.get_headers_raw_bytes();
                    limits.check(head.headers.len(), raw.len())?;
                    super::framing::check_raw(&raw)?;
                    super::framing::check_head(head)?;
                }
                Ok(task)
            }
            _ => Err(moving()),
        }
    }

    /// pingora's `respect_keepalive` then `reuse`: the connection when it may carry another
    /// request, else it is shut.
    pub async fn reuse(self) -> Option<Io> {
        match self {
            Upstream::Own(mut x) => {
                if matches!(x.state, State::Done { reusable: true }) {
                    Some(x.stream)
                } else {
                    x.stream.shutdown().await;
                    None
                }
            }
            Upstream::Pingora(mut c) => {
                c.respect_keepalive();
                c.reuse().await.map(Io::Stream)
            }
            Upstream::Moving => None,
        }
    }

    /// Hands the exchange to pingora's session, the bytes read so far put back on the stream.
    fn hand_to_pingora(&mut self) {
        let Upstream::Own(x) = std::mem::replace(self, Upstream::Moving) else {
            return;
        };
        // `new` takes only plain TCP streams, so this holds.
        let Some(tcp) = x.stream.into_pingora(&x.unread) else {
            return;
        };
        let mut c = ClientV1::new(Box::new(tcp));
        c.set_allow_h1_response_invalid_content_length(x.allow_invalid_length);
        c.read_timeout = x.read_timeout;
        c.write_timeout = x.write_timeout;
        *self = Upstream::Pingora(Box::new(c));
    }
}

/// An exchange that could not move to pingora's session (it never fails to: see `hand_to_pingora`).
fn moving() -> Box<Error> {
    Error::explain(
        ErrorType::InternalError,
        "the upstream exchange was lost moving to pingora's session",
    )
}

/// Whether this exchange writes `req` itself: no body to frame and not HEAD (whose response
/// pingora's session must know to read without a body). `Some(close)`: whether the request
/// asks to close the connection after it.
fn own_request(req: &RequestHeader) -> Option<bool> {
    if req.method == http::Method::HEAD || req.version != http::Version::HTTP_11 {
        return None;
    }
    // One pass over the (few) fields rather than three lookups by name.
    let mut close = None;
    for (k, v) in req.headers.iter() {
        if *k == http::header::TRANSFER_ENCODING {
            return None;
        } else if *k == http::header::CONTENT_LENGTH {
            if v != "0" {
                return None;
            }
        } else if *k == http::header::CONNECTION && close.is_none() {
            // The first `Connection` decides, as a lookup by name reads it.
            if !v.as_bytes().eq_ignore_ascii_case(b"close") {
                return None;
            }
            close = Some(true);
        }
    }
    Some(close.unwrap_or(false))
}

impl Exchange {
    async fn write_head(&mut self, req: &RequestHeader) -> Result<usize> {
        let wire = super::head::request_wire(req, self.keep_case).ok_or_else(|| {
            Error::explain(
                ErrorType::InvalidHTTPHeader,
                "request-line contains forbidden delimiter bytes or unsupported HTTP version",
            )
        })?;
        let write = self.stream.write_all(&wire);
        match self.write_timeout {
            Some(t) => match timeout(t, write).await {
                Ok(r) => r,
                Err(_) => Err(std::io::Error::from(std::io::ErrorKind::TimedOut)),
            },
            None => write.await,
        }
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut => Error::because(
                ErrorType::WriteTimedout,
                "while writing request headers (timeout)",
                e,
            ),
            _ => Error::because(ErrorType::WriteError, "while writing request headers", e),
        })?;
        self.stream
            .flush()
            .await
            .or_err(ErrorType::WriteError, "flushing request header")?;
        self.state = State::Head;
        Ok(wire.len())
    }

    /// The next task; None: the response goes to pingora's session.
    async fn task(&mut self, timer: &mut LazyTimer) -> Result<Option<HttpTask>> {
        match self.state {
            State::Request | State::Head => self.head(timer).await,
            State::Body { left } => self.body(left, timer).await.map(Some),
            State::Done { .. } => Ok(Some(HttpTask::Done)),
        }
    }

    async fn head(&mut self, timer: &mut LazyTimer) -> Result<Option<HttpTask>> {
        self.state = State::Head;
        // One read into a buffer of its own (a read that does not complete takes nothing, so
        // a dropped one loses nothing): a head that needs more goes to pingora's session with
        // what came.
        let mut buf = BytesMut::with_capacity(HEAD_BUF);
        let read = self.stream.read_buf(&mut buf);
        let read = match self.read_timeout {
            Some(t) => match timer
                .bound(self.head_from.take().unwrap_or_else(Instant::now) + t, read)
                .await
            {
                Some(r) => r,
                None => {
                    return Error::e_explain(
                        ErrorType::ReadTimedout,
                        "while reading response headers",
                    );
                }
            },
            None => read.await,
        };
        // pingora's messages; nothing was read before this read.
        match read {
            Ok(0) => {
                let mut e = Error::explain(
                    ErrorType::ConnectionClosed,
                    "while reading response headers, bytes already read: 0",
                );
                e.retry = RetryType::ReusedOnly;
                return Err(e);
            }
            Ok(_) => {}
            Err(e) => {
                let os = e.raw_os_error().is_some();
                let mut e = Error::because(
                    ErrorType::ReadError,
                    "while reading response headers, bytes already read: 0",
                    e,
                );
                if os {
                    e.retry = RetryType::ReusedOnly;
                }
                return Err(e);
            }
        }
        let buf = buf.freeze();
        let Some(head) = parse_head(&buf, self.response_case) else {
            self.unread = buf;
            return Ok(None);
        };
        self.head_len = head.body_at;
        self.after_head(buf.slice(head.body_at..), head.length, head.close);
        let end = head.length == 0;
        Ok(Some(HttpTask::Header(Box::new(head.header), end)))
    }

    /// Where the body stands once the head is parsed: `body` holds what came after it.
    fn after_head(&mut self, body: Bytes, length: usize, close: bool) {
        self.close |= close;
        if length == 0 {
            // Bytes past an empty body: more is coming that no request asked for.
            self.state = State::Done {
                reusable: !self.close && body.is_empty(),
            };
            return;
        }
        self.pre = body;
        self.state = State::Body { left: length };
    }

    async fn body(&mut self, left: usize, timer: &mut LazyTimer) -> Result<HttpTask> {
        let mut data = std::mem::take(&mut self.pre);
        if data.is_empty() {
            let mut buf = BytesMut::with_capacity(BODY_BUF);
            let mut limited = (&mut self.stream).take(BODY_BUF as u64);
            let read = limited.read_buf(&mut buf);
            let n = match self.read_timeout {
                Some(t) => match timer.bound(Instant::now() + t, read).await {
                    Some(r) => r,
                    None => {
                        return Error::e_explain(
                            ErrorType::ReadTimedout,
                            format!("reading body, timeout: {t:?}"),
                        )
                    }
                },
                None => read.await,
            }
            .or_err(ErrorType::ReadError, "when reading body")?;
            if n == 0 {
                self.state = State::Done { reusable: false };
                return Error::e_explain(
                    ErrorType::ConnectionClosed,
                    format!(
                        "Peer prematurely closed connection with {left} bytes of body remaining to read"
                    ),
                );
            }
            data = buf.freeze();
        }
        let n = data.len();
        if n >= left {
            if n > left {
                tracing::warn!(
                    "Peer sent more data than expected: extra {} bytes",
                    n - left
                );
                data.truncate(left);
            }
            self.state = State::Done {
                reusable: n == left && !self.close,
            };
            Ok(HttpTask::Body(Some(data), true))
        } else {
            self.state = State::Body { left: left - n };
            Ok(HttpTask::Body(Some(data), false))
        }
    }
}

/// A response head this exchange takes whole.
struct Head {
    header: ResponseHeader,
    /// Where the body starts in the bytes read.
    body_at: usize,
    length: usize,
    /// The server closes the connection after this response.
    close: bool,
}

/// The response head at the start of `buf`, when this exchange takes it (None: pingora's
/// session reads it); with its names' case when `case`.
fn parse_head(buf: &Bytes, case: bool) -> Option<Head> {
    let mut fields = [const { std::mem::MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let config = httparse::ParserConfig::default();
    // Stricter than pingora's session parses responses: no folded lines (obs-fold), which it
    // allows and turns into spaces, and no spaces before a colon, which it allows and Envoy
    // refuses (`framing::check_raw`): a head with either is its to read. Without folds
    // httparse lets through only bytes a value may hold (`head::parsed_value`), which need
    // neither pingora's normalisation nor another check.
    let body_at = match config.parse_response_with_uninit_headers(&mut resp, buf, &mut fields) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return None,
    };
    if resp.version != Some(1) {
        return None;
    }
    let code = resp.code?;
    if !(200..=599).contains(&code) || code == 204 || code == 304 {
        return None;
    }
    // Room for what the gateway adds (`server`, x-envoy-upstream-service-time, date,
    // connection).
    let size = resp.headers.len() + super::head::ADDED_HEADERS;
    let (mut length, mut close, mut connection) = (None, false, None);
    let token_is = super::head::token_is;
    for (i, h) in resp.headers.iter().enumerate() {
        let name = h.name.as_bytes();
        if token_is(name, b"content-length") {
            if length.is_some() {
                return None;
            }
            length = Some(digits(h.value)?);
        } else if token_is(name, b"transfer-encoding") {
            return None;
        } else if token_is(name, b"connection") {
            if connection.is_some() {
                return None;
            }
            connection = Some(i);
            if token_is(h.value, b"close") {
                close = true;
            } else if !token_is(h.value, b"keep-alive") {
                return None;
            }
        }
    }
    // The names and values as pingora's session takes them: slices of the bytes read. A
    // `Connection` of `close` or `keep-alive` is left out: what it says is in `close`, and the
    // response's filters remove it (hop-by-hop) whatever it holds.
    let fields = resp
        .headers
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != connection)
        .map(|(_, h)| h);
    let value = |h: &httparse::Header| super::head::parsed_value(buf.slice_ref(h.value));
    let header = if case {
        // The names keep the case they came in: without it pingora's writer would
        // capitalise the standard ones, where Envoy writes every name lower case and a mesh's
        // sidecars send them so.
        let mut header = ResponseHeader::build(code, Some(size)).ok()?;
        header.set_version(http::Version::HTTP_11);
        header.set_reason_phrase(resp.reason).ok()?;
        for h in fields {
            header
                .append_header(buf.slice_ref(h.name.as_bytes()), value(h))
                .ok()?;
        }
        header
    } else {
        // The head's parts as pingora's `build_no_case` makes them, without its builder, and
        // its one map filled directly (pingora's appends take a name's case along and parse
        // the name again).
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.status = http::StatusCode::from_u16(code).ok()?;
        parts.version = http::Version::HTTP_11;
        parts.headers.try_reserve(size).ok()?;
        for h in fields {
            let name = super::head::parsed_name(h.name.as_bytes())?;
            parts.headers.try_append(name, value(h)).ok()?;
        }
        let mut header = ResponseHeader::from(parts);
        header.set_reason_phrase(resp.reason).ok()?;
        header
    };
    Some(Head {
        header,
        body_at,
        length: length?,
        close,
    })
}

/// A `Content-Length` of plain digits (what pingora reads as is); anything else (signs,
/// spaces, lists) is pingora's to reconcile or refuse.
fn digits(v: &[u8]) -> Option<usize> {
    if v.is_empty() || v.len() > 15 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0usize, |n, d| {
        n.checked_mul(10)?.checked_add(usize::from(d - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora_core::upstreams::peer::HttpPeer;
    use tokio::io::AsyncWriteExt;

    /// What a client of the exchange sees: each task (a header as its wire form), the error
    /// that ended it if any, and whether the connection went back for reuse; and whether the
    /// own reader kept the response.
    async fn exchange(
        parts: &[&[u8]],
        close: bool,
        own: bool,
        read_timeout: Duration,
        request_close: bool,
    ) -> (Vec<String>, bool, bool) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let parts: Vec<Vec<u8>> = parts.iter().map(|p| p.to_vec()).collect();
        let server = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.expect("accept");
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut b = [0u8; 1];
                if c.read(&mut b).await.expect("read") == 0 {
                    return;
                }
                head.push(b[0]);
            }
            for p in parts {
                c.write_all(&p).await.expect("write");
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            if !close {
                // Held open until the client is done.
                let _ = c.read(&mut [0u8; 1]).await;
            }
        });
        let peer = HttpPeer::new(addr, false, String::new());
        let mut up = if own {
            // Connected as the own loop connects to a plain peer.
            assert!(crate::proxy::up_io::connects_itself(&peer));
            let io = crate::proxy::up_io::connect(&peer).await.expect("connect");
            Upstream::new(io, &peer)
        } else {
            let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let stream = pingora_core::protocols::l4::stream::Stream::from(tcp);
            Upstream::Pingora(Box::new(ClientV1::new(Box::new(stream))))
        };
        up.set_timeouts(Some(read_timeout), None);
        let mut req = RequestHeader::build("GET", b"/x", None).expect("request");
        req.insert_header("Host", "h").expect("host");
        if request_close {
            req.insert_header("Connection", "close")
                .expect("connection");
        }
        up.write_request_header(Box::new(req)).await.expect("write");
        up.finish_body().await.expect("finish");
        let mut seen = Vec::new();
        let mut timer = LazyTimer::default();
        for _ in 0..20 {
            match up.read_response_task(&mut timer, Limits::default()).await {
                Ok(HttpTask::Header(mut h, end)) => {
                    // As the response's filters leave it: the hop-by-hop fields go (the own
                    // reader leaves out a `Connection` it has read).
                    crate::proxy::downstream::strip_response(&mut h);
                    let mut wire = Vec::new();
                    h.header_to_h1_wire(&mut wire);
                    seen.push(format!(
                        "header {} {:?} {:?} end={end} {}",
                        h.status,
                        h.version,
                        h.get_reason_phrase(),
                        String::from_utf8_lossy(&wire)
                    ));
                    if end {
                        break;
                    }
                }
                Ok(HttpTask::Body(b, end)) => {
                    // One entry for the body however the reads split it (timing, not the
                    // reader, decides that).
                    let mut body = b.unwrap_or_default().to_vec();
                    if let Some(last) = seen.last_mut().filter(|l| l.starts_with("body ")) {
                        let prior = std::mem::take(last);
                        let prior = prior.trim_start_matches("body ");
                        let prior = &prior[..prior.rfind(" end=").unwrap_or(prior.len())];
                        body = [prior.as_bytes(), &body].concat();
                        seen.pop();
                    }
                    seen.push(format!("body {} end={end}", String::from_utf8_lossy(&body)));
                    if end {
                        break;
                    }
                }
                Ok(HttpTask::Done) => {
                    seen.push("done".into());
                    break;
                }
                Ok(other) => seen.push(format!("other {other:?}")),
                Err(e) => {
                    seen.push(format!("error {:?} {:?}", e.etype(), e.retry));
                    break;
                }
            }
        }
        let kept_own = matches!(up, Upstream::Own(_));
        let reused = up.reuse().await.is_some();
        server.abort();
        (seen, reused, kept_own)
    }

    #[tokio::test]
    async fn every_response_reads_as_pingoras_session_reads_it() {
        // (parts as written, server closes after, the own reader keeps it: None, when that
        // depends on how the reads split what was written)
        type Case<'a> = (Vec<&'a [u8]>, bool, Option<bool>);
        let cases: Vec<Case> = vec![
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nX-Up: 1\r\n\r\nhello"], false, Some(true)),
            (vec![b"HTTP/1.1 201 Fine Reason\r\nContent-Length: 0\r\n\r\n"], false, Some(true)),
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nextra"], false, Some(true)),
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokextra"], false, Some(true)),
            (vec![b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\ncontent-length: 2\r\n\r\nok"], false, Some(true)),
            (vec![b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"], true, Some(true)),
            (vec![b"HTTP/1.1 500 Oops\r\ncontent-length: 3\r\n\r\n", b"a", b"bc"], false, Some(true)),
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort"], true, Some(true)),
            (vec![b"HTTP/1.1 200 OK\r\nx-e:\r\ncontent-length: 1\r\n\r\n!"], false, Some(true)),
            // Left to pingora's session, the bytes read put back.
            (vec![b"HTTP/1.1 200 OK\r\nx-f: a\r\n b\r\ncontent-length: 1\r\n\r\n!"], false, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\ncont", b"ent-length: 2\r\n\r\nok"], false, None),
            (vec![b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"], false, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok"], false, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\nok"], false, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok"], false, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\n\r\nuntil close"], true, Some(false)),
            (vec![b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"], true, Some(false)),
            (vec![b"HTTP/1.1 204 No Content\r\n\r\n"], false, Some(false)),
            (vec![b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n"], false, Some(false)),
            (vec![b"HTTP/1.1 103 Early\r\nlink: a\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n!"], false, Some(false)),
            (vec![b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n"], true, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\nconnection: keep-alive, foo\r\ncontent-length: 1\r\n\r\n!"], false, Some(false)),
            (vec![b"HTTP/1.1 200 OK\r\nbad header: x\r\ncontent-length: 1\r\n\r\n!"], false, Some(false)),
            (vec![b"HTTP/1.1 999 Odd\r\ncontent-length: 1\r\n\r\n!"], false, Some(false)),
            (vec![b"NOT HTTP\r\n\r\n"], true, Some(false)),
            // A connection closed before any answer: the own reader's error, as pingora's.
            (vec![], true, Some(true)),
        ];
        for (i, (parts, close, kept)) in cases.iter().enumerate() {
            let theirs = exchange(parts, *close, false, Duration::from_secs(5), false).await;
            let ours = exchange(parts, *close, true, Duration::from_secs(5), false).await;
            assert_eq!(
                (&ours.0, ours.1),
                (&theirs.0, theirs.1),
                "case {i}: {:?}",
                String::from_utf8_lossy(&parts.concat())
            );
            if let Some(kept) = kept {
                assert_eq!(ours.2, *kept, "case {i}: kept by the own reader");
            }
        }
    }

    #[tokio::test]
    async fn a_silent_upstream_times_out_as_in_pingoras_session() {
        // Whatever arrived before the timer ran out, the read ends in the same error.
        let t = Duration::from_millis(300);
        let head: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhe";
        for parts in [vec![], vec![head]] {
            for own in [false, true] {
                let (seen, reused, _) = exchange(&parts, false, own, t, false).await;
                let last = seen.last().map(String::as_str).unwrap_or_default();
                assert!(last.starts_with("error ReadTimedout"), "{seen:?}");
                assert!(!reused);
            }
        }
    }

    #[tokio::test]
    async fn a_request_with_a_connection_close_is_not_reused() {
        let answer: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        let t = Duration::from_secs(5);
        let theirs = exchange(&[answer], false, false, t, true).await;
        let ours = exchange(&[answer], false, true, t, true).await;
        assert_eq!((&ours.0, ours.1), (&theirs.0, theirs.1));
        assert!(ours.2, "kept by the own reader");
        assert!(!ours.1, "reused after a request that said close");
    }

    #[test]
    fn lengths_of_plain_digits_only() {
        assert_eq!(digits(b"0"), Some(0));
        assert_eq!(digits(b"0012"), Some(12));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"1,1",
            b"0x1",
            b"1234567890123456",
        ] {
            assert_eq!(digits(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
