//! `envoy.filters.listener.proxy_protocol`, as istiod adds it to gateway listeners when
//! `gatewayTopology.proxyProtocol` is set (behind an AWS NLB): PROXY v1 and v2 headers on plain
//! and TLS listeners, the header's source address reaching the backend in `x-forwarded-for`,
//! a malformed header or a missing one closing the connection, and
//! `allow_requests_without_proxy_protocol`. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource, TransportSocket};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, listener_filter, Filter, FilterChain, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::listener::proxy_protocol::v3::ProxyProtocol;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, HttpConnectionManager, Rds,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CommonTlsContext, DownstreamTlsContext, TlsCertificate,
};
use envoy_types::pb::google::protobuf::BoolValue;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const ROUTE: &str = "pp-route";
const CLUSTER: &str = "outbound|80||pp.default.svc.cluster.local";

fn pp_filter(allow_without: bool) -> ListenerFilter {
    ListenerFilter {
        name: "envoy.filters.listener.proxy_protocol".into(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(any(
            ProxyProtocol {
                allow_requests_without_proxy_protocol: allow_without,
                ..Default::default()
            },
        ))),
        ..Default::default()
    }
}

fn tls_inspector() -> ListenerFilter {
    ListenerFilter {
        name: "envoy.filters.listener.tls_inspector".into(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(any(
            TlsInspector::default(),
        ))),
        ..Default::default()
    }
}

/// What istiod renders for a gateway: the remote address is the client's.
fn hcm() -> HttpConnectionManager {
    let mut h = common::hcm(0);
    h.stat_prefix = "outbound_0.0.0.0_8443".into();
    h.use_remote_address = Some(BoolValue { value: true });
    h.route_specifier = Some(http_connection_manager::RouteSpecifier::Rds(Rds {
        config_source: Some(ads_source()),
        route_config_name: ROUTE.into(),
    }));
    h
}

fn listener(
    port: u16,
    filters: Vec<ListenerFilter>,
    transport_socket: Option<TransportSocket>,
) -> Listener {
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        listener_filters: filters,
        filter_chains: vec![FilterChain {
            transport_socket,
            filters: vec![Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(filter::ConfigType::TypedConfig(any(hcm()))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

struct Cert {
    pem: String,
    key: String,
    der: Vec<u8>,
}

fn cert() -> Cert {
    let key = rcgen::KeyPair::generate().expect("key");
    let c = rcgen::CertificateParams::new(vec!["gw.example.com".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    Cert {
        pem: c.pem(),
        key: key.serialize_pem(),
        der: c.der().to_vec(),
    }
}

fn tls_socket(c: &Cert) -> TransportSocket {
    let inline = |s: &str| {
        Some(DataSource {
            specifier: Some(data_source::Specifier::InlineString(s.to_string())),
            ..Default::default()
        })
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any(DownstreamTlsContext {
                    common_tls_context: Some(CommonTlsContext {
                        tls_certificates: vec![TlsCertificate {
                            certificate_chain: inline(&c.pem),
                            private_key: inline(&c.key),
                            ..Default::default()
                        }],
                        alpn_protocols: vec!["http/1.1".into()],
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            ),
        ),
    }
}

fn v1(src: &str, sport: u16) -> Vec<u8> {
    format!("PROXY TCP4 {src} 127.0.0.1 {sport} 443\r\n").into_bytes()
}

fn v2(src: [u8; 4], sport: u16) -> Vec<u8> {
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, 0x11, 0x00, 12]);
    h.extend_from_slice(&src);
    h.extend_from_slice(&[127, 0, 0, 1]);
    h.extend_from_slice(&sport.to_be_bytes());
    h.extend_from_slice(&443u16.to_be_bytes());
    h
}

/// One `connection: close` request on `s`; the whole answer, or an error when the gateway
/// closes without one.
async fn request<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) -> Result<String, String> {
    let req = "GET /pp HTTP/1.1\r\nhost: gw.example.com\r\nconnection: close\r\n\r\n";
    // A gateway that already closed (or reset) the connection answers nothing either.
    if s.write_all(req.as_bytes()).await.is_err() {
        return Err("closed".into());
    }
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    match read {
        Err(_) => Err("timed out".into()),
        // A reset after the close counts as closed too.
        Ok(Err(_)) if out.is_empty() => Err("closed".into()),
        Ok(_) if out.is_empty() => Err("closed".into()),
        Ok(_) => Ok(String::from_utf8_lossy(&out).into_owned()),
    }
}

fn header<'a>(resp: &'a str, name: &str) -> Option<&'a str> {
    resp.split("\r\n\r\n").next()?.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A plain connection that first writes `prefix` (a PROXY header, or nothing).
async fn plain(port: u16, prefix: &[u8]) -> Result<String, String> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    if tcp.write_all(prefix).await.is_err() {
        return Err("closed".into());
    }
    request(tcp).await
}

/// A TLS connection after `prefix`, trusting only `c`.
async fn tls(port: u16, prefix: &[u8], c: &Cert) -> Result<String, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(c.der.clone()))
        .map_err(|e| e.to_string())?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    tcp.write_all(prefix)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let name =
        rustls::pki_types::ServerName::try_from("gw.example.com").map_err(|e| e.to_string())?;
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp),
    )
    .await
    .map_err(|_| "handshake timed out".to_string())?
    .map_err(|e| format!("handshake: {e}"))?;
    request(s).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_protocol_v1_v2_plain_and_tls() {
    let backend = Backend::start("pp-backend").await;
    let c = cert();
    let (plain_port, tls_port, lenient_port) = (free_port(), free_port(), free_port());
    let snapshot = Snapshot {
        listeners: vec![
            listener(plain_port, vec![pp_filter(false)], None),
            // As istiod orders them: the PROXY header comes off before the TLS inspector looks.
            listener(
                tls_port,
                vec![pp_filter(false), tls_inspector()],
                Some(tls_socket(&c)),
            ),
            listener(lenient_port, vec![pp_filter(true)], None),
        ],
        routes: vec![route_config(
            ROUTE,
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), to_cluster(CLUSTER))],
            )],
        )],
        ..Default::default()
    }
    .with_backends(&[(CLUSTER, &backend)]);
    let ads = AdsServer::start_any("1", &snapshot).await;
    let mut gw = Gateway::start(ads.port).await;
    gw.wait_ready().await;

    // v1 on a plain listener: the backend sees the header's source.
    let r = eventually("v1 over plain", PROPAGATION, || async {
        plain(plain_port, &v1("192.0.2.7", 5555)).await
    })
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert_eq!(header(&r, "x-echo-xff"), Some("192.0.2.7"), "{r}");

    // v2.
    let r = plain(plain_port, &v2([198, 51, 100, 9], 4444))
        .await
        .expect("v2 over plain");
    assert_eq!(header(&r, "x-echo-xff"), Some("198.51.100.9"), "{r}");
    // v1 UNKNOWN is consumed and the request served. Portico keeps the socket's own address,
    // as the PROXY spec and Envoy's filter source say. Envoy 1.40 put 192.0.2.2 in XFF for
    // every connection whose PROXY filter kept the socket's address (UNKNOWN here, no header
    // on the lenient listener below), reproducibly, which we could not trace to its source;
    // so for Envoy the address is not compared there.
    let r = plain(plain_port, b"PROXY UNKNOWN\r\n")
        .await
        .expect("v1 UNKNOWN");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    if !is_envoy(&gateway_bin()) {
        assert_eq!(header(&r, "x-echo-xff"), Some("127.0.0.1"), "{r}");
    }

    // Before the TLS handshake.
    let r = eventually("v1 over TLS", PROPAGATION, || async {
        tls(tls_port, &v1("203.0.113.5", 6000), &c).await
    })
    .await;
    assert_eq!(header(&r, "x-echo-xff"), Some("203.0.113.5"), "{r}");
    assert_eq!(header(&r, "x-echo-xfp"), Some("https"), "{r}");
    let r = tls(tls_port, &v2([203, 0, 113, 6], 6001), &c)
        .await
        .expect("v2 over TLS");
    assert_eq!(header(&r, "x-echo-xff"), Some("203.0.113.6"), "{r}");

    // Malformed headers and missing ones close the connection without an answer.
    let before = backend.served();
    for bad in [
        &b"PROXY TCP4 not-an-ip 127.0.0.1 1 2\r\n"[..],
        b"PROXY TCP4 192.0.2.7 127.0.0.1 5555\r\n",
        b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x04abcd",
        b"",
    ] {
        assert_eq!(
            plain(plain_port, bad).await,
            Err("closed".to_string()),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    assert_eq!(
        tls(tls_port, b"", &c)
            .await
            .err()
            .map(|e| e.starts_with("handshake")),
        Some(true),
        "a TLS client without the header"
    );
    assert_eq!(backend.served(), before);

    // allow_requests_without_proxy_protocol: both kinds of client are served.
    let r = eventually("no header, allowed", PROPAGATION, || async {
        plain(lenient_port, b"").await
    })
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    if !is_envoy(&gateway_bin()) {
        assert_eq!(header(&r, "x-echo-xff"), Some("127.0.0.1"), "{r}");
    }
    let r = plain(lenient_port, &v1("192.0.2.8", 7000))
        .await
        .expect("header, allowed");
    assert_eq!(header(&r, "x-echo-xff"), Some("192.0.2.8"), "{r}");
    // A malformed header is still an error there.
    assert_eq!(
        plain(lenient_port, b"PROXY TCP9 x y 1 2\r\n").await,
        Err("closed".to_string())
    );

    // Envoy's counters for the filter, at the root scope (not the listener's), as both
    // gateways render them for Prometheus.
    let stats = reqwest::get(gw.admin_url("/stats/prometheus"))
        .await
        .expect("stats")
        .text()
        .await
        .expect("body");
    for want in [
        "envoy_downstream_cx_proxy_proto_error{} 6",
        "envoy_proxy_proto_not_found_allowed{} 1",
        "envoy_proxy_proto_not_found_disallowed{} 2",
        "envoy_proxy_proto_found{envoy_proxy_protocol_version=\"1\"} 4",
        "envoy_proxy_proto_error{envoy_proxy_protocol_version=\"1\"} 3",
        "envoy_proxy_proto_found{envoy_proxy_protocol_version=\"2\"} 2",
        "envoy_proxy_proto_error{envoy_proxy_protocol_version=\"2\"} 1",
        "envoy_proxy_proto_disallowed{envoy_proxy_protocol_version=\"2\"} 0",
    ] {
        assert!(stats.lines().any(|l| l == want), "{want} in\n{stats}");
    }
}
