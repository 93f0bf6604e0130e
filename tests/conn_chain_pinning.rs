//! A downstream connection keeps the filter chain it was accepted on. A push that reorders a
//! listener's chains or changes another chain leaves it alone; a push that changes its own
//! chain drains it (HTTP/1: the old chain answers the next request with `connection: close`;
//! HTTP/2: GOAWAY), while new connections get the new chain. A route push (RDS) is not a chain
//! change: kept connections see the new routes. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::pki::{Leaf, Pki};
use common::*;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource, TransportSocket};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::RouteSpecifier, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CommonTlsContext, DownstreamTlsContext, TlsCertificate,
};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

// ---------------------------------------------------------------------------------------------
// xDS builders

fn inline(s: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(s.to_string())),
        ..Default::default()
    })
}

fn tls(leaf: &Leaf) -> TransportSocket {
    TransportSocket {
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
                        alpn_protocols: vec!["h2".into(), "http/1.1".into()],
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            ),
        ),
    }
}

/// A route table answering every request with `body`.
fn answering(name: &str, body: &str) -> RouteConfiguration {
    route_config(
        name,
        vec![vhost(
            "all",
            &["*"],
            vec![rt(prefix("/"), direct(200, body))],
        )],
    )
}

/// The chain's routes: over RDS by name, or inline.
enum Routes<'a> {
    Rds(&'a str),
    Inline(Box<RouteConfiguration>),
}

/// A TLS chain for `server_name`, presenting `leaf`.
fn chain(name: &str, server_name: &str, leaf: &Leaf, routes: Routes<'_>) -> FilterChain {
    let mut h: HttpConnectionManager = hcm(0);
    h.stat_prefix = format!("https_{name}");
    if let Routes::Inline(rc) = routes {
        h.route_specifier = Some(RouteSpecifier::RouteConfig(*rc));
    } else if let Routes::Rds(n) = routes {
        if let Some(RouteSpecifier::Rds(r)) = &mut h.route_specifier {
            r.route_config_name = n.into();
        }
    }
    FilterChain {
        name: name.into(),
        filter_chain_match: Some(FilterChainMatch {
            server_names: vec![server_name.into()],
            ..Default::default()
        }),
        transport_socket: Some(tls(leaf)),
        filters: vec![Filter {
            name: "envoy.filters.network.http_connection_manager".into(),
            config_type: Some(filter::ConfigType::TypedConfig(any(h))),
        }],
        ..Default::default()
    }
}

fn tls_listener(port: u16, chains: Vec<FilterChain>) -> Listener {
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        listener_filters: vec![ListenerFilter {
            name: "envoy.filters.listener.tls_inspector".into(),
            config_type: Some(
                envoy_types::pb::envoy::config::listener::v3::listener_filter::ConfigType::TypedConfig(
                    any(TlsInspector::default()),
                ),
            ),
            ..Default::default()
        }],
        filter_chains: chains,
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Clients

async fn tls_connect(
    pki: &Pki,
    port: u16,
    sni: &str,
    alpn: &[&str],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(pki.roots())
    .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let name = ServerName::try_from(sni.to_string()).expect("server name");
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .expect("TLS handshake")
}

/// One kept-alive HTTP/1.1 connection, read and written by hand so that what the server says
/// about the connection (`connection: close`, closing it) is seen as sent.
struct H1<S> {
    io: S,
}

impl<S: AsyncRead + AsyncWrite + Unpin> H1<S> {
    /// GET `/` for `host`; Err when the connection is closed or the answer does not come.
    async fn get(&mut self, host: &str) -> Result<RawResp, String> {
        let req = format!("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n");
        let io = async {
            self.io.write_all(req.as_bytes()).await?;
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let n = self.io.read(&mut chunk).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(r) = parse_raw_response(&buf, false) {
                    return Ok::<_, std::io::Error>(r);
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(5), io).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(format!("connection: {e}")),
            Err(_) => Err("timed out".into()),
        }
    }

    /// Whether the server closes the connection (within 5 s) without sending anything more.
    async fn closed_by_server(&mut self) -> bool {
        let mut chunk = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(5), self.io.read(&mut chunk)).await;
        matches!(r, Ok(Ok(0)) | Ok(Err(_)))
    }
}

/// GET `/` for `sni` on a fresh TLS connection: the body, or why not.
async fn fresh(pki: &Pki, port: u16, sni: &str) -> Result<String, String> {
    let mut c = H1 {
        io: tls_connect(pki, port, sni, &["http/1.1"]).await,
    };
    let r = c.get(sni).await?;
    if r.status == 200 {
        Ok(r.body_str())
    } else {
        Err(format!("status {}", r.status))
    }
}

async fn wait_fresh(pki: &Pki, port: u16, sni: &str, want: &str) {
    eventually(&format!("{sni} answers {want}"), PROPAGATION, || async {
        match fresh(pki, port, sni).await {
            Ok(b) if b == want => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

struct Setup {
    pki: Pki,
    a: Leaf,
    b: Leaf,
    mesh: Mesh,
}

impl Setup {
    /// a.example's chain as first pushed.
    fn chain_a(&self) -> FilterChain {
        chain("a", "a.example", &self.a, Routes::Rds("route-a"))
    }

    /// b.example's chain, over `routes`.
    fn chain_b(&self, routes: Routes<'_>) -> FilterChain {
        chain("b", "b.example", &self.b, routes)
    }

    /// Pushes `chains` as the listener (LDS version 2) and waits for the ACK.
    async fn push(&self, chains: Vec<FilterChain>) {
        self.push_listener(tls_listener(self.mesh.port, chains))
            .await;
    }

    async fn push_listener(&self, l: Listener) {
        self.mesh.ads.set_listeners("2", &[l]);
        self.mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    }
}

/// A listener with two TLS chains, a.example and b.example, over RDS `route-a` and `route-b`.
async fn two_chains(args: &[&str]) -> Setup {
    let pki = Pki::new("pinning CA");
    let a = pki.leaf(&["a.example"]);
    let b = pki.leaf(&["b.example"]);
    let mesh = Mesh::start_args(ads_api_type(), args, |port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![
                chain("a", "a.example", &a, Routes::Rds("route-a")),
                chain("b", "b.example", &b, Routes::Rds("route-b")),
            ],
        )],
        routes: vec![
            answering("route-a", "a"),
            answering("route-b", "b"),
            answering("route-b2", "b2"),
        ],
        ..Default::default()
    })
    .await;
    wait_fresh(&pki, mesh.port, "a.example", "a").await;
    wait_fresh(&pki, mesh.port, "b.example", "b").await;
    Setup { pki, a, b, mesh }
}

// ---------------------------------------------------------------------------------------------
// Tests

/// What istio-agent passes (with 45 s): a draining connection is told at once.
const IMMEDIATE: &[&str] = &["--drain-strategy", "immediate", "--drain-time-s", "30"];
/// The same with a drain that ends within a test's patience.
const SHORT_DRAIN: &[&str] = &["--drain-strategy", "immediate", "--drain-time-s", "2"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_keeps_its_chain_when_the_chains_are_reordered() {
    let s = two_chains(IMMEDIATE).await;
    let port = s.mesh.port;
    let mut kept = H1 {
        io: tls_connect(&s.pki, port, "a.example", &["http/1.1"]).await,
    };
    let r = kept.get("a.example").await.expect("first request");
    assert_eq!(r.body_str(), "a");

    // The chains swap places and b.example's chain changes (its routes are another table).
    s.push(vec![s.chain_b(Routes::Rds("route-b2")), s.chain_a()])
        .await;
    wait_fresh(&s.pki, port, "b.example", "b2").await;

    // The kept connection is on an unchanged chain: a.example's routes, and not drained.
    for i in 0..3 {
        let r = kept
            .get("a.example")
            .await
            .expect("request on the kept connection");
        assert_eq!(
            (r.status, r.body_str()),
            (200, "a".to_string()),
            "request {i}"
        );
        assert_ne!(
            r.header("connection"),
            Some("close"),
            "request {i}: not drained"
        );
    }
    assert_eq!(fresh(&s.pki, port, "a.example").await.as_deref(), Ok("a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_connection_whose_chain_changed_keeps_its_old_chain() {
    // Envoy's default drain: gradual over 600 s, so right after the push a response closes its
    // connection with odds near zero; what is certain is the old chain's answer.
    let s = two_chains(&[]).await;
    let port = s.mesh.port;
    let mut on_b = H1 {
        io: tls_connect(&s.pki, port, "b.example", &["http/1.1"]).await,
    };
    assert_eq!(on_b.get("b.example").await.expect("b").body_str(), "b");
    s.push(vec![
        s.chain_a(),
        s.chain_b(Routes::Inline(Box::new(answering("inline-b", "b-new")))),
    ])
    .await;
    wait_fresh(&s.pki, port, "b.example", "b-new").await;
    let r = on_b
        .get("b.example")
        .await
        .expect("request on the draining connection");
    assert_eq!((r.status, r.body_str()), (200, "b".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_connection_whose_chain_changed_drains_on_its_old_chain() {
    let s = two_chains(IMMEDIATE).await;
    let port = s.mesh.port;
    let mut on_b = H1 {
        io: tls_connect(&s.pki, port, "b.example", &["http/1.1"]).await,
    };
    let mut on_a = H1 {
        io: tls_connect(&s.pki, port, "a.example", &["http/1.1"]).await,
    };
    assert_eq!(on_b.get("b.example").await.expect("b").body_str(), "b");
    assert_eq!(on_a.get("a.example").await.expect("a").body_str(), "a");

    // b.example's chain now answers from inline routes.
    s.push(vec![
        s.chain_a(),
        s.chain_b(Routes::Inline(Box::new(answering("inline-b", "b-new")))),
    ])
    .await;
    wait_fresh(&s.pki, port, "b.example", "b-new").await;

    // The old chain answers once more, asking the client to close. (Envoy 1.40 then leaves
    // the closing to the client until the drain time is over; Portico closes after the
    // response. A client that honours `connection: close` sees no difference.)
    let r = on_b
        .get("b.example")
        .await
        .expect("request on the draining connection");
    assert_eq!((r.status, r.body_str()), (200, "b".to_string()));
    assert_eq!(r.header("connection"), Some("close"));

    // The connection on the unchanged chain is not disturbed.
    let r = on_a.get("a.example").await.expect("a after the push");
    assert_eq!(r.body_str(), "a");
    assert_ne!(r.header("connection"), Some("close"), "not drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_whose_chain_changed_gets_a_goaway() {
    let s = two_chains(IMMEDIATE).await;
    let port = s.mesh.port;
    let connect_h2 = |sni: &'static str| {
        let pki = &s.pki;
        async move {
            let io = tls_connect(pki, port, sni, &["h2"]).await;
            assert_eq!(io.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
            let (send, conn) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(io),
            )
            .await
            .expect("h2 handshake");
            (send, tokio::spawn(conn))
        }
    };
    let get = |send: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
               sni: &'static str| {
        let req = hyper::Request::get(format!("https://{sni}/"))
            .body(Empty::<Bytes>::new())
            .expect("request");
        let sent = send.send_request(req);
        async move {
            let resp = sent.await.map_err(|e| e.to_string())?;
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>(String::from_utf8_lossy(&body).into_owned())
        }
    };
    let (mut on_b, b_conn) = connect_h2("b.example").await;
    let (mut on_a, a_conn) = connect_h2("a.example").await;
    assert_eq!(get(&mut on_b, "b.example").await.as_deref(), Ok("b"));
    assert_eq!(get(&mut on_a, "a.example").await.as_deref(), Ok("a"));

    s.push(vec![s.chain_a(), s.chain_b(Routes::Rds("route-b2"))])
        .await;
    wait_fresh(&s.pki, port, "b.example", "b2").await;
    // Envoy says GOAWAY once the connection's next response is sent (its old chain answers,
    // with its routes as they were); Portico (pingora) says it as the drain starts, so the
    // client takes its next request to a new connection. Either way the server ends the
    // connection (GOAWAY, then close) by itself.
    if is_envoy(&gateway_bin()) {
        assert_eq!(get(&mut on_b, "b.example").await.as_deref(), Ok("b"));
    }
    eventually(
        "the b.example h2 connection is closed",
        PROPAGATION,
        || async {
            if b_conn.is_finished() {
                Ok(())
            } else {
                Err("still open".to_string())
            }
        },
    )
    .await;
    // The connection on the unchanged chain carries on.
    assert!(!a_conn.is_finished(), "a.example's connection is untouched");
    assert_eq!(get(&mut on_a, "a.example").await.as_deref(), Ok("a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_plaintext_connection_sees_a_route_push() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![answering(&route_name(port), "v1")],
        ..Default::default()
    })
    .await;
    let port = mesh.port;
    mesh.wait_status("/", "h", 200).await;
    let mut kept = H1 {
        io: tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect"),
    };
    assert_eq!(kept.get("h").await.expect("v1").body_str(), "v1");

    mesh.ads
        .set_routes("2", &[answering(&route_name(port), "v2")]);
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    // The same connection: routes are not the chain, so it is neither pinned nor drained.
    let kept = tokio::sync::Mutex::new(kept);
    eventually("the kept connection sees v2", PROPAGATION, || async {
        let r = kept.lock().await.get("h").await?;
        match (r.body_str().as_str(), r.header("connection")) {
            ("v2", c) if c != Some("close") => Ok(()),
            (body, c) => Err(format!("{body} connection: {c:?}")),
        }
    })
    .await;
    let r = kept.lock().await.get("h").await.expect("still open");
    assert_eq!(r.body_str(), "v2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_on_a_changed_chain_is_closed_when_the_drain_ends() {
    // The chain is changed after the connection's last request.
    let s = two_chains(SHORT_DRAIN).await;
    let port = s.mesh.port;
    let mut on_b = H1 {
        io: tls_connect(&s.pki, port, "b.example", &["http/1.1"]).await,
    };
    assert_eq!(on_b.get("b.example").await.expect("b").body_str(), "b");
    let mut on_a = H1 {
        io: tls_connect(&s.pki, port, "a.example", &["http/1.1"]).await,
    };
    assert_eq!(on_a.get("a.example").await.expect("a").body_str(), "a");
    s.push(vec![s.chain_a(), s.chain_b(Routes::Rds("route-b2"))])
        .await;
    // Nothing is said on an idle HTTP/1 connection; it is closed when the drain (2 s) ends.
    assert!(on_b.closed_by_server().await, "closed when the drain ends");
    let r = on_a.get("a.example").await.expect("a after the drain");
    assert_eq!(r.body_str(), "a");
    assert_ne!(r.header("connection"), Some("close"), "not drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_level_change_drains_every_chain_and_routes_still_reach_them() {
    let s = two_chains(IMMEDIATE).await;
    let port = s.mesh.port;
    let mut on_a = H1 {
        io: tls_connect(&s.pki, port, "a.example", &["http/1.1"]).await,
    };
    let mut on_b = H1 {
        io: tls_connect(&s.pki, port, "b.example", &["http/1.1"]).await,
    };
    assert_eq!(on_a.get("a.example").await.expect("a").body_str(), "a");
    assert_eq!(on_b.get("b.example").await.expect("b").body_str(), "b");

    // The same chains; only the listener's own config changes (its buffer limit), which
    // Envoy treats as a new listener rather than a filter-chain-only update.
    let mut l = tls_listener(port, vec![s.chain_a(), s.chain_b(Routes::Rds("route-b"))]);
    l.per_connection_buffer_limit_bytes =
        Some(envoy_types::pb::google::protobuf::UInt32Value { value: 1 << 20 });
    s.push_listener(l).await;
    // A route push while the old connections drain reaches them too.
    s.mesh.ads.set_routes(
        "2",
        &[
            answering("route-a", "a2"),
            answering("route-b", "b"),
            answering("route-b2", "b2"),
        ],
    );
    s.mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    wait_fresh(&s.pki, port, "a.example", "a2").await;

    let r = on_a
        .get("a.example")
        .await
        .expect("request on the draining connection");
    assert_eq!(
        (r.body_str(), r.header("connection")),
        ("a2".to_string(), Some("close"))
    );
    let r = on_b
        .get("b.example")
        .await
        .expect("request on the other draining connection");
    assert_eq!(
        (r.body_str(), r.header("connection")),
        ("b".to_string(), Some("close"))
    );
}
