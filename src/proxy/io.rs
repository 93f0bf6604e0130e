//! The downstream connection as pingora sees it: a TCP stream that gathers small writes until
//! pingora flushes.
//!
//! pingora's own listeners put a 1460-byte write buffer in front of every accepted socket, and
//! its HTTP/1 writer flushes after the header only when no body follows, after the last byte of
//! a `content-length` body, and after every chunk of a chunked one. Our listeners accept the
//! sockets themselves (to bind and unbind at runtime), and pingora's buffered constructor is
//! crate-private, so without this a small response costs two `send` calls (header, then body)
//! where Envoy needs one. Nothing that pingora would have sent at once waits longer than its
//! next flush, and bytes still buffered when pingora drops the connection (an upstream that
//! resets mid-body) are sent before the socket closes, as an unbuffered write would have.

use std::io;
use std::os::unix::io::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::BufMut;
use pingora_core::protocols::raw_connect::ProxyDigest;
use pingora_core::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A segment's worth, as pingora's listeners use: a response that fits goes out in one send.
const CAPACITY: usize = 1460;

/// The socket, or the TLS session over it when the listener's chain terminates TLS.
#[derive(Debug)]
enum Inner {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Inner {
    fn tcp(&self) -> &TcpStream {
        match self {
            Inner::Plain(t) => t,
            Inner::Tls(t) => t.get_ref().0,
        }
    }
}

/// What the TLS handshake settled, for pingora (h2 by ALPN) and the request path.
#[derive(Debug)]
pub struct TlsInfo {
    pub digest: Arc<pingora_core::protocols::tls::SslDigest>,
    pub alpn: Option<pingora_core::protocols::ALPN>,
}

#[derive(Debug)]
pub struct Downstream {
    tcp: Inner,
    tls: Option<TlsInfo>,
    buf: Vec<u8>,
    /// Bytes of `buf` already handed to the socket during a flush in progress.
    written: usize,
    socket_digest: Option<Arc<SocketDigest>>,
    proxy_digest: Option<Arc<ProxyDigest>>,
    established: SystemTime,
    /// The connection manager's request timers, when its chain sets any (HTTP/1 only).
    timer: Option<super::conn::ReadTimer>,
    /// Bytes read ahead (`read_head`, or handed back with `unread`) that the next reads
    /// return before the socket's.
    ahead: bytes::BytesMut,
    /// `mark_refused_target` marked the head read ahead (the connection closes after the
    /// 400 it gets, so this is never reset).
    refused_target: bool,
}

/// What `read_head` found in front of the connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// A whole request head (through its blank line) is buffered: its length.
    Complete(usize),
    /// The client closed (or the read failed) before a head arrived; nothing is buffered.
    Closed,
    /// Bytes are buffered but no whole head within the limit (or the timers answered the
    /// connection themselves): whoever reads next deals with them.
    Undecided,
}

impl Downstream {
    pub fn new(tcp: TcpStream, peer: std::net::SocketAddr) -> Downstream {
        Downstream::new_inner(Inner::Plain(tcp), peer)
    }

    /// A TLS connection; `alpn` is the protocol pingora should speak (None: HTTP/1.1).
    pub fn new_tls(
        tls: tokio_rustls::server::TlsStream<TcpStream>,
        peer: std::net::SocketAddr,
        alpn: Option<pingora_core::protocols::ALPN>,
    ) -> Downstream {
        let conn = tls.get_ref().1;
        let version = match conn.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3",
            Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2",
            _ => "",
        };
        let cipher = conn
            .negotiated_cipher_suite()
            .and_then(|s| s.suite().as_str())
            .unwrap_or("");
        let digest = pingora_core::protocols::tls::SslDigest::new(
            cipher.to_string(),
            version.to_string(),
            None,
            None,
            Vec::new(),
        );
        let mut d = Downstream::new_inner(Inner::Tls(Box::new(tls)), peer);
        d.tls = Some(TlsInfo {
            digest: Arc::new(digest),
            alpn,
        });
        d
    }

    fn new_inner(inner: Inner, peer: std::net::SocketAddr) -> Downstream {
        let digest = SocketDigest::from_raw_fd(inner.tcp().as_raw_fd());
        let _ = digest.peer_addr.set(Some(peer.into()));
        Downstream {
            tcp: inner,
            tls: None,
            buf: Vec::new(),
            written: 0,
            socket_digest: Some(Arc::new(digest)),
            proxy_digest: None,
            established: SystemTime::now(),
            timer: None,
            ahead: bytes::BytesMut::new(),
            refused_target: false,
        }
    }

    /// Reads until a whole request head is buffered, through the connection's timers as any
    /// read, and keeps what it read for the next reader. Reads at most `limit` bytes ahead.
    pub async fn read_head(&mut self, limit: usize) -> Head {
        loop {
            if let Some(end) = head_end(&self.ahead) {
                return Head::Complete(end);
            }
            if self.ahead.len() >= limit {
                return Head::Undecided;
            }
            let want = (limit - self.ahead.len()).min(4096);
            // Read straight into the buffer's spare room (no array in this future: a
            // connection's task is as large as its largest await), which is not zeroed first:
            // `read_buf` hands the reader uninitialised memory and keeps only what it filled.
            if self.ahead.capacity() == 0 {
                // A connection's next request starts on an empty buffer (`take_ahead` handed
                // the last one to its request): allocated as it stands, rather than through
                // `reserve`, which first works out whether a shared buffer can be reclaimed.
                self.ahead = bytes::BytesMut::with_capacity(want);
            } else {
                self.ahead.reserve(want);
            }
            let mut reader = HeadReader {
                tcp: &mut self.tcp,
                timer: &mut self.timer,
            };
            let n = reader
                .read_buf(&mut (&mut self.ahead).limit(want))
                .await
                .unwrap_or(0);
            if n == 0 {
                return if self.ahead.is_empty() {
                    self.ahead = bytes::BytesMut::new();
                    Head::Closed
                } else {
                    Head::Undecided
                };
            }
        }
    }

    /// The bytes `read_head` buffered.
    pub fn ahead(&self) -> &[u8] {
        &self.ahead
    }

    /// Marks a target Envoy's codec refuses in the first `end` bytes read ahead (a head),
    /// for `downstream::reject` to answer as Envoy does (`h1_session::mark_refused_target`).
    pub fn mark_refused_target(&mut self, end: usize) {
        self.refused_target |= self
            .ahead
            .get_mut(..end)
            .is_some_and(super::h1_session::mark_refused_target);
    }

    /// The request being read has a target Envoy's codec refuses.
    pub fn refused_target(&self) -> bool {
        self.refused_target
    }

    /// The first `n` bytes `read_head` buffered (a request head), taken off the connection.
    pub fn take_ahead(&mut self, n: usize) -> bytes::Bytes {
        let n = n.min(self.ahead.len());
        if n == self.ahead.len() {
            // The whole buffer: an idle connection then holds no read buffer.
            std::mem::take(&mut self.ahead).freeze()
        } else {
            self.ahead.split_to(n).freeze()
        }
    }

    /// Writes into what the next flush sends (a response head serialised in place). Safe at
    /// any time: a flush in progress sends the buffer in order, these bytes after the rest.
    pub fn stage(&mut self, f: impl FnOnce(&mut Vec<u8>)) {
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(CAPACITY);
        }
        f(&mut self.buf);
    }

    /// Puts bytes read past a request back in front of the connection (a pipelined request
    /// an HTTP/1 session read ahead of its time).
    pub fn unread(&mut self, bytes: &[u8]) {
        if !bytes.is_empty() {
            let mut front = bytes::BytesMut::with_capacity(bytes.len() + self.ahead.len());
            front.extend_from_slice(bytes);
            front.extend_from_slice(&self.ahead);
            self.ahead = front;
        }
    }

    /// The local address requests see (`%DOWNSTREAM_LOCAL_ADDRESS%`, the cookie hash) when a
    /// PROXY header restored one; None leaves the socket's.
    pub fn set_local_addr(&self, local: Option<std::net::SocketAddr>) {
        if let (Some(addr), Some(d)) = (local, &self.socket_digest) {
            let _ = d.local_addr.set(Some(addr.into()));
        }
    }

    /// Times this connection's requests (`request_headers_timeout`, `request_timeout`).
    pub fn set_timer(&mut self, timer: super::conn::ReadTimer) {
        self.timer = Some(timer);
    }

    /// Waits until the client sends something (or closes): bytes on the socket, or
    /// plaintext the TLS session already holds.
    pub async fn readable(&self) -> io::Result<()> {
        if !self.ahead.is_empty() {
            return Ok(());
        }
        if let Inner::Tls(t) = &self.tcp {
            // rustls wants no more records while it holds plaintext not yet read.
            if !t.get_ref().1.wants_read() {
                return Ok(());
            }
        }
        self.tcp.tcp().readable().await
    }

    /// Sends what is buffered; the buffer is empty when this returns ready.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buf.len() {
            let n = ready!(self.tcp.poll_write_inner(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.buf.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl Drop for Downstream {
    fn drop(&mut self) {
        // Best effort and never blocking: the socket is about to close anyway.
        let rest = &self.buf[self.written.min(self.buf.len())..];
        match &mut self.tcp {
            Inner::Plain(tcp) => try_write_all(tcp, rest),
            Inner::Tls(tls) => {
                // Seal what is left into records, then hand those to the socket.
                let (tcp, conn) = tls.get_mut();
                if !rest.is_empty() {
                    let _ = std::io::Write::write_all(&mut conn.writer(), rest);
                }
                let mut out = Vec::new();
                while conn.wants_write() {
                    if conn.write_tls(&mut out).is_err() {
                        break;
                    }
                }
                try_write_all(tcp, &out);
            }
        }
    }
}

fn try_write_all(tcp: &TcpStream, mut rest: &[u8]) {
    while !rest.is_empty() {
        match tcp.try_write(rest) {
            Ok(n) if n > 0 => rest = &rest[n..],
            _ => break,
        }
    }
}

impl Inner {
    fn poll_write_inner(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            Inner::Plain(t) => Pin::new(t).poll_write(cx, data),
            Inner::Tls(t) => Pin::new(&mut **t).poll_write(cx, data),
        }
    }
}

impl AsyncRead for Inner {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Inner::Plain(t) => Pin::new(t).poll_read(cx, buf),
            Inner::Tls(t) => Pin::new(&mut **t).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Inner {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_inner(cx, data)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Inner::Plain(t) => Pin::new(t).poll_flush(cx),
            Inner::Tls(t) => Pin::new(&mut **t).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Inner::Plain(t) => Pin::new(t).poll_shutdown(cx),
            Inner::Tls(t) => Pin::new(&mut **t).poll_shutdown(cx),
        }
    }
}

impl AsyncRead for Downstream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.ahead.is_empty() {
            let n = this.ahead.len().min(buf.remaining());
            buf.put_slice(&this.ahead[..n]);
            if n == this.ahead.len() {
                // Freed, not kept: an idle connection should hold no read buffer.
                this.ahead = bytes::BytesMut::new();
            } else {
                let _ = this.ahead.split_to(n);
            }
            return Poll::Ready(Ok(()));
        }
        match &mut this.timer {
            Some(t) => t.poll_read(&mut this.tcp, cx, buf),
            None => Pin::new(&mut this.tcp).poll_read(cx, buf),
        }
    }
}

/// The connection's reads under its timers, for `read_head`'s `read_buf`.
struct HeadReader<'a> {
    tcp: &'a mut Inner,
    timer: &'a mut Option<super::conn::ReadTimer>,
}

impl AsyncRead for HeadReader<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.timer {
            Some(t) => t.poll_read(this.tcp, cx, buf),
            None => Pin::new(&mut *this.tcp).poll_read(cx, buf),
        }
    }
}

/// Where a request head ends (just past its blank line), if it does in `buf`. A bare LF line
/// ending counts too, as httparse accepts it.
fn head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(p) = memchr_nl(&buf[i..]) {
        let at = i + p;
        let rest = &buf[at + 1..];
        if rest.starts_with(b"\n") {
            return Some(at + 2);
        }
        if rest.starts_with(b"\r\n") {
            return Some(at + 3);
        }
        i = at + 1;
    }
    None
}

// memchr's search, a word or a vector at a time: a byte at a time, finding the line ends of a
// request head cost about 3 instructions a byte of it.
fn memchr_nl(buf: &[u8]) -> Option<usize> {
    memchr::memchr(b'\n', buf)
}

impl AsyncWrite for Downstream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.buf.len() + data.len() > CAPACITY {
            ready!(this.poll_drain(cx))?;
        }
        if data.len() >= CAPACITY {
            // Large writes go straight through: copying them would only cost.
            return Pin::new(&mut this.tcp).poll_write(cx, data);
        }
        if this.buf.capacity() == 0 {
            this.buf.reserve_exact(CAPACITY);
        }
        this.buf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for Downstream {
    async fn shutdown(&mut self) {
        if let Err(e) = tokio::io::AsyncWriteExt::shutdown(self).await {
            tracing::debug!("failed to shut down a downstream connection: {e}");
        }
    }
}

impl UniqueID for Downstream {
    fn id(&self) -> UniqueIDType {
        self.tcp.tcp().as_raw_fd()
    }
}

impl Ssl for Downstream {
    fn get_ssl_digest(&self) -> Option<Arc<pingora_core::protocols::tls::SslDigest>> {
        self.tls.as_ref().map(|t| t.digest.clone())
    }

    fn selected_alpn_proto(&self) -> Option<pingora_core::protocols::ALPN> {
        self.tls.as_ref().and_then(|t| t.alpn.clone())
    }
}

// The listener reads the h2c preface itself (see `listeners`), so pingora need not peek: the
// default answer, "cannot peek", leaves the protocol pingora was told to speak.
impl Peek for Downstream {}

impl GetTimingDigest for Downstream {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        vec![Some(TimingDigest {
            established_ts: self.established,
            ..Default::default()
        })]
    }
}

impl GetProxyDigest for Downstream {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.proxy_digest.clone()
    }
    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.proxy_digest = Some(Arc::new(digest));
    }
}

impl GetSocketDigest for Downstream {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.socket_digest.clone()
    }
    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.socket_digest = Some(Arc::new(digest));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair() -> (Downstream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (server, peer) = l.accept().await.expect("accept");
        (Downstream::new(server, peer), client)
    }

    #[tokio::test]
    async fn small_writes_wait_for_flush_and_arrive_whole() {
        let (mut s, mut c) = pair().await;
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
            .await
            .expect("write");
        s.write_all(b"ok").await.expect("write");
        let mut one = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(50), c.read(&mut one)).await;
        assert!(early.is_err(), "nothing is sent before the flush");
        s.flush().await.expect("flush");
        let mut got = vec![0u8; 40];
        c.read_exact(&mut got).await.expect("read");
        assert_eq!(&got[..], b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
    }

    #[tokio::test]
    async fn large_writes_keep_order_with_buffered_bytes() {
        let (mut s, mut c) = pair().await;
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        s.write_all(b"head").await.expect("write");
        s.write_all(&big).await.expect("write");
        s.write_all(b"tail").await.expect("write");
        AsyncWriteExt::shutdown(&mut s).await.expect("shutdown");
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.expect("read");
        let mut want = b"head".to_vec();
        want.extend_from_slice(&big);
        want.extend_from_slice(b"tail");
        assert_eq!(got, want);
    }

    #[tokio::test]
    async fn buffered_bytes_are_sent_when_the_connection_is_dropped() {
        let (mut s, mut c) = pair().await;
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
            .await
            .expect("write");
        drop(s);
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.expect("read");
        assert_eq!(
            got,
            b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial"
        );
    }

    #[test]
    fn a_head_ends_at_its_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nhost: a\r\n\r\nGET"), Some(27));
        assert_eq!(head_end(b"GET / HTTP/1.1\nhost: a\n\nbody"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nhost: a\r\n"), None);
        assert_eq!(head_end(b""), None);
    }

    #[tokio::test]
    async fn a_head_read_ahead_is_read_again_in_order() {
        let (mut s, mut c) = pair().await;
        c.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\nGET /2")
            .await
            .expect("write");
        let head = s.read_head(64 * 1024).await;
        assert_eq!(head, Head::Complete(27));
        s.unread(b"<");
        c.write_all(b" HTTP/1.1\r\n\r\n").await.expect("write");
        drop(c);
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.expect("read");
        assert_eq!(
            got,
            b"<GET / HTTP/1.1\r\nhost: a\r\n\r\nGET /2 HTTP/1.1\r\n\r\n"
        );
    }

    #[tokio::test]
    async fn a_client_that_closes_before_a_head_is_closed() {
        let (mut s, c) = pair().await;
        drop(c);
        assert_eq!(s.read_head(1024).await, Head::Closed);
    }

    #[tokio::test]
    async fn the_peer_address_is_in_the_socket_digest() {
        let (s, c) = pair().await;
        let digest = s.get_socket_digest().expect("digest");
        assert_eq!(
            digest.peer_addr().and_then(|a| a.as_inet()).copied(),
            Some(c.local_addr().expect("addr"))
        );
    }
}
