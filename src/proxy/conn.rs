//! What a downstream connection tells its requests, and the connection manager's limits on
//! an HTTP/1 connection: `request_headers_timeout`, `request_timeout`,
//! `max_connection_duration` and `max_requests_per_connection`.
//!
//! pingora has no slot for application data on a downstream connection other than the
//! proxy digest's `user_data`, which its HTTP/1 and HTTP/2 servers copy from the stream into
//! every request's session: [`ConnInfo`] rides there.
//!
//! pingora times each read of a request head, not the head: a client trickling a header line
//! a second is never cut off by it. The read timers therefore live in the connection itself
//! ([`ReadTimer`], polled inside the stream's reads): armed at a request's first byte, they
//! fire while pingora still waits for bytes. A head that is late gets Envoy's 408 written
//! from here (pingora is inside its head parser and calls nothing of ours), then the
//! connection is read from for `delayed_close_timeout` so that the client reads the answer
//! and not a reset, as Envoy's delayed close does. A body that is late fails the read, and
//! the failure reply answers 408 (`fail_reply`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use pingora_core::protocols::raw_connect::ProxyDigest;
use pingora_http::ResponseHeader;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::client_cert::PeerCert;
use crate::live::HcmStats;
use crate::snapshot::listener::ConnLimits;

/// What a connection tells its requests: the client certificate (mTLS), the server name the
/// client asked for, and the connection manager's per-connection state.
#[derive(Debug, Default)]
pub struct ConnInfo {
    pub peer: Option<Arc<PeerCert>>,
    pub sni: Option<Arc<str>>,
    pub state: Option<Arc<ConnState>>,
}

impl ConnInfo {
    /// The digest that carries it to the request path (None when there is nothing to carry).
    pub fn into_digest(self) -> Option<ProxyDigest> {
        if self.peer.is_none() && self.sni.is_none() && self.state.is_none() {
            return None;
        }
        let response = ResponseHeader::build(200, Some(0)).ok()?;
        Some(ProxyDigest {
            response: Box::new(response),
            user_data: Some(Box::new(Arc::new(self))),
        })
    }
}

/// The connection's [`ConnInfo`], from a request's session digest.
pub fn info(digest: Option<&pingora_core::protocols::Digest>) -> Option<&Arc<ConnInfo>> {
    digest?
        .proxy_digest
        .as_ref()?
        .user_data
        .as_ref()?
        .downcast_ref::<Arc<ConnInfo>>()
}

/// The connection manager's state of one HTTP/1 connection.
const HEAD: u8 = 0;
const BODY: u8 = 1;
const DONE: u8 = 2;

#[derive(Debug)]
pub struct ConnState {
    limits: ConnLimits,
    stats: Arc<HcmStats>,
    /// `server` of the 408 a late head gets.
    server: Arc<str>,
    established: Instant,
    requests: AtomicU32,
    /// Where the request in progress is: its head ([`HEAD`], also between requests), its
    /// body, or fully received.
    phase: AtomicU8,
    /// Bumped when a request ends: the next one's timers start afresh.
    seq: AtomicU32,
    /// `request_timeout` fired while the body was read.
    body_timed_out: AtomicBool,
    /// `max_connection_duration` was counted (once per connection, as Envoy).
    aged: AtomicBool,
}

/// What the connection manager decides for a request as it starts.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// The response closes the connection (`connection: close`).
    Close,
    /// The connection stays open after the response, idle for at most this long (it reaches
    /// its maximum duration, plus the drain Envoy gives it).
    KeepAtMost(Duration),
    Keep,
}

impl ConnState {
    pub fn new(
        limits: ConnLimits,
        stats: Arc<HcmStats>,
        server: Arc<str>,
        established: Instant,
    ) -> ConnState {
        ConnState {
            limits,
            stats,
            server,
            established,
            requests: AtomicU32::new(0),
            phase: AtomicU8::new(HEAD),
            seq: AtomicU32::new(0),
            body_timed_out: AtomicBool::new(false),
            aged: AtomicBool::new(false),
        }
    }

    /// A request's head was received; `body_done` when it has no body to wait for.
    pub fn head_received(&self, body_done: bool) {
        self.phase
            .store(if body_done { DONE } else { BODY }, Relaxed);
    }

    /// The request's body was received in full.
    pub fn body_received(&self) {
        self.phase.store(DONE, Relaxed);
    }

    /// The request is over; the next one on this connection is timed afresh.
    pub fn request_ended(&self) {
        self.seq.fetch_add(1, Relaxed);
        self.phase.store(HEAD, Relaxed);
    }

    /// Whether `request_timeout` cut this request's body short.
    pub fn body_timed_out(&self) -> bool {
        self.body_timed_out.load(Relaxed)
    }

    /// Counts a request and says whether its response closes the connection.
    pub fn admit(&self) -> Admit {
        let n = self.requests.fetch_add(1, Relaxed).saturating_add(1);
        if self
            .limits
            .max_requests_per_connection
            .is_some_and(|max| n >= max)
        {
            self.stats.cx_max_requests_reached.fetch_add(1, Relaxed);
            return Admit::Close;
        }
        self.at_response()
    }

    /// What becomes of the connection after the response about to be written: closed if it
    /// reached its maximum duration while the request was in flight, else kept idle for no
    /// longer than its age allows (the keep-alive runs from the response on).
    pub fn at_response(&self) -> Admit {
        let Some(max) = self.limits.max_connection_duration else {
            return Admit::Keep;
        };
        match max.checked_sub(self.established.elapsed()) {
            Some(left) if !left.is_zero() => {
                Admit::KeepAtMost(left + self.limits.drain_timeout + self.limits.delayed_close)
            }
            _ => {
                self.aged();
                Admit::Close
            }
        }
    }

    /// The connection closed: if it was past its maximum duration, that is what closed it
    /// (an idle one is closed by its keep-alive, capped to its age in [`Self::at_response`]).
    pub fn closed(&self) {
        if self
            .limits
            .max_connection_duration
            .is_some_and(|max| self.established.elapsed() >= max)
        {
            self.aged();
        }
    }

    fn aged(&self) {
        if !self.aged.swap(true, Relaxed) {
            self.stats.cx_max_duration_reached.fetch_add(1, Relaxed);
        }
    }
}

/// Which timer fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fired {
    Headers,
    Request,
}

/// The 408 a late head gets, being written and then lingered over.
#[derive(Debug)]
struct Answer {
    bytes: Vec<u8>,
    written: usize,
    shut: bool,
    until: Instant,
}

/// The read timers of one HTTP/1 connection (see the module comment).
#[derive(Debug)]
pub struct ReadTimer {
    state: Arc<ConnState>,
    seq: u32,
    headers_by: Option<Instant>,
    request_by: Option<Instant>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    answer: Option<Answer>,
}

impl ReadTimer {
    pub fn new(state: Arc<ConnState>) -> ReadTimer {
        ReadTimer {
            seq: state.seq.load(Relaxed),
            state,
            headers_by: None,
            request_by: None,
            sleep: None,
            answer: None,
        }
    }

    /// A read of the connection through `inner`, under the timers.
    pub fn poll_read<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        inner: &mut S,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.answer.is_some() {
            return self.poll_answer(inner, cx);
        }
        let seq = self.state.seq.load(Relaxed);
        if seq != self.seq {
            self.seq = seq;
            self.headers_by = None;
            self.request_by = None;
        }
        let phase = self.state.phase.load(Relaxed);
        if phase != HEAD {
            self.headers_by = None;
        }
        if phase == DONE {
            self.request_by = None;
        }
        if let Some(f) = self.expired(Instant::now()) {
            return self.fire(f, phase, inner, cx);
        }
        let before = buf.filled().len();
        match Pin::new(&mut *inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if phase == HEAD
                    && buf.filled().len() > before
                    && self.headers_by.is_none()
                    && self.request_by.is_none()
                {
                    // A request's first byte: its timers start.
                    let now = Instant::now();
                    let limits = &self.state.limits;
                    self.headers_by = limits.request_headers_timeout.map(|d| now + d);
                    self.request_by = limits.request_timeout.map(|d| now + d);
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                let Some(at) = self.next_deadline() else {
                    return Poll::Pending;
                };
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())));
                if sleep.deadline() != at.into() {
                    sleep.as_mut().reset(at.into());
                }
                ready!(sleep.as_mut().poll(cx));
                match self.expired(Instant::now()) {
                    Some(f) => self.fire(f, phase, inner, cx),
                    None => Poll::Pending,
                }
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        match (self.headers_by, self.request_by) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn expired(&self, now: Instant) -> Option<Fired> {
        if self.headers_by.is_some_and(|t| now >= t) {
            return Some(Fired::Headers);
        }
        if self.request_by.is_some_and(|t| now >= t) {
            return Some(Fired::Request);
        }
        None
    }

    fn fire<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        fired: Fired,
        phase: u8,
        inner: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        self.headers_by = None;
        self.request_by = None;
        self.sleep = None;
        let stats = &self.state.stats;
        match fired {
            Fired::Headers => stats.rq_header_timeout.fetch_add(1, Relaxed),
            Fired::Request => stats.rq_timeout.fetch_add(1, Relaxed),
        };
        if phase != HEAD {
            // The body is late: the request path answers (or resets a started response).
            self.state.body_timed_out.store(true, Relaxed);
            return Poll::Ready(Err(timed_out()));
        }
        let body = match fired {
            Fired::Headers => "request header timeout",
            Fired::Request => "request timeout",
        };
        self.answer = Some(Answer {
            bytes: late_head_reply(body, &self.state.server),
            written: 0,
            shut: false,
            until: Instant::now() + self.state.limits.delayed_close,
        });
        self.poll_answer(inner, cx)
    }

    /// Writes the 408, shuts the write side, then reads and drops what the client still
    /// sends until it closes or the delayed close is over; then fails the read.
    fn poll_answer<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        inner: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        let Some(a) = self.answer.as_mut() else {
            return Poll::Ready(Err(timed_out()));
        };
        let mut inner = Pin::new(inner);
        while a.written < a.bytes.len() {
            match ready!(inner.as_mut().poll_write(cx, &a.bytes[a.written..])) {
                Ok(0) | Err(_) => return Poll::Ready(Err(timed_out())),
                Ok(n) => a.written += n,
            }
        }
        if !a.shut {
            if ready!(inner.as_mut().poll_shutdown(cx)).is_err() {
                return Poll::Ready(Err(timed_out()));
            }
            a.shut = true;
        }
        let mut scratch = [0u8; 1024];
        loop {
            let mut rb = ReadBuf::new(&mut scratch);
            match inner.as_mut().poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if !rb.filled().is_empty() => continue,
                Poll::Ready(_) => return Poll::Ready(Err(timed_out())),
                Poll::Pending => break,
            }
        }
        let until = a.until;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until.into())));
        ready!(sleep.as_mut().poll(cx));
        Poll::Ready(Err(timed_out()))
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "request timed out")
}

/// Envoy's local reply to a late request head.
fn late_head_reply(body: &str, server: &str) -> Vec<u8> {
    let date = pingora_core::protocols::http::date::get_cached_date();
    format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-length: {}\r\ncontent-type: text/plain\r\ndate: {}\r\nserver: {server}\r\nconnection: close\r\n\r\n{body}",
        body.len(),
        String::from_utf8_lossy(date.as_bytes()),
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(limits: ConnLimits) -> ConnState {
        ConnState::new(limits, Arc::default(), Arc::from("envoy"), Instant::now())
    }

    #[test]
    fn the_nth_request_closes_the_connection() {
        let s = state(ConnLimits {
            max_requests_per_connection: Some(3),
            ..Default::default()
        });
        assert_eq!(s.admit(), Admit::Keep);
        assert_eq!(s.admit(), Admit::Keep);
        assert_eq!(s.admit(), Admit::Close);
        assert_eq!(s.stats.cx_max_requests_reached.load(Relaxed), 1);
    }

    #[test]
    fn an_old_connection_closes_and_a_young_one_idles_until_its_age_and_drain() {
        let s = state(ConnLimits {
            max_connection_duration: Some(Duration::from_secs(60)),
            drain_timeout: Duration::from_secs(4),
            delayed_close: Duration::from_secs(1),
            ..Default::default()
        });
        match s.admit() {
            Admit::KeepAtMost(d) => {
                assert!(
                    d > Duration::from_secs(64) && d <= Duration::from_secs(65),
                    "{d:?}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(s.at_response(), Admit::KeepAtMost(_)));
        let old = state(ConnLimits {
            max_connection_duration: Some(Duration::from_nanos(1)),
            ..Default::default()
        });
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(old.admit(), Admit::Close);
        assert_eq!(old.at_response(), Admit::Close);
        assert_eq!(old.stats.cx_max_duration_reached.load(Relaxed), 1);
    }

    #[test]
    fn the_late_head_reply_is_envoys() {
        let r =
            String::from_utf8(late_head_reply("request header timeout", "envoy")).expect("utf8");
        assert!(
            r.starts_with("HTTP/1.1 408 Request Timeout\r\ncontent-length: 22\r\n"),
            "{r}"
        );
        assert!(
            r.ends_with("connection: close\r\n\r\nrequest header timeout"),
            "{r}"
        );
    }

    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (server, _) = l.accept().await.expect("accept");
        (server, client)
    }

    struct Timed {
        tcp: tokio::net::TcpStream,
        timer: ReadTimer,
    }

    impl AsyncRead for Timed {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = &mut *self;
            this.timer.poll_read(&mut this.tcp, cx, buf)
        }
    }

    #[tokio::test]
    async fn a_trickled_head_is_answered_408_and_an_idle_connection_is_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server, mut client) = pair().await;
        let st = Arc::new(state(ConnLimits {
            request_headers_timeout: Some(Duration::from_millis(200)),
            delayed_close: Duration::from_millis(100),
            ..Default::default()
        }));
        let mut t = Timed {
            tcp: server,
            timer: ReadTimer::new(st.clone()),
        };
        // Idle before the first byte: no timer.
        let mut b = [0u8; 64];
        assert!(
            tokio::time::timeout(Duration::from_millis(400), t.read(&mut b))
                .await
                .is_err()
        );
        client
            .write_all(b"GET / HTTP/1.1\r\n")
            .await
            .expect("write");
        let started = Instant::now();
        assert!(t.read(&mut b).await.expect("first bytes") > 0);
        let err = loop {
            match t.read(&mut b).await {
                Ok(0) => panic!("eof"),
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() >= Duration::from_millis(290),
            "{:?}",
            started.elapsed()
        );
        let mut got = String::new();
        client.read_to_string(&mut got).await.expect("read");
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        assert_eq!(st.stats.rq_header_timeout.load(Relaxed), 1);
    }

    #[tokio::test]
    async fn a_late_body_fails_the_read_and_a_next_request_is_timed_afresh() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server, mut client) = pair().await;
        let st = Arc::new(state(ConnLimits {
            request_timeout: Some(Duration::from_millis(200)),
            ..Default::default()
        }));
        let mut t = Timed {
            tcp: server,
            timer: ReadTimer::new(st.clone()),
        };
        let mut b = [0u8; 64];
        // A whole request in time: its timer stops with it.
        client
            .write_all(b"GET / HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        assert!(t.read(&mut b).await.expect("read") > 0);
        st.head_received(true);
        st.request_ended();
        assert!(
            tokio::time::timeout(Duration::from_millis(400), t.read(&mut b))
                .await
                .is_err(),
            "no timer between requests"
        );
        // The next one sends its head and then too little body.
        client
            .write_all(b"POST / HTTP/1.1\r\ncontent-length: 9\r\n\r\nab")
            .await
            .expect("write");
        assert!(t.read(&mut b).await.expect("read") > 0);
        st.head_received(false);
        let err = t.read(&mut b).await.expect_err("late body");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(st.body_timed_out());
        assert_eq!(st.stats.rq_timeout.load(Relaxed), 1);
    }
}
