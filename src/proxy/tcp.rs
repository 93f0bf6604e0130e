//! `envoy.filters.network.tcp_proxy`: the connection's bytes, the peeked ClientHello included,
//! go to one endpoint of the chain's cluster and back, until both sides have closed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::admin::stats::TcpStats;
use crate::snapshot::tcp_proxy::TcpProxy;
use crate::snapshot::Snapshot;
use crate::telemetry::istio_stats::{Istio, StatsConfig};
use crate::telemetry::{Protocol, ResponseFlag, StreamInfo};

/// Serves one downstream connection on a tcp_proxy chain. `snap` is the snapshot the chain was
/// picked from; it is let go once the upstream is connected. `close` turns true when the drain
/// of the connection's chain (changed or removed by a push) or listener is over: Envoy closes
/// what is left then (`--drain-time-s`, 600 s by default). `istio`: the chain's network
/// `istio.stats` filter and where its metrics go.
pub async fn serve<D>(
    down: D,
    (peer, local): (SocketAddr, Option<SocketAddr>),
    proxy: &TcpProxy,
    snap: Arc<Snapshot>,
    stats: &TcpStats,
    close: watch::Receiver<bool>,
    istio: Option<(&StatsConfig, &Istio)>,
) where
    D: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stats.cx_total.fetch_add(1, Relaxed);
    // The connection's record for its observers (access logs, Istio's TCP metrics).
    let mut info = StreamInfo::new(Protocol::Tcp);
    info.downstream_direct_remote = Some(peer);
    info.downstream_remote = Some(peer);
    info.downstream_local = local;
    let Some(up) = connect(proxy, &snap, stats, peer, &mut info).await else {
        // Envoy closes the downstream connection without a byte when no upstream is reached.
        info.last_downstream_tx = Some(info.elapsed());
        report(istio, &info);
        access_log(proxy, &info);
        return;
    };
    drop(snap);
    let _ = up.set_nodelay(true);
    info.upstream_local = up.local_addr().ok();
    info.first_upstream_tx = Some(info.elapsed());
    stats.cx_active.fetch_add(1, Relaxed);
    let moved = pipe(down, up, proxy.idle_timeout, stats, close).await;
    stats.cx_active.fetch_sub(1, Relaxed);
    info.bytes_received = moved.received;
    info.bytes_sent = moved.sent;
    info.last_downstream_tx = Some(info.elapsed());
    report(istio, &info);
    access_log(proxy, &info);
}

/// The connection is over: Istio's TCP metrics (see `Store::record_tcp`).
fn report(istio: Option<(&StatsConfig, &Istio)>, info: &StreamInfo) {
    if let Some((cfg, ist)) = istio {
        ist.store.configured();
        ist.store.record_tcp(cfg, &ist.node, info);
    }
}

/// tcp_proxy's `access_log`, once the connection is over.
fn access_log(proxy: &TcpProxy, info: &StreamInfo) {
    if !proxy.access_log.is_empty() {
        proxy
            .access_log
            .log(&crate::telemetry::access_log::LogContext {
                info,
                request: None,
                response: None,
                trailers: None,
                log_type: crate::telemetry::access_log::log_type::TCP_CONNECTION_END,
            });
    }
}

/// The socket error as Envoy words it (the C library's text, without Rust's "(os error N)").
fn strerror(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// Bytes a connection moved: read from the downstream, and written to it.
struct Moved {
    received: u64,
    sent: u64,
}

/// An upstream connection to the chain's cluster, trying up to `max_connect_attempts` hosts,
/// each picked afresh by the cluster's balancer, as Envoy does.
async fn connect(
    proxy: &TcpProxy,
    snap: &Snapshot,
    stats: &TcpStats,
    peer: SocketAddr,
    info: &mut StreamInfo,
) -> Option<TcpStream> {
    let name = proxy.cluster(fastrand::u64(..));
    let Some(cluster) = snap.clusters.get(name) else {
        stats.cx_no_route.fetch_add(1, Relaxed);
        info.flags.set(ResponseFlag::NoClusterFound);
        tracing::debug!(cluster = %name, %peer, "tcp_proxy: no such cluster; closing");
        return None;
    };
    info.upstream = Some(cluster.def.telemetry.clone());
    for attempt in 1..=proxy.max_connect_attempts {
        info.attempts = attempt;
        let Some((i, addr)) = cluster.pick() else {
            info.flags.set(ResponseFlag::NoHealthyUpstream);
            tracing::debug!(cluster = %name, %peer, "tcp_proxy: no healthy upstream; closing");
            return None;
        };
        if cluster
            .endpoints
            .hosts
            .get(i)
            .is_some_and(|h| h.internal.is_some())
        {
            // Through an internal listener (HBONE) from a downstream tcp_proxy chain: not
            // implemented; connecting to the endpoint id directly would bypass the tunnel.
            tracing::warn!(cluster = %name, %addr, "tcp_proxy to an internal listener's endpoint is not supported yet; closing");
            return None;
        }
        if cluster.tls_for(i).is_some() {
            // Envoy would originate TLS here; sending the bytes in the clear instead would be
            // worse than refusing the connection.
            tracing::warn!(cluster = %name, %addr, "tcp_proxy to an upstream TLS endpoint is not supported yet; closing");
            return None;
        }
        info.upstream_host = Some(addr);
        info.upstream_workload = cluster
            .endpoints
            .hosts
            .get(i)
            .and_then(|h| h.workload.clone());
        match tokio::time::timeout(cluster.def.connect_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(up)) => return Some(up),
            Ok(Err(e)) => {
                tracing::debug!(cluster = %name, %addr, attempt, "tcp_proxy: connect failed: {e}");
                info.upstream_transport_failure_reason =
                    Some(format!("delayed connect error: {}", strerror(&e)));
            }
            Err(_) => {
                tracing::debug!(cluster = %name, %addr, attempt, "tcp_proxy: connect timed out")
            }
        }
        cluster.stats.cx_connect_fail.fetch_add(1, Relaxed);
    }
    info.flags.set(ResponseFlag::UpstreamConnectionFailure);
    if proxy.max_connect_attempts > 1 {
        info.flags.set(ResponseFlag::UpstreamRetryLimitExceeded);
    }
    None
}

/// Copies both ways. A FIN from one side becomes a write shutdown towards the other (Envoy's
/// half-close); the connection ends once both directions have finished, on an error in
/// either, or after `idle` without a byte either way.
async fn pipe<D>(
    down: D,
    up: TcpStream,
    idle: Option<Duration>,
    stats: &TcpStats,
    mut close: watch::Receiver<bool>,
) -> Moved
where
    D: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let start = Instant::now();
    let (received, sent) = (AtomicU64::new(0), AtomicU64::new(0));
    // Milliseconds since `start` of the last byte moved, shared by both directions.
    let last = AtomicU64::new(0);
    // Plain TCP or a TLS session the chain terminated.
    let (mut dr, mut dw) = tokio::io::split(down);
    let (mut ur, mut uw) = up.into_split();
    let upstream = copy(&mut dr, &mut uw, &last, start, [&stats.rx_bytes, &received]);
    let downstream = copy(&mut ur, &mut dw, &last, start, [&stats.tx_bytes, &sent]);
    let both = async {
        // The first direction to fail ends both: Envoy closes the whole connection on a reset.
        tokio::try_join!(upstream, downstream).map(|_| ())
    };
    let idle_watch = async {
        let Some(idle) = idle else {
            return std::future::pending::<()>().await;
        };
        loop {
            let since = Duration::from_millis(last.load(Relaxed));
            let due = start + since + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due.into()).await;
        }
    };
    let drain = async {
        // A sender gone is a chain gone: its drain timer holds the sender until the end.
        while !*close.borrow() {
            if close.changed().await.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        _ = both => {}
        () = idle_watch => {
            stats.idle_timeout.fetch_add(1, Relaxed);
        }
        () = drain => {}
    }
    Moved {
        received: received.load(Relaxed),
        sent: sent.load(Relaxed),
    }
}

async fn copy<R, W>(
    from: &mut R,
    to: &mut W,
    last: &AtomicU64,
    start: Instant,
    bytes: [&AtomicU64; 2],
) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            // Half-close: the other side may still send.
            return to.shutdown().await;
        }
        // Envoy's idle timer restarts on reads and writes of either side alike.
        let touch = || last.store(start.elapsed().as_millis() as u64, Relaxed);
        touch();
        to.write_all(&buf[..n]).await?;
        touch();
        for b in bytes {
            b.fetch_add(n as u64, Relaxed);
        }
    }
}

#[cfg(test)]
mod strerror_tests {
    #[test]
    fn socket_errors_read_as_envoys() {
        let e = std::io::Error::from_raw_os_error(111);
        assert_eq!(super::strerror(&e), "Connection refused");
    }
}
