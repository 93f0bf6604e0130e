//! Upstream TLS connections, made by Portico and pooled by pingora.
//!
//! pingora's custom L4 connector dials TCP and runs the handshake with the transport socket's
//! rustls config (pingora's own rustls connector cannot skip only the hostname check, match
//! SANs or keep a config per cluster). pingora's pool, though, only hands a pooled connection
//! out again when the fd's peer address is the peer's (`matches_fd`), which no in-memory
//! stream passes, so a TLS session given to pingora directly was never reused.
//!
//! So the session is relayed: pingora gets one end of a Unix-socket connection to a listener
//! of this process (the peer's address is that listener's path, which `matches_fd` then
//! finds), and a task on the same worker copies between the other end and the TLS session.
//! An idle pooled connection is the relay's too: when pingora drops it, or the upstream
//! closes, the relay closes the other side. Keep-alive costs two socket copies per direction;
//! a handshake per request cost far more. pingora's `total_connection_timeout` bounds the
//! dial and the handshake, as Envoy's connect timeout runs until the handshake is done.
//!
//! Pairing: the connector sends a random token on its new connection; the acceptor (a
//! thread blocking in `accept`) reads it and hands the accepted end to the waiting connector.
//! Only this process may connect: the listener lives in a directory only its user can enter,
//! and the acceptor refuses peers whose `SO_PEERCRED` pid is not ours.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use pingora_core::connectors::L4Connect;
use pingora_core::protocols::l4::stream::Stream;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use rustls::pki_types::ServerName;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::oneshot;

use crate::snapshot::listener::AlpnOverride;
use crate::snapshot::upstream_tls::EndpointTls;

/// Marks a handshake failure so the local reply can say what Envoy says.
pub const TLS_FAILURE: ErrorType = ErrorType::TLSHandshakeFailure;

/// A peer that connects to `tls.addr` through `tls`: the relay's address plus cheap clones.
/// `alpn` (istio.alpn, with whether the cluster speaks HTTP/2) replaces the socket's ALPN list,
/// as Envoy's `applicationProtocolListOverride` does; such connections are pooled apart.
pub fn peer(
    tls: &Arc<EndpointTls>,
    alpn: Option<(Arc<AlpnOverride>, bool)>,
    connect_timeout: std::time::Duration,
) -> Result<HttpPeer> {
    let relay = relay()?;
    let mut peer = HttpPeer::new_uds(&relay.path_str, false, String::new())?;
    peer.options.total_connection_timeout = Some(connect_timeout);
    // pingora's reuse hash has the address (the relay's, shared) and not the connector.
    match alpn {
        Some((alpn, http2)) => {
            peer.group_key = tls.group_key ^ alpn.key.rotate_left(if http2 { 1 } else { 0 });
            peer.options.custom_l4 = Some(Arc::new(WithAlpn {
                tls: tls.clone(),
                alpn,
                http2,
            }));
        }
        None => {
            peer.group_key = tls.group_key;
            peer.options.custom_l4 = Some(tls.clone());
        }
    }
    Ok(peer)
}

/// An endpoint's TLS with the connection manager's ALPN list instead of the socket's.
#[derive(Debug)]
struct WithAlpn {
    tls: Arc<EndpointTls>,
    alpn: Arc<AlpnOverride>,
    http2: bool,
}

/// The listener relayed connections come through, and the connectors waiting for theirs.
struct Relay {
    path: PathBuf,
    path_str: String,
    waiting: Mutex<HashMap<u64, oneshot::Sender<std::os::unix::net::UnixStream>>>,
}

static RELAY: OnceLock<std::result::Result<Arc<Relay>, String>> = OnceLock::new();

fn relay() -> Result<Arc<Relay>> {
    match RELAY.get_or_init(|| Relay::start().map_err(|e| e.to_string())) {
        Ok(r) => Ok(r.clone()),
        Err(e) => Error::e_explain(
            ErrorType::ConnectError,
            format!("upstream TLS relay unavailable: {e}"),
        ),
    }
}

const DIR_PREFIX: &str = "portico-tls-relay-";

impl Relay {
    fn start() -> std::io::Result<Arc<Relay>> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        remove_stale(&base);
        let dir = base.join(format!(
            "{DIR_PREFIX}{}-{:x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let path = dir.join("s");
        let listener = std::os::unix::net::UnixListener::bind(&path)?;
        let path_str = path
            .to_str()
            .ok_or_else(|| std::io::Error::other("the temp directory's path is not UTF-8"))?
            .to_string();
        let relay = Arc::new(Relay {
            path,
            path_str,
            waiting: Mutex::default(),
        });
        let r = relay.clone();
        std::thread::Builder::new()
            .name("tls-relay-accept".into())
            .spawn(move || r.accept_loop(listener))?;
        Ok(relay)
    }

    fn accept_loop(&self, listener: std::os::unix::net::UnixListener) {
        let me = std::process::id() as i32;
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            if peer_pid(&conn) != Some(me) {
                tracing::warn!("upstream TLS relay: refused a connection from another process");
                continue;
            }
            let mut token = [0u8; 8];
            // The connector writes the token at once; never let a stuck peer hold the loop.
            let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(1)));
            if conn.read_exact(&mut token).is_err() || conn.set_nonblocking(true).is_err() {
                continue;
            }
            let waiter = self
                .waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&u64::from_le_bytes(token));
            if let Some(tx) = waiter {
                let _ = tx.send(conn);
            }
        }
    }

    /// A connected pair: pingora's end, and the relay's (registered with this worker).
    async fn pair(&self) -> std::io::Result<(UnixStream, UnixStream)> {
        let token = fastrand::u64(..);
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, tx);
        let result = async {
            let mut ours = UnixStream::connect(&self.path).await?;
            ours.write_all(&token.to_le_bytes()).await?;
            let theirs = tokio::time::timeout(std::time::Duration::from_secs(5), rx)
                .await
                .map_err(|_| std::io::Error::other("relay pairing timed out"))?
                .map_err(|_| std::io::Error::other("relay pairing dropped"))?;
            Ok((ours, UnixStream::from_std(theirs)?))
        }
        .await;
        if result.is_err() {
            self.waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token);
        }
        result
    }
}

fn peer_pid(conn: &std::os::unix::net::UnixStream) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given, and the fd is open.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.pid)
}

/// Relay directories left by processes that are gone (a gateway killed without cleanup).
fn remove_stale(base: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A TCP connection to `addr`, from `bind` when the cluster has `upstream_bind_config`.
async fn connect_tcp(
    addr: std::net::SocketAddr,
    bind: Option<std::net::SocketAddr>,
) -> std::io::Result<TcpStream> {
    let Some(bind) = bind else {
        return TcpStream::connect(addr).await;
    };
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.bind(bind)?;
    socket.connect(addr).await
}

#[async_trait]
impl L4Connect for EndpointTls {
    async fn connect(
        &self,
        _relay_addr: &pingora_core::protocols::l4::socket::SocketAddr,
    ) -> Result<Stream> {
        let Some(config) = &self.tls.config else {
            // Envoy's words for a socket whose SDS secret has not arrived.
            return Error::e_explain(TLS_FAILURE, "Secret is not supplied by SDS");
        };
        connect(self, config.clone()).await
    }
}

#[async_trait]
impl L4Connect for WithAlpn {
    async fn connect(
        &self,
        _relay_addr: &pingora_core::protocols::l4::socket::SocketAddr,
    ) -> Result<Stream> {
        let Some(config) = &self.tls.tls.config else {
            return Error::e_explain(TLS_FAILURE, "Secret is not supplied by SDS");
        };
        // Once per new connection (pooled ones are reused without it); a handshake costs far
        // more than this copy.
        let mut c = (**config).clone();
        if let Some(list) = self.alpn.for_protocol(self.http2) {
            c.alpn_protocols = list.to_vec();
        }
        connect(&self.tls, Arc::new(c)).await
    }
}

/// Dials the endpoint, runs the handshake with `config` and hands pingora the relay's end.
async fn connect(ep: &EndpointTls, config: Arc<rustls::ClientConfig>) -> Result<Stream> {
    let tls = handshake(ep, config).await?;
    relayed(tls).await
}

/// A TCP connection to the endpoint (with the cluster's keepalive and bind) and the TLS
/// handshake on it with `config`.
pub(crate) async fn handshake(
    ep: &EndpointTls,
    config: Arc<rustls::ClientConfig>,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let inet = ep.addr;
    let tcp = connect_tcp(inet, ep.bind).await.map_err(|e| {
        let kind = match e.kind() {
            std::io::ErrorKind::ConnectionRefused => ErrorType::ConnectRefused,
            _ => ErrorType::ConnectError,
        };
        Error::because(kind, format!("connecting to {inet}"), e)
    })?;
    let _ = tcp.set_nodelay(true);
    if let Some(k) = ep.keepalive {
        let ka = socket2::TcpKeepalive::new()
            .with_time(std::time::Duration::from_secs(u64::from(
                k.time.unwrap_or(7200),
            )))
            .with_interval(std::time::Duration::from_secs(u64::from(
                k.interval.unwrap_or(75),
            )))
            .with_retries(k.probes.unwrap_or(9));
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&ka);
    }
    // Without an SNI the name is the peer's IP, which rustls never sends as SNI; the
    // validator ignores names either way.
    let name = match &ep.tls.sni {
        Some(n) => n.clone(),
        None => ServerName::IpAddress(inet.ip().into()),
    };
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| Error::because(TLS_FAILURE, format!("TLS handshake with {inet}"), e))
}

/// Hands pingora the relay's end of a new pair whose other end is copied to and from `io`.
pub(crate) async fn relayed<S>(io: S) -> Result<Stream>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (ours, theirs) = relay_pair().await?;
    tokio::spawn(pump(theirs, io));
    Ok(Stream::from(ours))
}

/// A connected pair through the relay: pingora's end, and ours.
pub(crate) async fn relay_pair() -> Result<(UnixStream, UnixStream)> {
    let relay = relay()?;
    relay
        .pair()
        .await
        .map_err(|e| Error::because(ErrorType::ConnectError, "upstream relay".to_string(), e))
}

/// The path of the relay's listener: the address of every relayed peer.
pub(crate) fn relay_path() -> Result<String> {
    Ok(relay()?.path_str.clone())
}

/// Copies both ways until either side ends, then closes the other: an HTTP connection has
/// nothing left to say once one side is gone. (`tokio::io::copy` flushes whenever its reader
/// has nothing more yet, so a relayed response never waits in its buffer.)
async fn pump<S>(local: UnixStream, io: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite,
{
    let (mut lr, mut lw) = tokio::io::split(local);
    let (mut tr, mut tw) = tokio::io::split(io);
    let up = async {
        let _ = tokio::io::copy(&mut lr, &mut tw).await;
        // close_notify, then the socket closes when the session drops.
        let _ = tw.shutdown().await;
    };
    let down = async {
        let _ = tokio::io::copy(&mut tr, &mut lw).await;
        let _ = lw.shutdown().await;
    };
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}
