//! An upstream connection of the own HTTP/1.1 loop (`h1`, `h1_upstream`, `pool`): a plain TCP
//! socket the loop connected itself, or a stream pingora's connector made (TLS, an internal
//! listener's tunnel, a connection pingora's session held).
//!
//! pingora's TCP stream wraps the socket in layers the loop does not use: a write buffer of
//! no capacity, a list of put-back bytes every read checks first (its read-ahead buffer has no
//! capacity either), receive timestamps, a dispatch through `dyn IO`, and a
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

#[cfg(test)]
mod tests {
    use super::*;
    use pingora_core::connectors::TransportConnector;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn plain(addr: SocketAddr) -> HttpPeer {
        HttpPeer::new(addr, false, String::new())
    }

    fn sockopt(fd: i32, level: i32, name: i32) -> i32 {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid descriptor, and a buffer of the size given.
        let r = unsafe {
            libc::getsockopt(
                fd,
                level,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "getsockopt");
        v
    }

    #[test]
    fn only_plain_peers_are_connected_here() {
        let addr: SocketAddr = "127.0.0.1:80".parse().expect("addr");
        assert!(connects_itself(&plain(addr)));
        assert!(!connects_itself(&HttpPeer::new(addr, true, "h".into())));
        let mut p = plain(addr);
        p.options.dscp = Some(10);
        assert!(!connects_itself(&p));
        let mut p = plain(addr);
        p.options.tcp_recv_buf = Some(1 << 16);
        assert!(!connects_itself(&p));
        let mut p = plain(addr);
        p.options.tcp_fast_open = true;
        assert!(!connects_itself(&p));
        let mut p = plain(addr);
        p.options.total_connection_timeout = Some(Duration::from_secs(1));
        assert!(!connects_itself(&p));
        let unix =
            HttpPeer::new_uds("/tmp/portico-none.sock", false, String::new()).expect("uds peer");
        assert!(!connects_itself(&unix));
    }

    #[tokio::test]
    async fn a_plain_connection_is_set_up_as_pingoras_connector_sets_one_up() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mut peer = plain(l.local_addr().expect("addr"));
        peer.options.tcp_keepalive = Some(pingora_core::protocols::TcpKeepalive {
            idle: Duration::from_secs(30),
            interval: Duration::from_secs(5),
            count: 3,
            user_timeout: Duration::ZERO,
        });
        let (io, accepted) = tokio::join!(connect(&peer), l.accept());
        let (mut io, (mut server, from)) = (io.expect("connect"), accepted.expect("accept"));
        assert!(matches!(io, Io::Tcp(_)));
        assert!(io.is_plain());
        // The address the server sees is the one read at the connect.
        assert_eq!(io.local_addr(), Some(from));
        let fd = io.id();
        assert_eq!(sockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY), 1);
        assert_eq!(sockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 30);
        assert_eq!(sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 5);
        assert_eq!(sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
        // Both ways, then a shut writing side the server reads as the end.
        io.write_all(b"ping").await.expect("write");
        io.flush().await.expect("flush");
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.expect("server read");
        assert_eq!(&got, b"ping");
        server.write_all(b"pong").await.expect("server write");
        io.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"pong");
        io.shutdown().await;
        assert_eq!(server.read(&mut got).await.expect("eof"), 0);
    }

    #[tokio::test]
    async fn a_refused_connect_fails_as_pingoras_connector_says_it() {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let mut peer = plain(addr);
        peer.options.connection_timeout = Some(Duration::from_secs(5));
        let Err(ours) = connect(&peer).await else {
            panic!("connected to a closed port");
        };
        let Err(theirs) = TransportConnector::new(None).new_stream(&peer).await else {
            panic!("connected to a closed port");
        };
        assert_eq!(ours.etype(), theirs.etype());
        assert_eq!(ours.etype(), &ErrorType::ConnectRefused);
        assert_eq!(
            ours.context.as_ref().map(|c| c.as_str()),
            theirs.context.as_ref().map(|c| c.as_str())
        );
    }

    #[tokio::test]
    async fn a_connection_handed_to_pingora_keeps_its_address_and_unread_bytes() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let peer = plain(l.local_addr().expect("addr"));
        let (io, accepted) = tokio::join!(connect(&peer), l.accept());
        let (io, (mut server, from)) = (io.expect("connect"), accepted.expect("accept"));
        server.write_all(b"rest").await.expect("server write");
        let mut tcp = io.into_pingora(b"head ").expect("plain");
        let local = tcp
            .get_socket_digest()
            .and_then(|d| d.local_addr().and_then(|a| a.as_inet()).copied());
        assert_eq!(local, Some(from));
        let mut got = [0u8; 9];
        tcp.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"head rest");
        // Back from pingora's session (plain TCP in its stream), the own exchange can read it
        // again, and the address stays known.
        let other: Stream = Box::new(tcp);
        let io = Io::Stream(other);
        assert!(io.is_plain());
        assert_eq!(io.local_addr(), Some(from));
    }
}
