//! TLS passthrough and plain TCP proxying with `envoy.filters.network.tcp_proxy`, as an Istio
//! `Gateway` server with `tls.mode: PASSTHROUGH` renders it: the TLS inspector reads the SNI,
//! the chain is picked by `server_names`, and the raw stream (ClientHello included) goes to the
//! chain's cluster, so the client sees the backend's own certificate. Runs against Envoy too
//! (PORTICO_GATEWAY_BIN).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::listener::v3::{
    filter, listener_filter, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    tcp_proxy::{weighted_cluster::ClusterWeight, ClusterSpecifier, WeightedCluster},
    TcpProxy,
};
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------------------------------
// Certificates and backends

/// A TCP backend that greets each connection with `<name>\n` (over TLS when given a config)
/// and then echoes what it reads until the client half-closes, then closes.
struct TcpBackend {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl TcpBackend {
    async fn start(name: &str, tls: Option<rustls::ServerConfig>) -> TcpBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        let addr = listener.local_addr().expect("backend addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let greeting = format!("{name}\n").into_bytes();
        let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let greeting = greeting.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    match acceptor {
                        Some(a) => {
                            if let Ok(tls) = a.accept(tcp).await {
                                echo(tls, &greeting).await;
                            }
                        }
                        None => echo(tcp, &greeting).await,
                    }
                });
            }
        });
        TcpBackend { addr, accepted }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

async fn echo<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut s: S, greeting: &[u8]) {
    if s.write_all(greeting).await.is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if s.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = s.shutdown().await;
}

/// A port nothing listens on.
fn dead_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

// ---------------------------------------------------------------------------------------------
// xDS builders

fn tcp_proxy(prefix: &str, cluster: &str) -> TcpProxy {
    TcpProxy {
        stat_prefix: prefix.into(),
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.into())),
        ..Default::default()
    }
}

fn tcp_chain(name: &str, server_names: &[&str], p: TcpProxy) -> FilterChain {
    FilterChain {
        name: name.into(),
        filter_chain_match: (!server_names.is_empty()).then(|| FilterChainMatch {
            server_names: server_names.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }),
        filters: vec![Filter {
            name: "envoy.filters.network.tcp_proxy".into(),
            config_type: Some(filter::ConfigType::TypedConfig(any(p))),
        }],
        ..Default::default()
    }
}

fn passthrough_listener(
    port: u16,
    chains: Vec<FilterChain>,
    default: Option<FilterChain>,
) -> Listener {
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        listener_filters: vec![ListenerFilter {
            name: "envoy.filters.listener.tls_inspector".into(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(any(
                TlsInspector::default(),
            ))),
            ..Default::default()
        }],
        filter_chains: chains,
        default_filter_chain: default,
        ..Default::default()
    }
}

fn plain_listener(port: u16, p: TcpProxy) -> Listener {
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        filter_chains: vec![tcp_chain("raw", &[], p)],
        ..Default::default()
    }
}

fn cluster_at(s: &mut Snapshot, name: &str, addrs: &[SocketAddr]) {
    s.clusters.push(eds_cluster(name));
    s.endpoints.push(cla(name, addrs));
}

// ---------------------------------------------------------------------------------------------
// Clients

/// A TLS session through the gateway to `sni`; the handshake verifies the backend's
/// certificate for `sni`. Returns the greeting line and the stream.
async fn tls_session(
    pki: &Pki,
    port: u16,
    sni: &str,
) -> Result<(String, tokio_rustls::client::TlsStream<TcpStream>), String> {
    let run = async {
        let tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
        let mut tls = pki
            .client()
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let line = read_line(&mut tls).await?;
        Ok((line, tls))
    };
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .map_err(|_| "timed out".to_string())?
}

async fn read_line<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Result<String, String> {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b).await {
            Ok(0) => return Err(format!("closed after {:?}", String::from_utf8_lossy(&out))),
            Ok(_) if b[0] == b'\n' => return Ok(String::from_utf8_lossy(&out).into_owned()),
            Ok(_) => out.push(b[0]),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// A plain TCP connection through the gateway and the backend's greeting.
async fn tcp_session(port: u16) -> Result<(String, TcpStream), String> {
    let run = async {
        let mut tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let line = read_line(&mut tcp).await?;
        Ok((line, tcp))
    };
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .map_err(|_| "timed out".to_string())?
}

/// Round trip of `msg` on an echoing session.
async fn echo_round<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    msg: &str,
) -> Result<String, String> {
    s.write_all(format!("{msg}\n").as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    tokio::time::timeout(Duration::from_secs(5), read_line(s))
        .await
        .map_err(|_| "echo timed out".to_string())?
}

/// Whether the gateway closes a fresh connection without passing a byte (read gives EOF or
/// a reset), within 5 s.
async fn closed_without_data(port: u16, send: &[u8]) -> Result<(), String> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.write_all(send).await;
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await {
        Err(_) => Err("still open after 5 s".into()),
        Ok(Ok(0)) | Ok(Err(_)) => Ok(()),
        Ok(Ok(n)) => Err(format!("got {n} bytes: {:?}", &buf[..n])),
    }
}

/// A ClientHello-bearing TLS attempt for `sni` fails (the gateway closed the connection).
async fn tls_refused(pki: &Pki, port: u16, sni: &str) -> Result<(), String> {
    match tls_session(pki, port, sni).await {
        Ok((line, _)) => Err(format!("reached {line}")),
        Err(e) if e == "timed out" => Err(e),
        Err(_) => Ok(()),
    }
}

async fn tcp_stat(gw: &Gateway, stat: &str, prefix: &str) -> f64 {
    prom_value(
        &gw.prometheus().await,
        &format!("envoy_tcp_{stat}"),
        "envoy_tcp_prefix",
        prefix,
    )
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_by_sni_reaches_each_backend_with_its_own_certificate() {
    let pki = Pki::new("portico passthrough CA");
    let a = TcpBackend::start("backend-a", Some(pki.server(&["a.example.com"]))).await;
    let b = TcpBackend::start(
        "backend-b",
        Some(pki.server(&["b.example.com", "other.test"])),
    )
    .await;
    let chains = || {
        vec![
            tcp_chain("a", &["a.example.com"], tcp_proxy("pass_a", "cluster-a")),
            tcp_chain("b", &["b.example.com"], tcp_proxy("pass_b", "cluster-b")),
        ]
    };
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "cluster-a", &[a.addr]);
    cluster_at(&mut snap, "cluster-b", &[b.addr]);
    let mut mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![passthrough_listener(port, chains(), None)];
        s
    })
    .await;
    let port = mesh.port;

    // Each SNI reaches its backend, and the client verified that backend's certificate for
    // the name: the gateway did not terminate TLS.
    let (line, mut open_a) = eventually("SNI a through the gateway", PROPAGATION, || {
        tls_session(&pki, port, "a.example.com")
    })
    .await;
    assert_eq!(line, "backend-a");
    assert_eq!(
        echo_round(&mut open_a, "hello a").await.as_deref(),
        Ok("hello a")
    );
    let (line, mut sb) = tls_session(&pki, port, "b.example.com")
        .await
        .expect("SNI b");
    assert_eq!(line, "backend-b");
    assert_eq!(echo_round(&mut sb, "hi b").await.as_deref(), Ok("hi b"));
    // Half-close: the backend sees EOF, answers with its own close, and the client reads EOF.
    sb.get_mut().0.shutdown().await.expect("half-close");
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), sb.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "the close did not come back");

    // No chain for this name and no default: the connection is closed.
    tls_refused(&pki, port, "other.test")
        .await
        .expect("unknown SNI without a default chain is refused");
    // Not TLS at all on a passthrough listener with only SNI chains: closed too.
    closed_without_data(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("plain text is refused");

    let gw = &mesh.gw;
    assert!(tcp_stat(gw, "downstream_cx_total", "pass_a").await >= 1.0);
    // The chain's TcpProxy is dumped as Envoy's proto JSON.
    let dump = get(&gw.admin_url("/config_dump"), None, &[]).await;
    assert_eq!(dump.status, 200);
    let flat: String = dump.body.split_whitespace().collect();
    for needle in [
        r#""@type":"type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy""#,
        r#""stat_prefix":"pass_a""#,
        r#""cluster":"cluster-a""#,
    ] {
        assert!(flat.contains(needle), "config_dump lacks {needle}");
    }
    assert!(tcp_stat(gw, "downstream_cx_total", "pass_b").await >= 1.0);

    // A default chain to backend b: an unknown name now reaches b. The open session to a
    // (its chain unchanged by the push) stays up.
    let mut next = snap.clone();
    next.listeners = vec![passthrough_listener(
        port,
        chains(),
        Some(tcp_chain(
            "default",
            &[],
            tcp_proxy("pass_default", "cluster-b"),
        )),
    )];
    mesh.ads.set_snapshot("2", &next);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    let (line, _s) = eventually("unknown SNI to the default chain", PROPAGATION, || {
        tls_session(&pki, port, "other.test")
    })
    .await;
    assert_eq!(line, "backend-b");
    assert_eq!(
        echo_round(&mut open_a, "still there").await.as_deref(),
        Ok("still there"),
        "a proxied connection survives an LDS push that keeps its chain"
    );
    assert!(a.accepted() >= 1 && b.accepted() >= 2);
    drop(open_a);
    mesh.ads.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_tcp_on_a_plain_listener_and_listener_removal() {
    let echo = TcpBackend::start("echo", None).await;
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "echo", &[echo.addr]);
    let mut mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![plain_listener(port, tcp_proxy("raw", "echo"))];
        s
    })
    .await;
    let port = mesh.port;
    let (line, mut s) = eventually("raw TCP through the gateway", PROPAGATION, || {
        tcp_session(port)
    })
    .await;
    assert_eq!(line, "echo");
    assert_eq!(echo_round(&mut s, "ping").await.as_deref(), Ok("ping"));
    // Bytes that look like HTTP are just bytes here.
    assert_eq!(
        echo_round(&mut s, "GET / HTTP/1.1").await.as_deref(),
        Ok("GET / HTTP/1.1")
    );
    // Half-close from the client: data still flows back, then the backend's close arrives.
    let (mut s2_line, mut s2) = tcp_session(port).await.expect("second session");
    assert_eq!(std::mem::take(&mut s2_line), "echo");
    s2.write_all(b"last words\n").await.expect("write");
    s2.shutdown().await.expect("half-close");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s2.read_to_end(&mut rest))
        .await
        .expect("backend close propagated")
        .expect("read to end");
    assert_eq!(rest, b"last words\n");

    assert!(tcp_stat(&mesh.gw, "downstream_cx_total", "raw").await >= 2.0);

    // The listener is removed: new connections are refused, and the open one stays up while
    // the listener drains (Envoy's drain time, 600 s by default).
    let mut next = snap.clone();
    next.listeners.clear();
    mesh.ads.set_snapshot("2", &next);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually("listener gone", PROPAGATION, || async {
        match tcp_connect(port).await {
            Err(_) => Ok(()),
            Ok(()) => Err("still accepting".to_string()),
        }
    })
    .await;
    assert_eq!(
        echo_round(&mut s, "draining").await.as_deref(),
        Ok("draining"),
        "an open proxied connection stays up while its removed listener drains"
    );
    mesh.ads.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_close_the_downstream() {
    let echo = TcpBackend::start("echo", None).await;
    let dead = dead_addr();
    let (p_dead, p_retry, p_none, p_missing) = (free_port(), free_port(), free_port(), free_port());
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "dead", &[dead]);
    cluster_at(&mut snap, "half-dead", &[dead, echo.addr]);
    cluster_at(&mut snap, "empty", &[]);
    let retry = TcpProxy {
        max_connect_attempts: Some(UInt32Value { value: 2 }),
        ..tcp_proxy("retry", "half-dead")
    };
    let mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![
            plain_listener(port, tcp_proxy("unused", "echo-missing")),
            plain_listener(p_dead, tcp_proxy("dead", "dead")),
            plain_listener(p_retry, retry),
            plain_listener(p_none, tcp_proxy("none", "empty")),
            plain_listener(p_missing, tcp_proxy("missing", "no-such-cluster")),
        ];
        s
    })
    .await;
    // Every listener is up once each accepts.
    for p in [p_dead, p_retry, p_none, p_missing] {
        eventually("listener up", PROPAGATION, || async move {
            tcp_connect(p).await.map_err(|e| format!("{e:?}"))
        })
        .await;
    }

    // Connection refused upstream: the downstream is closed without a byte.
    closed_without_data(p_dead, b"hello\n")
        .await
        .expect("refused upstream closes the downstream");
    // With two attempts, a refused host is followed by another pick: round robin over
    // {dead, echo} then always ends on echo.
    for i in 0..6 {
        let (line, mut s) = tcp_session(p_retry)
            .await
            .unwrap_or_else(|e| panic!("attempt {i} with a retry: {e}"));
        assert_eq!(line, "echo");
        assert_eq!(echo_round(&mut s, "x").await.as_deref(), Ok("x"));
    }
    // No host at all, and a cluster that does not exist: closed.
    closed_without_data(p_none, b"hello\n")
        .await
        .expect("no healthy upstream closes the downstream");
    closed_without_data(p_missing, b"hello\n")
        .await
        .expect("a missing cluster closes the downstream");

    let gw = &mesh.gw;
    eventually("no_route counted", PROPAGATION, || async {
        let v = tcp_stat(gw, "downstream_cx_no_route", "missing").await;
        if v >= 1.0 {
            Ok(())
        } else {
            Err(format!("downstream_cx_no_route {v}"))
        }
    })
    .await;
    let prom = gw.prometheus().await;
    let fails = |c: &str| {
        prom_value(
            &prom,
            "envoy_cluster_upstream_cx_connect_fail",
            "envoy_cluster_name",
            c,
        )
    };
    // Each listener also saw the one connection of the "listener up" probe.
    assert_eq!(fails("dead"), 2.0, "two connections, one attempt each");
    assert_eq!(fails("empty"), 0.0, "no host, no attempt");
    let cx = |prefix: &str| {
        prom_value(
            &prom,
            "envoy_tcp_downstream_cx_total",
            "envoy_tcp_prefix",
            prefix,
        )
    };
    assert_eq!(
        [cx("dead"), cx("none"), cx("missing"), cx("retry")],
        [2.0, 2.0, 2.0, 7.0]
    );
    let no_route = |prefix: &str| {
        prom_value(
            &prom,
            "envoy_tcp_downstream_cx_no_route",
            "envoy_tcp_prefix",
            prefix,
        )
    };
    assert_eq!([no_route("missing"), no_route("none")], [2.0, 0.0]);
    assert!(
        fails("half-dead") >= 1.0,
        "half-dead: {}",
        fails("half-dead")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_clusters_split_connections_by_weight() {
    let a = TcpBackend::start("a", None).await;
    let b = TcpBackend::start("b", None).await;
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "ca", &[a.addr]);
    cluster_at(&mut snap, "cb", &[b.addr]);
    let p = TcpProxy {
        stat_prefix: "split".into(),
        cluster_specifier: Some(ClusterSpecifier::WeightedClusters(WeightedCluster {
            clusters: vec![
                ClusterWeight {
                    name: "ca".into(),
                    weight: 1,
                    ..Default::default()
                },
                ClusterWeight {
                    name: "cb".into(),
                    weight: 3,
                    ..Default::default()
                },
            ],
        })),
        ..Default::default()
    };
    let mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![plain_listener(port, p)];
        s
    })
    .await;
    let port = mesh.port;
    eventually("split listener", PROPAGATION, || tcp_session(port)).await;
    let n = 200;
    let mut to_b = 0;
    for i in 0..n {
        let (line, _s) = tcp_session(port)
            .await
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        if line == "b" {
            to_b += 1;
        }
    }
    // 75 % expected; outside 55..95 % of 200 has probability 3e-10 (binomial, computed).
    let share = f64::from(to_b) / f64::from(n);
    assert!((0.55..=0.95).contains(&share), "share to b: {share}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_closes_a_silent_connection() {
    let echo = TcpBackend::start("echo", None).await;
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "echo", &[echo.addr]);
    let p = TcpProxy {
        idle_timeout: Some(PDuration {
            seconds: 1,
            nanos: 0,
        }),
        ..tcp_proxy("idle", "echo")
    };
    let mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![plain_listener(port, p)];
        s
    })
    .await;
    let port = mesh.port;
    eventually("idle listener", PROPAGATION, || tcp_session(port)).await;

    // Traffic every 400 ms keeps it open past the timeout.
    let (_, mut busy) = tcp_session(port).await.expect("busy session");
    for i in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            echo_round(&mut busy, &format!("beat {i}")).await,
            Ok(format!("beat {i}"))
        );
    }
    // Silence: closed after about a second.
    let (_, mut quiet) = tcp_session(port).await.expect("quiet session");
    let start = Instant::now();
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), quiet.read(&mut buf))
        .await
        .expect("the idle connection was not closed");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(3),
        "closed after {took:?}"
    );
    assert!(tcp_stat(&mesh.gw, "idle_timeout", "idle").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_timeout_and_odd_first_bytes() {
    // A listening socket whose accept queue is full drops further SYNs, so connecting to it
    // hangs until the cluster's connect_timeout (1 s in eds_cluster).
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let stuck_addr = sock.local_addr().expect("addr");
    let stuck = sock.listen(0).expect("listen");
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(c)) =
            tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(stuck_addr)).await
        {
            fillers.push(c);
        }
    }
    let echo = TcpBackend::start("echo", None).await;
    let p_stuck = free_port();
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "stuck", &[stuck_addr]);
    cluster_at(&mut snap, "echo", &[echo.addr]);
    let mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![
            // TLS inspector with only a default chain: whatever the first bytes are.
            passthrough_listener(
                port,
                vec![],
                Some(tcp_chain("any", &[], tcp_proxy("any", "echo"))),
            ),
            plain_listener(p_stuck, tcp_proxy("stuck", "stuck")),
        ];
        s
    })
    .await;
    let port = mesh.port;
    eventually("stuck listener up", PROPAGATION, || async {
        tcp_connect(p_stuck).await.map_err(|e| format!("{e:?}"))
    })
    .await;
    let start = Instant::now();
    closed_without_data(p_stuck, b"hello\n")
        .await
        .expect("connect timeout closes the downstream");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(4),
        "closed after {took:?}"
    );
    drop(stuck);
    drop(fillers);

    // Plain text on a listener with the TLS inspector goes to the default chain, once the
    // client has spoken: the inspector waits for the first bytes, so a server-first protocol
    // sees nothing until then (in Envoy too).
    let mut silent = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let mut buf = [0u8; 16];
    let early = tokio::time::timeout(Duration::from_millis(500), silent.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "greeting before the client spoke: {early:?}"
    );
    let line = eventually("plain text to the default chain", PROPAGATION, || async {
        let mut tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| e.to_string())?;
        tcp.write_all(b"plain\n").await.map_err(|e| e.to_string())?;
        let run = async {
            let greeting = read_line(&mut tcp).await?;
            let echoed = read_line(&mut tcp).await?;
            Ok::<_, String>(format!("{greeting}/{echoed}"))
        };
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .map_err(|_| "timed out".to_string())?
    })
    .await;
    assert_eq!(line, "echo/plain");
    // A handshake record that is not a ClientHello is not TLS to the inspector either: it goes
    // to the default chain as it is (agreed with Envoy 1.40).
    let mut tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    tcp.write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 0xff, 0xff, 0xff, 0xff, 0xff])
        .await
        .expect("write");
    let mut buf = [0u8; 64];
    let got = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await;
    let outcome = match got {
        Err(_) => "open".to_string(),
        Ok(Ok(0)) | Ok(Err(_)) => "closed".to_string(),
        Ok(Ok(n)) => String::from_utf8_lossy(&buf[..n]).into_owned(),
    };
    assert!(
        outcome.starts_with("echo\n"),
        "a malformed ClientHello: {outcome:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_terminated_in_front_of_tcp_proxy() {
    use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource, TransportSocket};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        CommonTlsContext, DownstreamTlsContext, TlsCertificate,
    };
    // Istio's `protocol: TLS` server with `tls.mode: SIMPLE` and tcp routes: the gateway
    // holds the certificate, the backend speaks plain TCP.
    let pki = Pki::new("terminating CA");
    let leaf = pki.leaf(&["db.example.com"]);
    let inline = |s: &str| {
        Some(DataSource {
            specifier: Some(data_source::Specifier::InlineString(s.to_string())),
            ..Default::default()
        })
    };
    let plain = TcpBackend::start("plain-db", None).await;
    let mut snap = Snapshot::default();
    cluster_at(&mut snap, "db", &[plain.addr]);
    let mut chain = tcp_chain("db", &["db.example.com"], tcp_proxy("db_tls", "db"));
    chain.transport_socket = Some(TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any(DownstreamTlsContext {
                    common_tls_context: Some(CommonTlsContext {
                        tls_certificates: vec![TlsCertificate {
                            certificate_chain: inline(&leaf.cert),
                            private_key: inline(&leaf.key),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            ),
        ),
    });
    let mesh = Mesh::start_raw(|port| {
        let mut s = snap.clone();
        s.listeners = vec![passthrough_listener(port, vec![chain.clone()], None)];
        s
    })
    .await;
    let port = mesh.port;
    // The client verifies the gateway's certificate for the name, and talks to the backend.
    let (line, mut s) = eventually(
        "TLS to the gateway, TCP to the backend",
        PROPAGATION,
        || tls_session(&pki, port, "db.example.com"),
    )
    .await;
    assert_eq!(line, "plain-db");
    assert_eq!(
        echo_round(&mut s, "select 1").await.as_deref(),
        Ok("select 1")
    );
    assert_eq!(
        s.get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec()),
        Some(leaf.der.clone())
    );
    assert!(tcp_stat(&mesh.gw, "downstream_cx_total", "db_tls").await >= 1.0);
}
