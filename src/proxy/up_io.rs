//! An upstream connection of the own HTTP/1.1 loop (`h1`, `h1_upstream`, `pool`): a plain TCP
//! socket the loop connected itself, or a stream pingora's connector made (TLS, an internal
//! listener's tunnel, a connection pingora's session held).
//!
//! pingora's TCP stream wraps the socket in layers the loop does not use: a write buffer of
//! no capacity, a read-ahead buffer, receive timestamps, a dispatch through `dyn IO`, and a
//! clock reading on each side of a read that waits (its `read_pending_time`, two readings a
//! request). For a plain peer the loop connects as pingora's connector does and keeps the
//! socket itself; a stream handed to pingora's session becomes pingora's stream then.

use std::io;
use std::net::SocketAddr;
use std::os::unix::io::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use pingora_core::protocols::l4::ext as l4;
use pingora_core::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora_core::protocols::l4::stream::Stream as PingoraTcp;
use pingora_core::protocols::{GetSocketDigest, SocketDigest, Stream};
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_error::{Error, ErrorType, OrErr, Result};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

pub(crate) enum Io {
    /// A plain TCP connection the loop made (`connect`).
    Tcp(Tcp),
    /// pingora's stream (its connector's, or one its session handed back).
    Stream(Stream),
}

pub(crate) struct Tcp {
    io: TcpStream,
    /// The connection's own address, read once when it was made (`%UPSTREAM_LOCAL_ADDRESS%`
    /// asks for it on every request).
    local: Option<SocketAddr>,
}

/// Whether the loop connects to `peer` itself: plain TCP to an IP address, with nothing that
/// only pingora's connector does (TLS, which Portico's relay does as a custom connect; a
/// CONNECT proxy; socket options Portico does not set).
pub(crate) fn connects_itself(peer: &HttpPeer) -> bool {
    let o = &peer.options;
    !peer.tls()
        && peer.get_proxy().is_none()
        && o.custom_l4.is_none()
        && o.upstream_tcp_sock_tweak_hook.is_none()
        && !o.tcp_fast_open
        && o.tcp_recv_buf.is_none()
        && o.dscp.is_none()
        && o.total_connection_timeout.is_none()
        && o.tracer.is_none()
        && matches!(peer.address(), PeerAddr::Inet(_))
}

/// A new connection to `peer` (`connects_itself`), made and set up as pingora's connector
/// makes one, with its errors (types, context) as it words them: the connect timeout, the
/// bind address, TCP keepalive, `TCP_NODELAY`.
pub(crate) async fn connect(peer: &HttpPeer) -> Result<Io> {
    let PeerAddr::Inet(addr) = peer.address() else {
        return Error::e_explain(ErrorType::InternalError, "not an IP peer");
    };
    let bind = peer.options.bind_to.as_ref();
    let made = match peer.connection_timeout() {
        Some(t) => match pingora_timeout::timeout(t, l4::connect(addr, bind)).await {
            Ok(r) => r,
            Err(e) => {
                return Err(Error::because(
                    ErrorType::ConnectTimedout,
                    format!("timeout {t:?} connecting to server {peer}"),
                    e,
                ))
            }
        },
        None => l4::connect(addr, bind).await,
    };
    let io = made.or_else(|e| {
        let c = format!("Fail to connect to {peer}");
        match e.etype() {
            ErrorType::SocketError | ErrorType::BindError => {
                Error::e_because(ErrorType::InternalError, c, e)
            }
            _ => Err(e.more_context(c)),
        }
    })?;
    if let Some(ka) = peer.tcp_keepalive() {
        l4::set_tcp_keepalive(&io, ka)?;
    }
    io.set_nodelay(true)
        .or_err(ErrorType::ConnectError, "failed to set_nodelay")?;
    let local = io.local_addr().ok();
    Ok(Io::Tcp(Tcp { io, local }))
}

impl Io {
    /// The socket's descriptor, as pingora's streams identify themselves.
    pub fn id(&self) -> i32 {
        match self {
            Io::Tcp(t) => t.io.as_raw_fd(),
            Io::Stream(s) => s.id(),
        }
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        match self {
            Io::Tcp(t) => t.local,
            Io::Stream(s) => s.get_socket_digest()?.local_addr()?.as_inet().copied(),
        }
    }

    /// Whether the own exchange can read on it: plain TCP, whose read bytes can go back in
    /// front of the stream for pingora's session (`into_pingora`).
    pub fn is_plain(&self) -> bool {
        match self {
            Io::Tcp(_) => true,
            Io::Stream(s) => s.as_any().is::<PingoraTcp>(),
        }
    }

    /// As pingora's stream, for its session: `unread` put back in front of what comes. None:
    /// not plain TCP (`is_plain`).
    pub fn into_pingora(self, unread: &[u8]) -> Option<PingoraTcp> {
        let mut tcp = match self {
            Io::Tcp(t) => Box::new(t.into_pingora()),
            Io::Stream(s) => s.into_any().downcast::<PingoraTcp>().ok()?,
        };
        tcp.rewind(unread);
        Some(*tcp)
    }

    /// The stream for pingora's session, as it is.
    pub fn into_stream(self) -> Stream {
        match self {
            Io::Tcp(t) => Box::new(t.into_pingora()),
            Io::Stream(s) => s,
        }
    }

    /// Shuts the connection's writing side (the exchange ended with it unusable).
    pub async fn shutdown(&mut self) {
        let _ = AsyncWriteExt::shutdown(self).await;
    }
}

impl Tcp {
    /// pingora's stream over the socket, with the digest its connector gives a connection (the
    /// local address known), for the requests it still carries once it is pingora's.
    fn into_pingora(self) -> PingoraTcp {
        let digest = SocketDigest::from_raw_fd(self.io.as_raw_fd());
        let _ = digest.local_addr.set(self.local.map(PeerAddr::Inet));
        let mut s = PingoraTcp::from(self.io);
        s.set_socket_digest(digest);
        s
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(t) => Pin::new(&mut t.io).poll_read(cx, buf),
            Io::Stream(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(t) => Pin::new(&mut t.io).poll_write(cx, buf),
            Io::Stream(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            // Nothing is buffered above the socket.
            Io::Tcp(_) => Poll::Ready(Ok(())),
            Io::Stream(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(t) => Pin::new(&mut t.io).poll_shutdown(cx),
            Io::Stream(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
