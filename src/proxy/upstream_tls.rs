//! Upstream TLS connections: pingora's custom L4 connector dials TCP and runs the handshake
//! with the transport socket's rustls config, then hands pingora the TLS session as a virtual
//! socket (so pingora sees a plain peer, speaking HTTP/1.1 or, for HTTP/2 clusters, h2 on it).
//! pingora's `total_connection_timeout` bounds both steps, as Envoy's connect timeout runs until
//! the handshake is done.
//!
//! Known gap: pingora never reuses these HTTP/1.1 connections. Its pool checks a pooled
//! connection's fd peer address against the peer's (`matches_fd`), which a virtual socket (fd
//! -1) or any local pipe cannot pass, so each request opens a new TLS connection (Envoy reuses
//! them). A virtual socket at least keeps the idle leftovers to one: every one has the id -1,
//! so each release evicts the previous from the pool.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use async_trait::async_trait;
use pingora_core::connectors::L4Connect;
use pingora_core::protocols::l4::stream::Stream;
use pingora_core::protocols::l4::virt::{VirtualSockOpt, VirtualSocket, VirtualSocketStream};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::snapshot::upstream_tls::UpstreamTls;

/// Marks a handshake failure so the local reply can say what Envoy says.
pub const TLS_FAILURE: ErrorType = ErrorType::TLSHandshakeFailure;

/// Sets `peer` up to connect through `tls`: cheap clones only.
pub fn apply(peer: &mut HttpPeer, tls: &Arc<UpstreamTls>, connect_timeout: std::time::Duration) {
    peer.options.custom_l4 = Some(tls.clone());
    peer.options.total_connection_timeout = Some(connect_timeout);
    // pingora's reuse hash leaves the connector out; the group key keeps pools apart.
    peer.group_key = tls.group_key;
}

#[async_trait]
impl L4Connect for UpstreamTls {
    async fn connect(
        &self,
        addr: &pingora_core::protocols::l4::socket::SocketAddr,
    ) -> Result<Stream> {
        let Some(inet) = addr.as_inet() else {
            return Error::e_explain(ErrorType::ConnectError, "upstream TLS needs an IP address");
        };
        let Some(config) = &self.config else {
            // Envoy's words for a socket whose SDS secret has not arrived.
            return Error::e_explain(TLS_FAILURE, "Secret is not supplied by SDS");
        };
        let tcp = TcpStream::connect(inet).await.map_err(|e| {
            let kind = match e.kind() {
                std::io::ErrorKind::ConnectionRefused => ErrorType::ConnectRefused,
                _ => ErrorType::ConnectError,
            };
            Error::because(kind, format!("connecting to {inet}"), e)
        })?;
        // Without an SNI the name is the peer's IP, which rustls never sends as SNI; the
        // validator ignores names either way.
        let name = match &self.sni {
            Some(n) => n.clone(),
            None => ServerName::IpAddress(inet.ip().into()),
        };
        let tls = tokio_rustls::TlsConnector::from(config.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| Error::because(TLS_FAILURE, format!("TLS handshake with {inet}"), e))?;
        Ok(Stream::from(VirtualSocketStream::new(Box::new(Session(
            tls,
        )))))
    }
}

struct Session(tokio_rustls::client::TlsStream<TcpStream>);

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("upstream TLS session")
    }
}

impl VirtualSocket for Session {
    fn set_socket_option(&self, opt: VirtualSockOpt) -> std::io::Result<()> {
        let tcp = self.0.get_ref().0;
        match opt {
            VirtualSockOpt::NoDelay => tcp.set_nodelay(true),
            VirtualSockOpt::KeepAlive(k) => {
                let ka = socket2::TcpKeepalive::new()
                    .with_time(k.idle)
                    .with_interval(k.interval)
                    .with_retries(k.count as u32);
                socket2::SockRef::from(tcp).set_tcp_keepalive(&ka)
            }
            _ => Ok(()),
        }
    }
}

impl AsyncRead for Session {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Session {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}
