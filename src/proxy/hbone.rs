//! Connections to an internal listener's endpoint (`envoy_internal_address`): istiod's ambient
//! endpoints, reached through its `connect_originate` listener, HBONE as Envoy originates it.
//!
//! Envoy connects the service cluster's connection to the internal listener; the listener's
//! original_dst filter restores the local address from the `envoy.filters.listener.original_dst`
//! metadata the internal_upstream socket passed from the endpoint (`local`: pod IP and port);
//! its tcp_proxy picks a host of its cluster (an ORIGINAL_DST cluster: that address, or the
//! `metadata_key` field, with `upstream_port_override` 15008), connects with that cluster's
//! transport socket (Istio mTLS, ALPN h2), and with `tunneling_config` sends an HTTP/2 CONNECT
//! whose `:authority` is the `hostname` format (`%DOWNSTREAM_LOCAL_ADDRESS%`), then carries the
//! connection's bytes in that stream.
//!
//! Portico resolves the same chain when the request is sent, on the request's snapshot, and
//! makes the tunnel in pingora's custom L4 connector. The connection is relayed to pingora like
//! an upstream TLS one (see `upstream_tls`), so pingora pools it; its pool key holds the tunnel
//! destination, the `:authority` and the TLS and tunnel settings, so two pods never share one.
//! Each pooled connection has its own TLS connection and CONNECT stream (Envoy multiplexes the
//! CONNECT streams to one pod on one HTTP/2 connection; what the pod receives is the same).

use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, Bytes};
use pingora_core::connectors::L4Connect;
use pingora_core::protocols::l4::stream::Stream;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::admin::stats::ClusterStats;
use crate::snapshot::cluster::{parse_ip_port, Cluster};
use crate::snapshot::tcp_proxy::Tunneling;
use crate::snapshot::upstream_tls::EndpointTls;
use crate::snapshot::Snapshot;

/// A failure to set up the internal connection's upstream: Envoy's internal connection is
/// up at once, and its tcp_proxy closes it when the tunnel fails, so the router sees the
/// connection end before any response (`connection termination`), not a connect failure.
pub const TUNNEL_FAILURE: ErrorType = ErrorType::Custom("HBONE tunnel failure");

fn fail<T>(context: String) -> Result<T> {
    Error::e_explain(TUNNEL_FAILURE, context)
}

/// How the internal listener's chain reaches its upstream for one endpoint.
#[derive(Debug)]
struct Hbone {
    /// The tcp_proxy cluster's host.
    addr: std::net::SocketAddr,
    /// That cluster's TLS for the host; None: plain TCP.
    tls: Option<Arc<EndpointTls>>,
    /// `tunneling_config` and the `:authority` made from it; None: the bytes go as they are.
    tunnel: Option<(Arc<Tunneling>, http::uri::Authority)>,
    connect_timeout: Duration,
    /// The tcp_proxy cluster's stats (`upstream_cx_connect_fail`).
    stats: Arc<ClusterStats>,
}

/// The peer for host `i` of `cluster`, an internal listener's endpoint, resolved through
/// `snap` as Envoy's internal connection would go. Errors are `TUNNEL_FAILURE`.
pub fn peer(snap: &Snapshot, cluster: &Cluster, i: usize) -> Result<HttpPeer> {
    let Some(ia) = cluster
        .endpoints
        .hosts
        .get(i)
        .and_then(|h| h.internal.as_ref())
    else {
        return Error::e_explain(ErrorType::InternalError, "not an internal endpoint");
    };
    let socket = cluster.transport.get(i).map_or(0, |&s| usize::from(s));
    // Only an internal_upstream socket passing the host's original_dst metadata gives the
    // internal connection anything to restore its destination from.
    let meta = cluster
        .def
        .transport
        .internal(socket)
        .filter(|s| s.passes_orig_dst)
        .map(|_| &**ia);
    let Some(listener) = snap.listeners.get(&*ia.listener).filter(|l| l.def.internal) else {
        return fail(format!("no internal listener '{}'", ia.listener));
    };
    let Some(tcp) = listener.chains.first().and_then(|c| c.def.tcp()) else {
        return fail(format!(
            "internal listener '{}' has no tcp_proxy",
            ia.listener
        ));
    };
    let restored = listener
        .def
        .original_dst
        .then(|| meta?.orig_dst_field("local"))
        .flatten()
        .and_then(|v| parse_ip_port(v.as_bytes()));
    let name = tcp.cluster(fastrand::u64(..));
    let Some(up) = snap.clusters.get(name) else {
        return fail(format!(
            "internal listener '{}': no cluster '{name}'",
            ia.listener
        ));
    };
    let (addr, tls) = match &up.def.original_dst {
        Some(od) => {
            let (host, invalid) = od.internal_host(meta, restored);
            if invalid {
                up.stats.original_dst_host_invalid.fetch_add(1, Relaxed);
            }
            let Some(addr) = host else {
                up.stats.cx_none_healthy.fetch_add(1, Relaxed);
                return fail(format!("cluster '{name}': no original destination"));
            };
            (addr, up.original_dst_tls(addr))
        }
        None => {
            let Some((j, addr)) = up.pick() else {
                up.stats.cx_none_healthy.fetch_add(1, Relaxed);
                return fail(format!("cluster '{name}': no healthy upstream"));
            };
            if up.endpoints.hosts[j].internal.is_some() {
                return fail(format!(
                    "cluster '{name}': an internal listener behind another is not supported"
                ));
            }
            (addr, up.tls_for(j).cloned())
        }
    };
    let tunnel = match &tcp.tunneling {
        None => None,
        Some(t) => {
            if !up.def.http2 {
                return fail(format!(
                    "cluster '{name}': HTTP/1.1 CONNECT tunnels are not supported (the cluster does not speak HTTP/2)"
                ));
            }
            let fallback = ia.envoy_name();
            let authority = t.authority(restored, &fallback);
            let Ok(authority) = authority.parse::<http::uri::Authority>() else {
                return fail(format!("tunnel authority '{authority}' is not valid"));
            };
            Some((t.clone(), authority))
        }
    };
    let mut key = Vec::with_capacity(96);
    key.extend_from_slice(addr.to_string().as_bytes());
    if let Some(t) = &tls {
        key.extend_from_slice(&t.group_key.to_le_bytes());
    }
    if let Some((t, a)) = &tunnel {
        key.extend_from_slice(&t.key.to_le_bytes());
        key.extend_from_slice(a.as_str().as_bytes());
    }
    let path = crate::proxy::upstream_tls::relay_path()?;
    let mut peer = HttpPeer::new_uds(&path, false, String::new())?;
    // pingora's reuse hash has the relay's (shared) address, not the connector.
    peer.group_key = xxhash_rust::xxh64::xxh64(&key, 15008);
    peer.options.custom_l4 = Some(Arc::new(Hbone {
        addr,
        tls,
        tunnel,
        connect_timeout: up.def.connect_timeout,
        stats: up.stats.clone(),
    }));
    Ok(peer)
}

#[async_trait]
impl L4Connect for Hbone {
    async fn connect(
        &self,
        _relay_addr: &pingora_core::protocols::l4::socket::SocketAddr,
    ) -> Result<Stream> {
        // Envoy's connect timeout runs until the transport is up; here it covers the
        // CONNECT's answer too, so a silent tunnel endpoint cannot hold the request.
        match tokio::time::timeout(self.connect_timeout, self.open()).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                self.stats.cx_connect_fail.fetch_add(1, Relaxed);
                fail(format!("tunnel to {} timed out", self.addr))
            }
        }
    }
}

impl Hbone {
    async fn open(&self) -> Result<Stream> {
        let failed = |e: Box<Error>| {
            self.stats.cx_connect_fail.fetch_add(1, Relaxed);
            Error::because(TUNNEL_FAILURE, format!("tunnel to {}", self.addr), e)
        };
        match &self.tls {
            Some(tls) => {
                let Some(config) = &tls.tls.config else {
                    return Err(failed(Error::explain(
                        ErrorType::TLSHandshakeFailure,
                        "Secret is not supplied by SDS",
                    )));
                };
                let io = crate::proxy::upstream_tls::handshake(tls, config.clone())
                    .await
                    .map_err(failed)?;
                self.carry(io).await
            }
            None => {
                let io = tokio::net::TcpStream::connect(self.addr)
                    .await
                    .map_err(|e| {
                        failed(Error::because(
                            ErrorType::ConnectError,
                            "TCP connect".to_string(),
                            e,
                        ))
                    })?;
                let _ = io.set_nodelay(true);
                self.carry(io).await
            }
        }
    }

    /// The bytes over `io`: in a CONNECT stream when the chain tunnels, else as they are.
    async fn carry<S>(&self, io: S) -> Result<Stream>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Some((t, authority)) = &self.tunnel else {
            return crate::proxy::upstream_tls::relayed(io).await;
        };
        let stream = connect_stream(io, t, authority).await?;
        crate::proxy::upstream_tls::relayed(stream).await
    }
}

/// An HTTP/2 connection over `io` and one CONNECT stream on it, once answered 2xx.
async fn connect_stream<S>(
    io: S,
    t: &Tunneling,
    authority: &http::uri::Authority,
) -> Result<H2Stream>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let h2err = |what: &str, e: h2::Error| {
        Error::because(TUNNEL_FAILURE, format!("HBONE {what} to {authority}"), e)
    };
    let (send, conn) = h2::client::handshake(io)
        .await
        .map_err(|e| h2err("handshake", e))?;
    // Drives the connection until the stream and every handle are gone.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut send = send.ready().await.map_err(|e| h2err("connection", e))?;
    let mut req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(
            http::Uri::builder()
                .authority(authority.clone())
                .build()
                .map_err(|e| Error::because(TUNNEL_FAILURE, "CONNECT uri".to_string(), e))?,
        )
        .body(())
        .map_err(|e| Error::because(TUNNEL_FAILURE, "CONNECT request".to_string(), e))?;
    for (k, v) in &t.headers {
        req.headers_mut().append(k.clone(), v.clone());
    }
    let (resp, stream) = send
        .send_request(req, false)
        .map_err(|e| h2err("CONNECT", e))?;
    let resp = resp.await.map_err(|e| h2err("CONNECT", e))?;
    if !resp.status().is_success() {
        return fail(format!(
            "HBONE CONNECT to {authority} answered {}",
            resp.status()
        ));
    }
    Ok(H2Stream {
        send: stream,
        recv: resp.into_body(),
        pending: Bytes::new(),
        ended: false,
    })
}

/// A CONNECT stream as a byte stream: DATA frames in, DATA frames out, END_STREAM on
/// shutdown (Envoy's half-close).
struct H2Stream {
    send: h2::SendStream<Bytes>,
    recv: h2::RecvStream,
    pending: Bytes,
    ended: bool,
}

fn io_err(e: h2::Error) -> std::io::Error {
    std::io::Error::other(e)
}

impl AsyncRead for H2Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(d)) => {
                    let _ = this.recv.flow_control().release_capacity(d.len());
                    this.pending = d;
                }
                Some(Err(e)) => return Poll::Ready(Err(io_err(e))),
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        this.send.reserve_capacity(buf.len());
        loop {
            match ready!(this.send.poll_capacity(cx)) {
                Some(Ok(0)) => continue,
                Some(Ok(n)) => {
                    let n = n.min(buf.len());
                    this.send
                        .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                        .map_err(io_err)?;
                    return Poll::Ready(Ok(n));
                }
                Some(Err(e)) => return Poll::Ready(Err(io_err(e))),
                None => return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.ended {
            this.ended = true;
            let _ = this.send.send_data(Bytes::new(), true);
        }
        Poll::Ready(Ok(()))
    }
}
