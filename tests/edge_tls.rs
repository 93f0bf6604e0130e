//! Downstream TLS termination, as an Istio `Gateway` server with `tls.mode: SIMPLE` renders it:
//! filter chains picked by SNI (exact, wildcard, default), certificates inline or over SDS on
//! the ADS stream, ALPN (h2 and http/1.1), TLS version limits, rotation and warming. CA and
//! certificates are made at test time with rcgen. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource, TransportSocket};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, HttpConnectionManager, Rds,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, tls_parameters::TlsProtocol, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
    Secret, TlsCertificate, TlsParameters,
};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use rustls::pki_types::ServerName;

// ---------------------------------------------------------------------------------------------
// xDS builders

fn inline(s: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(s.to_string())),
        ..Default::default()
    })
}

fn tls_certificate(leaf: &Leaf) -> TlsCertificate {
    TlsCertificate {
        certificate_chain: inline(&leaf.cert),
        private_key: inline(&leaf.key),
        ..Default::default()
    }
}

fn transport(common: CommonTlsContext) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any(DownstreamTlsContext {
                    common_tls_context: Some(common),
                    ..Default::default()
                }),
            ),
        ),
    }
}

fn alpn(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn inline_tls(leaf: &Leaf, protocols: &[&str], params: Option<TlsParameters>) -> TransportSocket {
    transport(CommonTlsContext {
        tls_certificates: vec![tls_certificate(leaf)],
        alpn_protocols: alpn(protocols),
        tls_params: params,
        ..Default::default()
    })
}

/// What istiod sends for `credentialName`: the certificate by SDS name over ADS.
fn sds_tls(secret: &str) -> TransportSocket {
    transport(CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![SdsSecretConfig {
            name: secret.into(),
            sds_config: Some(ads_source()),
        }],
        alpn_protocols: alpn(&["h2", "http/1.1"]),
        tls_params: Some(TlsParameters {
            tls_minimum_protocol_version: TlsProtocol::TlSv12 as i32,
            tls_maximum_protocol_version: TlsProtocol::TlSv13 as i32,
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn secret(name: &str, leaf: &Leaf) -> Secret {
    Secret {
        name: name.into(),
        r#type: Some(secret::Type::TlsCertificate(tls_certificate(leaf))),
    }
}

fn hcm_for(route: &str) -> HttpConnectionManager {
    let mut h = hcm(0);
    h.stat_prefix = format!("https_{route}");
    h.route_specifier = Some(http_connection_manager::RouteSpecifier::Rds(Rds {
        config_source: Some(ads_source()),
        route_config_name: route.into(),
    }));
    h
}

fn chain(
    name: &str,
    server_names: &[&str],
    ts: Option<TransportSocket>,
    route: &str,
) -> FilterChain {
    FilterChain {
        name: name.into(),
        filter_chain_match: (!server_names.is_empty()).then(|| FilterChainMatch {
            server_names: alpn(server_names),
            ..Default::default()
        }),
        transport_socket: ts,
        filters: vec![Filter {
            name: "envoy.filters.network.http_connection_manager".into(),
            config_type: Some(filter::ConfigType::TypedConfig(any(hcm_for(route)))),
        }],
        ..Default::default()
    }
}

fn tls_listener(port: u16, chains: Vec<FilterChain>, default: Option<FilterChain>) -> Listener {
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
        default_filter_chain: default,
        ..Default::default()
    }
}

/// A route table answering every request with `body`.
fn answering(
    name: &str,
    body: &str,
) -> envoy_types::pb::envoy::config::route::v3::RouteConfiguration {
    route_config(
        name,
        vec![vhost(
            "all",
            &["*"],
            vec![rt(prefix("/"), direct(200, body))],
        )],
    )
}

// ---------------------------------------------------------------------------------------------
// A rustls client

struct TlsResp {
    status: u16,
    body: String,
    headers: http::HeaderMap,
    alpn: Option<Vec<u8>>,
    version: Option<rustls::ProtocolVersion>,
    peer_cert: Option<Vec<u8>>,
}

struct Client {
    roots: rustls::RootCertStore,
    alpn: Vec<Vec<u8>>,
    versions: Vec<&'static rustls::SupportedProtocolVersion>,
    /// A client certificate (DER) and its PKCS#8 key, for mTLS.
    cert: Option<(Vec<u8>, Vec<u8>)>,
}

impl Client {
    fn new(pki: &Pki) -> Client {
        Client {
            roots: pki.roots(),
            alpn: vec![b"http/1.1".to_vec()],
            versions: vec![&rustls::version::TLS13, &rustls::version::TLS12],
            cert: None,
        }
    }

    fn cert(mut self, leaf: &Leaf) -> Client {
        self.cert = Some((leaf.der.clone(), leaf.key_der.clone()));
        self
    }

    fn alpn(mut self, list: &[&str]) -> Client {
        self.alpn = list.iter().map(|s| s.as_bytes().to_vec()).collect();
        self
    }

    fn versions(mut self, v: &[&'static rustls::SupportedProtocolVersion]) -> Client {
        self.versions = v.to_vec();
        self
    }

    async fn connect(
        &self,
        port: u16,
        sni: &str,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&self.versions)
        .map_err(|e| e.to_string())?
        .with_root_certificates(self.roots.clone());
        let mut cfg = match &self.cert {
            Some((der, key)) => cfg
                .with_client_auth_cert(
                    vec![rustls::pki_types::CertificateDer::from(der.clone())],
                    rustls::pki_types::PrivateKeyDer::Pkcs8(
                        rustls::pki_types::PrivatePkcs8KeyDer::from(key.clone()),
                    ),
                )
                .map_err(|e| e.to_string())?,
            None => cfg.with_no_client_auth(),
        };
        cfg.alpn_protocols = self.alpn.clone();
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
        tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))
    }

    /// One GET on a fresh connection, within 5 s.
    async fn get(&self, port: u16, sni: &str, path: &str) -> Result<TlsResp, String> {
        self.get_with(port, sni, path, &[]).await
    }

    async fn get_with(
        &self,
        port: u16,
        sni: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<TlsResp, String> {
        tokio::time::timeout(
            Duration::from_secs(5),
            self.get_inner(port, sni, path, headers),
        )
        .await
        .map_err(|_| "timed out".to_string())?
    }

    async fn get_inner(
        &self,
        port: u16,
        sni: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<TlsResp, String> {
        let tls = self.connect(port, sni).await?;
        let (alpn, version, peer_cert) = {
            let c = tls.get_ref().1;
            (
                c.alpn_protocol().map(<[u8]>::to_vec),
                c.protocol_version(),
                c.peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.to_vec()),
            )
        };
        let io = hyper_util::rt::TokioIo::new(tls);
        let h2 = alpn.as_deref() == Some(b"h2");
        let mut req = hyper::Request::get(format!("https://{sni}{path}")).header("host", sni);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
        let resp = if h2 {
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                    .await
                    .map_err(|e| format!("h2 handshake: {e}"))?;
            tokio::spawn(conn);
            let mut req = req;
            req.headers_mut().remove("host");
            send.send_request(req).await.map_err(|e| e.to_string())?
        } else {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| format!("h1 handshake: {e}"))?;
            tokio::spawn(conn);
            let mut req = req;
            *req.uri_mut() = path
                .parse()
                .map_err(|e: http::uri::InvalidUri| e.to_string())?;
            send.send_request(req).await.map_err(|e| e.to_string())?
        };
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(TlsResp {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
            headers,
            alpn,
            version,
            peer_cert,
        })
    }
}

/// Waits until `sni` on `port` answers 200.
async fn wait_tls(client: &Client, port: u16, sni: &str) -> TlsResp {
    eventually(&format!("TLS {sni} on {port}"), PROPAGATION, || async {
        match client.get(port, sni, "/").await {
            Ok(r) if r.status == 200 => Ok(r),
            Ok(r) => Err(format!("status {}", r.status)),
            Err(e) => Err(e),
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_tls_by_sni_with_two_chains_and_a_default() {
    let pki = Pki::new("portico test CA");
    let a = pki.leaf(&["a.example.com"]);
    let wild = pki.leaf(&["*.example.com"]);
    let dflt = pki.leaf(&["other.test"]);
    let backend = Backend::start("tls-backend").await;
    let mesh = Mesh::start_raw(|port| {
        let mut s = Snapshot {
            listeners: vec![tls_listener(
                port,
                vec![
                    chain(
                        "a",
                        &["a.example.com"],
                        Some(inline_tls(&a, &[], None)),
                        "route-a",
                    ),
                    chain(
                        "wild",
                        &["*.example.com"],
                        Some(inline_tls(&wild, &[], None)),
                        "route-wild",
                    ),
                ],
                Some(chain(
                    "default",
                    &[],
                    Some(inline_tls(&dflt, &[], None)),
                    "route-default",
                )),
            )],
            routes: vec![
                route_config(
                    "route-a",
                    vec![vhost(
                        "all",
                        &["*"],
                        vec![rt(prefix("/"), to_cluster("tls-backend"))],
                    )],
                ),
                answering("route-wild", "chain-wild"),
                answering("route-default", "chain-default"),
            ],
            ..Default::default()
        };
        s = s.with_backends(&[("tls-backend", &backend)]);
        s
    })
    .await;
    let client = Client::new(&pki);
    let r = wait_tls(&client, mesh.port, "a.example.com").await;
    assert_eq!(r.body, "tls-backend");
    assert_eq!(r.peer_cert.as_deref(), Some(&a.der[..]));
    // The upstream learns the client came over TLS.
    assert_eq!(
        r.headers.get("x-echo-xfp").and_then(|v| v.to_str().ok()),
        Some("https")
    );
    let r = client
        .get(mesh.port, "b.example.com", "/")
        .await
        .expect("wildcard");
    assert_eq!((r.status, r.body.as_str()), (200, "chain-wild"));
    assert_eq!(r.peer_cert.as_deref(), Some(&wild.der[..]));
    // Deeper names match the wildcard too, as Envoy's suffix walk does.
    let r = client.get(mesh.port, "x.y.example.com", "/").await;
    // ...but the wildcard certificate does not cover them, so the client refuses it.
    assert!(
        r.is_err(),
        "a two-label name under *.example.com fails verification"
    );
    let r = client
        .get(mesh.port, "other.test", "/")
        .await
        .expect("default");
    assert_eq!((r.status, r.body.as_str()), (200, "chain-default"));
    assert_eq!(r.peer_cert.as_deref(), Some(&dflt.der[..]));

    // curl agrees, when it is installed.
    if let Ok(out) = curl(&pki, mesh.port, "a.example.com", &[]) {
        assert!(out.contains("tls-backend"), "curl: {out}");
    }

    // Without a default chain, a name nothing matches closes the connection.
    mesh.ads.set_listeners(
        "2",
        &[tls_listener(
            mesh.port,
            vec![chain(
                "a",
                &["a.example.com"],
                Some(inline_tls(&a, &[], None)),
                "route-a",
            )],
            None,
        )],
    );
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually("other.test is refused", PROPAGATION, || async {
        match client.get(mesh.port, "other.test", "/").await {
            Err(e) => Ok(e),
            Ok(r) => Err(format!("answered {} {}", r.status, r.body)),
        }
    })
    .await;
    let r = client
        .get(mesh.port, "a.example.com", "/")
        .await
        .expect("a");
    assert_eq!(r.body, "tls-backend");
}

fn curl(pki: &Pki, port: u16, host: &str, extra: &[&str]) -> Result<String, String> {
    let dir = TempDir::new("portico-curl");
    let ca = dir.path.join("ca.pem");
    std::fs::write(&ca, pki.ca.pem()).map_err(|e| e.to_string())?;
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(&ca)
        .arg("--resolve")
        .arg(format!("{host}:{port}:127.0.0.1"))
        .args(extra)
        .args(["-w", " http_version=%{http_version}"])
        .arg(format!("https://{host}:{port}/"))
        .output()
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_by_alpn_and_http1_otherwise() {
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["h2.example.com"]);
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "h2",
                &[],
                Some(inline_tls(&leaf, &["h2", "http/1.1"], None)),
                "route-h2",
            )],
            None,
        )],
        routes: vec![answering("route-h2", "over-tls")],
        ..Default::default()
    })
    .await;
    let h2 = Client::new(&pki).alpn(&["h2", "http/1.1"]);
    let r = wait_tls(&h2, mesh.port, "h2.example.com").await;
    assert_eq!(r.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(r.body, "over-tls");
    let h1 = Client::new(&pki).alpn(&["http/1.1"]);
    let r = h1.get(mesh.port, "h2.example.com", "/").await.expect("h1");
    assert_eq!(r.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(r.body, "over-tls");
    // A client offering nothing the listener knows still gets a handshake, without ALPN.
    let odd = Client::new(&pki).alpn(&["spdy/3"]);
    let r = odd
        .get(mesh.port, "h2.example.com", "/")
        .await
        .expect("no ALPN overlap");
    assert_eq!(r.alpn, None);
    assert_eq!(r.body, "over-tls");
    let none = Client::new(&pki).alpn(&[]);
    let r = none
        .get(mesh.port, "h2.example.com", "/")
        .await
        .expect("no ALPN");
    assert_eq!((r.alpn, r.status), (None, 200));
    if let Ok(out) = curl(&pki, mesh.port, "h2.example.com", &["--http2"]) {
        if !out.contains("not built") && !out.contains("unsupported") {
            assert!(out.contains("over-tls http_version=2"), "curl: {out}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_version_limits() {
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["v.example.com"]);
    let params = |min: TlsProtocol, max: TlsProtocol| {
        Some(TlsParameters {
            tls_minimum_protocol_version: min as i32,
            tls_maximum_protocol_version: max as i32,
            ..Default::default()
        })
    };
    let listener = |port: u16, min, max| {
        tls_listener(
            port,
            vec![chain(
                "v",
                &[],
                Some(inline_tls(&leaf, &[], params(min, max))),
                "route-v",
            )],
            None,
        )
    };
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![listener(port, TlsProtocol::TlsAuto, TlsProtocol::TlSv12)],
        routes: vec![answering("route-v", "v")],
        ..Default::default()
    })
    .await;
    let any = Client::new(&pki);
    let r = wait_tls(&any, mesh.port, "v.example.com").await;
    assert_eq!(r.version, Some(rustls::ProtocolVersion::TLSv1_2));
    let only13 = Client::new(&pki).versions(&[&rustls::version::TLS13]);
    assert!(only13.get(mesh.port, "v.example.com", "/").await.is_err());

    mesh.ads.set_listeners(
        "2",
        &[listener(
            mesh.port,
            TlsProtocol::TlSv13,
            TlsProtocol::TlsAuto,
        )],
    );
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    let r = eventually("TLS 1.3 only", PROPAGATION, || async {
        match any.get(mesh.port, "v.example.com", "/").await {
            Ok(r) if r.version == Some(rustls::ProtocolVersion::TLSv1_3) => Ok(r),
            Ok(r) => Err(format!("version {:?}", r.version)),
            Err(e) => Err(e),
        }
    })
    .await;
    assert_eq!(r.body, "v");
    let only12 = Client::new(&pki).versions(&[&rustls::version::TLS12]);
    assert!(only12.get(mesh.port, "v.example.com", "/").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sds_delivery_rotation_warming_and_a_bad_key() {
    const NAME: &str = "kubernetes://bookinfo-cert";
    let pki = Pki::new("portico test CA");
    let first = pki.leaf(&["bookinfo.example.com"]);
    let second = pki.leaf(&["bookinfo.example.com"]);
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "https",
                &["bookinfo.example.com"],
                Some(sds_tls(NAME)),
                "route-sds",
            )],
            None,
        )],
        routes: vec![answering("route-sds", "bookinfo")],
        secrets: vec![secret(NAME, &first)],
        ..Default::default()
    })
    .await;
    let client = Client::new(&pki);
    let r = wait_tls(&client, mesh.port, "bookinfo.example.com").await;
    assert_eq!(r.peer_cert.as_deref(), Some(&first.der[..]));
    assert!(mesh
        .ads
        .log()
        .iter()
        .any(|q| q.type_url == SDS && q.resource_names == [NAME.to_string()]));

    // An open connection, to outlive the rotation.
    let tls = client
        .connect(mesh.port, "bookinfo.example.com")
        .await
        .expect("connect");
    let (mut open, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .expect("h1 handshake");
    tokio::spawn(conn);
    let get = || {
        hyper::Request::get("/")
            .header("host", "bookinfo.example.com")
            .body(Empty::<Bytes>::new())
            .expect("request")
    };
    assert_eq!(
        open.send_request(get()).await.expect("before").status(),
        200
    );

    mesh.ads.set_secrets("2", &[secret(NAME, &second)]);
    mesh.ads.wait_for_ack(SDS, "2", PROPAGATION).await;
    eventually(
        "a new handshake sees the new certificate",
        PROPAGATION,
        || async {
            match client.get(mesh.port, "bookinfo.example.com", "/").await {
                Ok(r) if r.peer_cert.as_deref() == Some(&second.der[..]) => Ok(()),
                Ok(_) => Err("old certificate".to_string()),
                Err(e) => Err(e),
            }
        },
    )
    .await;
    let r = open
        .send_request(get())
        .await
        .expect("open connection survives");
    assert_eq!(r.status(), 200);

    // A bad key is rejected; the certificate in force keeps serving.
    let mut bad = secret(NAME, &second);
    if let Some(secret::Type::TlsCertificate(c)) = &mut bad.r#type {
        c.private_key =
            inline("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n");
    }
    mesh.ads.set_secrets("3", &[bad]);
    let nack = mesh.ads.wait_for_nack(SDS, PROPAGATION).await;
    let detail = nack.error.unwrap_or_default();
    eprintln!("bad key NACK: {detail}");
    if !is_envoy(&gateway_bin()) {
        assert!(detail.contains(NAME), "the NACK names the secret: {detail}");
    }
    let r = client
        .get(mesh.port, "bookinfo.example.com", "/")
        .await
        .expect("still serving");
    assert_eq!(r.peer_cert.as_deref(), Some(&second.der[..]));

    // A listener whose secret never arrives stays warming: it does not serve.
    let other = free_port();
    mesh.ads.set_listeners(
        "2",
        &[
            tls_listener(
                mesh.port,
                vec![chain(
                    "https",
                    &["bookinfo.example.com"],
                    Some(sds_tls(NAME)),
                    "route-sds",
                )],
                None,
            ),
            tls_listener(
                other,
                vec![chain(
                    "https",
                    &[],
                    Some(sds_tls("kubernetes://missing")),
                    "route-sds",
                )],
                None,
            ),
        ],
    );
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually("the missing secret is asked for", PROPAGATION, || async {
        mesh.ads
            .log()
            .iter()
            .any(|q| {
                q.type_url == SDS && q.resource_names.iter().any(|n| n == "kubernetes://missing")
            })
            .then_some(())
            .ok_or_else(|| "not subscribed".to_string())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let warming = tokio::time::timeout(
        Duration::from_secs(2),
        client.get(other, "bookinfo.example.com", "/"),
    )
    .await;
    assert!(
        !matches!(warming, Ok(Ok(_))),
        "a warming listener must not answer"
    );
    // The secret arrives: the listener serves.
    let third = pki.leaf(&["bookinfo.example.com"]);
    mesh.ads.set_secrets(
        "4",
        &[
            secret(NAME, &second),
            secret("kubernetes://missing", &third),
        ],
    );
    let r = wait_tls(&client, other, "bookinfo.example.com").await;
    assert_eq!(r.peer_cert.as_deref(), Some(&third.der[..]));
    assert_eq!(r.body, "bookinfo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_tls_inspector_server_names_never_match() {
    let pki = Pki::new("portico test CA");
    let a = pki.leaf(&["a.example.com"]);
    let dflt = pki.leaf(&["a.example.com"]);
    let mesh = Mesh::start_raw(|port| {
        let mut l = tls_listener(
            port,
            vec![chain(
                "a",
                &["a.example.com"],
                Some(inline_tls(&a, &[], None)),
                "route-a",
            )],
            Some(chain(
                "default",
                &[],
                Some(inline_tls(&dflt, &[], None)),
                "route-default",
            )),
        );
        l.listener_filters.clear();
        Snapshot {
            listeners: vec![l],
            routes: vec![
                answering("route-a", "chain-a"),
                answering("route-default", "chain-default"),
            ],
            ..Default::default()
        }
    })
    .await;
    let client = Client::new(&pki);
    // Nothing reads the SNI, so the connection has none to match on: the default chain.
    let r = wait_tls(&client, mesh.port, "a.example.com").await;
    assert_eq!(r.body, "chain-default");
    assert_eq!(r.peer_cert.as_deref(), Some(&dflt.der[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_dump_shows_secrets_with_the_key_redacted() {
    const NAME: &str = "kubernetes://dump-cert";
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["dump.example.com"]);
    let mut inline_bytes = secret(NAME, &leaf);
    if let Some(secret::Type::TlsCertificate(c)) = &mut inline_bytes.r#type {
        c.private_key = Some(DataSource {
            specifier: Some(data_source::Specifier::InlineBytes(
                leaf.key.as_bytes().to_vec(),
            )),
            ..Default::default()
        });
    }
    let https = |port| {
        tls_listener(
            port,
            vec![chain("https", &[], Some(sds_tls(NAME)), "route-d")],
            None,
        )
    };
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![https(port)],
        routes: vec![answering("route-d", "d")],
        secrets: vec![inline_bytes],
        ..Default::default()
    })
    .await;
    wait_tls(&Client::new(&pki), mesh.port, "dump.example.com").await;
    // Added once running: Envoy's start-up would wait up to 15 s for a secret that never comes.
    mesh.ads.set_listeners(
        "2",
        &[
            https(mesh.port),
            tls_listener(
                free_port(),
                vec![chain(
                    "https",
                    &[],
                    Some(sds_tls("kubernetes://never")),
                    "route-d",
                )],
                None,
            ),
        ],
    );
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually("the missing secret is asked for", PROPAGATION, || async {
        mesh.ads
            .log()
            .iter()
            .any(|q| {
                q.type_url == SDS && q.resource_names.iter().any(|n| n == "kubernetes://never")
            })
            .then_some(())
            .ok_or_else(|| "not subscribed".to_string())
    })
    .await;
    let r = mesh.gw.admin_get("/config_dump").await;
    let dump: serde_json::Value = serde_json::from_str(&r.body).expect("json");
    let secrets = dump["configs"]
        .as_array()
        .and_then(|c| {
            c.iter()
                .find(|c| c["@type"] == "type.googleapis.com/envoy.admin.v3.SecretsConfigDump")
        })
        .cloned()
        .unwrap_or_else(|| panic!("no SecretsConfigDump in {dump}"));
    let active = &secrets["dynamic_active_secrets"][0];
    assert_eq!(active["name"], NAME, "{secrets}");
    assert_eq!(active["version_info"], "1", "{secrets}");
    let tls = &active["secret"]["tls_certificate"];
    assert_eq!(
        tls["private_key"],
        serde_json::json!({ "inline_bytes": "W3JlZGFjdGVkXQ==" }),
        "{secrets}"
    );
    assert!(tls["certificate_chain"]["inline_string"]
        .as_str()
        .is_some_and(|c| c.contains("BEGIN CERTIFICATE")));
    let warming = &secrets["dynamic_warming_secrets"][0];
    assert_eq!(warming["name"], "kubernetes://never", "{secrets}");
    assert_eq!(warming["version_info"], "uninitialized", "{secrets}");
    assert_eq!(
        warming["secret"],
        serde_json::json!({
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
            "name": "kubernetes://never",
        }),
        "{secrets}"
    );
    assert!(warming["last_updated"].is_string(), "{secrets}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_cert_header_is_sanitized_unless_always_forwarded() {
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::ForwardClientCertDetails;
    let backend = Backend::start("xfcc").await;
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![rt(prefix("/"), to_cluster("xfcc"))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("xfcc", &backend)])
    })
    .await;
    const XFCC: (&str, &str) = ("x-forwarded-client-cert", "By=spiffe://a;Hash=00");
    let r = mesh.wait_status("/", "h", 200).await;
    assert_eq!(r.header("x-echo-xfcc"), None);
    let r = mesh.get("/", "h", &[XFCC]).await;
    assert_eq!(
        (r.status, r.header("x-echo-xfcc")),
        (200, None),
        "SANITIZE by default"
    );
    for (mode, kept) in [
        (ForwardClientCertDetails::SanitizeSet, false),
        (ForwardClientCertDetails::ForwardOnly, false),
        (ForwardClientCertDetails::AlwaysForwardOnly, true),
    ] {
        let mut h = hcm(mesh.port);
        h.forward_client_cert_details = mode as i32;
        let v = format!("{mode:?}");
        mesh.ads.set_listeners(&v, &[listener_with(mesh.port, h)]);
        mesh.ads.wait_for_ack(LDS, &v, PROPAGATION).await;
        eventually(&format!("{mode:?}"), PROPAGATION, || async {
            // A fresh connection each time: one kept alive may still be on the listener the
            // push replaced, which Envoy drains slowly.
            let r = get(&mesh.url("/"), Some("h"), &[XFCC]).await;
            let got = r.header("x-echo-xfcc").map(str::to_string);
            if r.status == 200 && got.is_some() == kept {
                Ok(())
            } else {
                Err(format!("{} {got:?}", r.status))
            }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiods_default_cipher_list_is_accepted() {
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["c.example.com"]);
    let suites = [
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES128-GCM-SHA256",
        "AES256-GCM-SHA384",
        "AES128-GCM-SHA256",
    ];
    let params = Some(TlsParameters {
        tls_minimum_protocol_version: TlsProtocol::TlSv12 as i32,
        tls_maximum_protocol_version: TlsProtocol::TlSv13 as i32,
        cipher_suites: suites.map(String::from).to_vec(),
        ..Default::default()
    });
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "c",
                &[],
                Some(inline_tls(&leaf, &["h2", "http/1.1"], params)),
                "route-c",
            )],
            None,
        )],
        routes: vec![answering("route-c", "c")],
        ..Default::default()
    })
    .await;
    let tls12 = Client::new(&pki).versions(&[&rustls::version::TLS12]);
    let r = wait_tls(&tls12, mesh.port, "c.example.com").await;
    assert_eq!(r.version, Some(rustls::ProtocolVersion::TLSv1_2));
    let r = Client::new(&pki)
        .get(mesh.port, "c.example.com", "/")
        .await
        .expect("1.3");
    assert_eq!(r.version, Some(rustls::ProtocolVersion::TLSv1_3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_tls_on_one_port_by_transport_protocol() {
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["t.example.com"]);
    let by_transport = |mut c: FilterChain, transport: &str| {
        c.filter_chain_match = Some(FilterChainMatch {
            transport_protocol: transport.into(),
            ..Default::default()
        });
        c
    };
    let listener = |port: u16, key: &str| {
        let bad = Leaf {
            cert: leaf.cert.clone(),
            key: key.to_string(),
            der: Vec::new(),
            key_der: Vec::new(),
        };
        tls_listener(
            port,
            vec![
                by_transport(
                    chain("tls", &[], Some(inline_tls(&bad, &[], None)), "route-tls"),
                    "tls",
                ),
                by_transport(chain("plain", &[], None, "route-plain"), "raw_buffer"),
            ],
            None,
        )
    };
    let good_key = leaf.key.clone();
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![listener(port, &good_key)],
        routes: vec![
            answering("route-tls", "secure"),
            answering("route-plain", "plain"),
        ],
        ..Default::default()
    })
    .await;
    let client = Client::new(&pki);
    let r = wait_tls(&client, mesh.port, "t.example.com").await;
    assert_eq!(r.body, "secure");
    let r = mesh.get("/", "t.example.com", &[]).await;
    assert_eq!((r.status, r.body.as_str()), (200, "plain"));

    // An inline key that does not parse: the listener update is NACKed, the old one serves.
    mesh.ads.set_listeners(
        "2",
        &[listener(
            mesh.port,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )],
    );
    let nack = mesh.ads.wait_for_nack(LDS, PROPAGATION).await;
    eprintln!("inline bad key NACK: {:?}", nack.error);
    let r = client
        .get(mesh.port, "t.example.com", "/")
        .await
        .expect("still serving");
    assert_eq!(r.body, "secure");
    let r = mesh.get("/", "t.example.com", &[]).await;
    assert_eq!(r.body, "plain");
}

// ---------------------------------------------------------------------------------------------
// Mutual TLS (Istio `tls.mode: MUTUAL`) and x-forwarded-client-cert

/// A client certificate with a three-part subject, DNS and URI SANs, signed by `pki`.
fn client_leaf(pki: &Pki, cn: &str, uri: &str) -> Leaf {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p = rcgen::CertificateParams::new(vec!["client.example".to_string()]).expect("params");
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CountryName, "US");
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, "Acme, Inc.");
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    p.subject_alt_names.push(rcgen::SanType::URI(
        rcgen::Ia5String::try_from(uri.to_string()).expect("uri"),
    ));
    let cert = p.signed_by(&key, &pki.ca, &pki.ca_key).expect("leaf");
    Leaf {
        cert: cert.pem(),
        key: key.serialize_pem(),
        der: cert.der().to_vec(),
        key_der: key.serialize_der(),
    }
}

fn sha256_hex(der: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The certificates in an XFCC `Cert="..."` / `Chain="..."` value.
fn xfcc_pem(value: &str) -> Vec<Vec<u8>> {
    let pem = value
        .replace("%0A", "\n")
        .replace("%20", " ")
        .replace("%2B", "+")
        .replace("%2F", "/")
        .replace("%3D", "=");
    assert!(!pem.contains('%'), "only these five are encoded: {value}");
    rustls_pemfile::certs(&mut pem.as_bytes())
        .map(|c| c.expect("pem").to_vec())
        .collect()
}

fn mtls_transport(ctx: DownstreamTlsContext) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any(ctx),
            ),
        ),
    }
}

fn validation(
    ca: &str,
    uri_prefix: Option<&str>,
) -> envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::CertificateValidationContext {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        subject_alt_name_matcher::SanType, CertificateValidationContext, SubjectAltNameMatcher,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
    CertificateValidationContext {
        trusted_ca: inline(ca),
        match_typed_subject_alt_names: uri_prefix
            .map(|p| SubjectAltNameMatcher {
                san_type: SanType::Uri as i32,
                matcher: Some(StringMatcher {
                    match_pattern: Some(string_matcher::MatchPattern::Prefix(p.into())),
                    ignore_case: false,
                }),
                ..Default::default()
            })
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

fn xfcc_chain(
    ts: TransportSocket,
    mode: http_connection_manager::ForwardClientCertDetails,
    details: Option<http_connection_manager::SetCurrentClientCertDetails>,
) -> FilterChain {
    let mut h = hcm_for("mtls-route");
    h.forward_client_cert_details = mode as i32;
    h.set_current_client_cert_details = details;
    FilterChain {
        name: "mtls".into(),
        transport_socket: Some(ts),
        filters: vec![Filter {
            name: "envoy.filters.network.http_connection_manager".into(),
            config_type: Some(filter::ConfigType::TypedConfig(any(h))),
        }],
        ..Default::default()
    }
}

fn to_backend(name: &str) -> envoy_types::pb::envoy::config::route::v3::RouteConfiguration {
    route_config(
        "mtls-route",
        vec![vhost(
            "all",
            &["*"],
            vec![rt(prefix("/"), to_cluster(name))],
        )],
    )
}

/// A gateway with one mTLS chain (`ctx`) whose connection manager treats XFCC by `mode`
/// and `details`, routing everything to `backend`.
async fn mtls_mesh(
    ctx: &DownstreamTlsContext,
    mode: http_connection_manager::ForwardClientCertDetails,
    details: Option<http_connection_manager::SetCurrentClientCertDetails>,
    backend: &Backend,
) -> Mesh {
    Mesh::start_raw(|port| {
        Snapshot {
            listeners: vec![tls_listener(
                port,
                vec![xfcc_chain(mtls_transport(ctx.clone()), mode, details)],
                None,
            )],
            routes: vec![to_backend(&backend.name)],
            ..Default::default()
        }
        .with_backends(&[(backend.name.as_str(), backend)])
    })
    .await
}

fn xfcc_of(r: &TlsResp) -> Option<String> {
    r.headers
        .get("x-echo-xfcc")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_checks_the_client_and_sets_its_details() {
    use http_connection_manager::{ForwardClientCertDetails, SetCurrentClientCertDetails};
    let pki = Pki::new("portico server CA");
    let clients = Pki::new("portico client CA");
    let rogue = Pki::new("rogue CA");
    let server = pki.leaf(&["mtls.example.com"]);
    let good = client_leaf(&clients, "good client", "spiffe://td/ns/good/sa/a");
    let wrong_san = client_leaf(&clients, "other", "spiffe://td/ns/bad/sa/a");
    let untrusted = client_leaf(&rogue, "rogue", "spiffe://td/ns/good/sa/a");
    let backend = Backend::start("mtls-backend").await;
    let ctx = DownstreamTlsContext {
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue { value: true }),
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&server)],
            validation_context_type: Some(
                envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType::ValidationContext(
                    validation(&clients.ca_pem(), Some("spiffe://td/ns/good/")),
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    let details = SetCurrentClientCertDetails {
        subject: Some(envoy_types::pb::google::protobuf::BoolValue { value: true }),
        cert: true,
        chain: true,
        dns: true,
        uri: true,
        issuer: true,
        ..Default::default()
    };
    let mesh = mtls_mesh(
        &ctx,
        ForwardClientCertDetails::SanitizeSet,
        Some(details),
        &backend,
    )
    .await;
    let ok = Client::new(&pki).cert(&good);
    let r = wait_tls(&ok, mesh.port, "mtls.example.com").await;
    assert_eq!(r.body, "mtls-backend");
    // The client's own XFCC is replaced by what the gateway saw.
    let r = ok
        .get_with(
            mesh.port,
            "mtls.example.com",
            "/",
            &[("x-forwarded-client-cert", "By=spiffe://forged;Hash=00")],
        )
        .await
        .expect("mTLS request");
    let xfcc = xfcc_of(&r).expect("XFCC set");
    let parts: Vec<&str> = xfcc.split(';').collect();
    assert_eq!(
        parts[0],
        format!("Hash={}", sha256_hex(&good.der)),
        "{xfcc}"
    );
    let cert = parts[1]
        .strip_prefix("Cert=\"")
        .and_then(|v| v.strip_suffix('"'))
        .expect("Cert second");
    assert_eq!(xfcc_pem(cert), vec![good.der.clone()]);
    let chain = parts[2]
        .strip_prefix("Chain=\"")
        .and_then(|v| v.strip_suffix('"'))
        .expect("Chain third");
    assert_eq!(xfcc_pem(chain), vec![good.der.clone()]);
    assert_eq!(
        &parts[3..],
        &[
            "Subject=\"CN=good client,O=Acme\\, Inc.,C=US\"",
            "URI=spiffe://td/ns/good/sa/a",
            "DNS=client.example",
            "Issuer=\"CN=portico client CA\"",
        ],
        "{xfcc}"
    );
    // Refused at the handshake: no certificate, a SAN the matcher refuses, an unknown CA.
    for (what, client) in [
        ("no certificate", Client::new(&pki)),
        ("wrong SAN", Client::new(&pki).cert(&wrong_san)),
        ("untrusted CA", Client::new(&pki).cert(&untrusted)),
    ] {
        let r = client.get(mesh.port, "mtls.example.com", "/").await;
        assert!(r.is_err(), "{what}: answered {:?}", r.map(|r| r.status));
    }
    // A refused handshake costs only that connection.
    let r = ok
        .get(mesh.port, "mtls.example.com", "/")
        .await
        .expect("still serving");
    assert_eq!(r.status, 200);
    // The listener's ssl.* stats say why each refused handshake failed, as Envoy's do.
    let addr = format!("127.0.0.1_{}", mesh.port);
    // A refused handshake is counted when the gateway ends it, which may be just after the
    // client has seen it fail.
    eventually("the refusals counted", PROPAGATION, || async {
        let prom = mesh.gw.prometheus().await;
        let addr = format!("127.0.0.1_{}", mesh.port);
        let got: f64 = [
            "envoy_listener_ssl_fail_verify_no_cert",
            "envoy_listener_ssl_fail_verify_san",
            "envoy_listener_ssl_fail_verify_error",
        ]
        .iter()
        .map(|m| prom_value(&prom, m, "envoy_listener_address", &addr))
        .sum();
        if got >= 3.0 {
            Ok(())
        } else {
            Err(format!("{got} counted"))
        }
    })
    .await;
    let prom = mesh.gw.prometheus().await;
    let stat = |name: &str| prom_value(&prom, name, "envoy_listener_address", &addr);
    for (name, want) in [
        ("envoy_listener_ssl_fail_verify_no_cert", 1.0),
        ("envoy_listener_ssl_fail_verify_san", 1.0),
        ("envoy_listener_ssl_fail_verify_error", 1.0),
        ("envoy_listener_ssl_fail_verify_cert_hash", 0.0),
        ("envoy_listener_ssl_connection_error", 0.0),
        ("envoy_listener_ssl_no_certificate", 0.0),
    ] {
        assert_eq!(stat(name), want, "{name}");
    }
    let handshakes = stat("envoy_listener_ssl_handshake");
    assert!(handshakes >= 3.0, "ssl_handshake {handshakes}");
    assert_eq!(stat("envoy_listener_ssl_versions"), handshakes);
    assert_eq!(stat("envoy_listener_ssl_ciphers"), handshakes);
    assert_eq!(stat("envoy_listener_ssl_curves"), handshakes);
    assert!(stat("envoy_listener_downstream_cx_total") >= handshakes + 3.0);
    assert_eq!(
        prom_value(
            &prom,
            "envoy_http_downstream_cx_ssl_total",
            "envoy_http_conn_manager_prefix",
            "https_mtls-route"
        ),
        handshakes + 3.0,
        "TLS connections, refused ones included"
    );
    // curl agrees, when it is installed: served with the certificate, refused without.
    let dir = TempDir::new("portico-curl-mtls");
    let (cert, key) = (dir.path.join("client.pem"), dir.path.join("client.key"));
    std::fs::write(&cert, &good.cert).expect("write cert");
    std::fs::write(&key, &good.key).expect("write key");
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    if let Ok(out) = curl(
        &pki,
        mesh.port,
        "mtls.example.com",
        &["--cert", &cert, "--key", &key],
    ) {
        assert!(
            out.contains("mtls-backend"),
            "curl with a certificate: {out}"
        );
        let out = curl(&pki, mesh.port, "mtls.example.com", &[]).unwrap_or_default();
        assert!(
            !out.contains("mtls-backend"),
            "curl without a certificate: {out}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_client_certificates_append_to_the_header() {
    use http_connection_manager::ForwardClientCertDetails;
    let pki = Pki::new("portico server CA");
    let clients = Pki::new("portico client CA");
    // The gateway's own identity, reported as By=.
    let server = pki.leaf_with_uris(&["opt.example.com"], &["spiffe://td/ns/istio-system/sa/gw"]);
    let good = client_leaf(&clients, "c", "spiffe://td/ns/good/sa/a");
    let backend = Backend::start("opt-backend").await;
    let ctx = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&server)],
            validation_context_type: Some(
                envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType::ValidationContext(
                    validation(&clients.ca_pem(), None),
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mesh = mtls_mesh(
        &ctx,
        ForwardClientCertDetails::AppendForward,
        None,
        &backend,
    )
    .await;
    const PRIOR: (&str, &str) = ("x-forwarded-client-cert", "By=spiffe://a;Hash=00");
    // Without a certificate the connection is plain TLS, and XFCC is dropped.
    let anon = Client::new(&pki);
    wait_tls(&anon, mesh.port, "opt.example.com").await;
    let r = anon
        .get_with(mesh.port, "opt.example.com", "/", &[PRIOR])
        .await
        .expect("TLS without a client certificate");
    assert_eq!((r.status, xfcc_of(&r)), (200, None));
    // With one, the gateway's element is appended to the client's.
    let r = Client::new(&pki)
        .cert(&good)
        .get_with(mesh.port, "opt.example.com", "/", &[PRIOR])
        .await
        .expect("mTLS");
    assert_eq!(
        xfcc_of(&r),
        Some(format!(
            "By=spiffe://a;Hash=00,By=spiffe://td/ns/istio-system/sa/gw;Hash={}",
            sha256_hex(&good.der)
        ))
    );
    // And without a prior header, only it.
    let r = Client::new(&pki)
        .cert(&good)
        .get(mesh.port, "opt.example.com", "/")
        .await
        .expect("mTLS");
    assert_eq!(
        xfcc_of(&r),
        Some(format!(
            "By=spiffe://td/ns/istio-system/sa/gw;Hash={}",
            sha256_hex(&good.der)
        ))
    );
    // A certificate from another CA still fails: optional does not mean unchecked.
    let r = Client::new(&pki)
        .cert(&client_leaf(&Pki::new("rogue"), "r", "spiffe://x"))
        .get(mesh.port, "opt.example.com", "/")
        .await;
    assert!(r.is_err(), "untrusted client certificate accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_mutual_over_sds_warms_and_rotates_the_ca() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::{
        CombinedCertificateValidationContext, ValidationContextType,
    };
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::CertificateValidationContext;
    use http_connection_manager::{ForwardClientCertDetails, SetCurrentClientCertDetails};
    let pki = Pki::new("portico server CA");
    let ca1 = Pki::new("client CA one");
    let ca2 = Pki::new("client CA two");
    let server = pki.leaf(&["bookinfo.example.com"]);
    let c1 = client_leaf(&ca1, "one", "spiffe://cluster.local/ns/default/sa/one");
    let c2 = client_leaf(&ca2, "two", "spiffe://cluster.local/ns/default/sa/two");
    let backend = Backend::start("mutual-backend").await;
    // What istiod renders for a MUTUAL server with credentialName bookinfo-cert.
    let ctx = DownstreamTlsContext {
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue {
            value: true,
        }),
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![SdsSecretConfig {
                name: "kubernetes://bookinfo-cert".into(),
                sds_config: Some(ads_source()),
            }],
            validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext {
                        match_typed_subject_alt_names: validation(
                            "",
                            Some("spiffe://cluster.local/"),
                        )
                        .match_typed_subject_alt_names,
                        ..Default::default()
                    }),
                    validation_context_sds_secret_config: Some(SdsSecretConfig {
                        name: "kubernetes://bookinfo-cert-cacert".into(),
                        sds_config: Some(ads_source()),
                    }),
                    ..Default::default()
                },
            )),
            alpn_protocols: alpn(&["h2", "http/1.1"]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ca_secret = |name: &str, pki: &Pki| Secret {
        name: name.into(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(&pki.ca_pem()),
                ..Default::default()
            },
        )),
    };
    let xfcc_details = SetCurrentClientCertDetails {
        subject: Some(envoy_types::pb::google::protobuf::BoolValue { value: true }),
        dns: true,
        uri: true,
        ..Default::default()
    };
    let listener = |port: u16, ctx: &DownstreamTlsContext| {
        tls_listener(
            port,
            vec![xfcc_chain(
                mtls_transport(ctx.clone()),
                ForwardClientCertDetails::SanitizeSet,
                Some(xfcc_details),
            )],
            None,
        )
    };
    let mesh = Mesh::start_raw(|port| {
        Snapshot {
            listeners: vec![listener(port, &ctx)],
            routes: vec![to_backend("mutual-backend")],
            secrets: vec![
                secret("kubernetes://bookinfo-cert", &server),
                ca_secret("kubernetes://bookinfo-cert-cacert", &ca1),
            ],
            ..Default::default()
        }
        .with_backends(&[("mutual-backend", &backend)])
    })
    .await;
    let one = Client::new(&pki).cert(&c1);
    let r = wait_tls(&one, mesh.port, "bookinfo.example.com").await;
    assert_eq!(
        xfcc_of(&r),
        Some(format!(
            "Hash={};Subject=\"CN=one,O=Acme\\, Inc.,C=US\";URI=spiffe://cluster.local/ns/default/sa/one;DNS=client.example",
            sha256_hex(&c1.der)
        ))
    );
    let two = Client::new(&pki).cert(&c2);
    assert!(two
        .get(mesh.port, "bookinfo.example.com", "/")
        .await
        .is_err());
    // A listener naming a CA secret that has not arrived warms; the old one keeps serving.
    let mut ctx2 = ctx.clone();
    if let Some(ValidationContextType::CombinedValidationContext(c)) = ctx2
        .common_tls_context
        .as_mut()
        .and_then(|c| c.validation_context_type.as_mut())
    {
        if let Some(s) = c.validation_context_sds_secret_config.as_mut() {
            s.name = "kubernetes://other-cacert".into();
        }
    }
    mesh.ads.set_listeners("2", &[listener(mesh.port, &ctx2)]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        one.get(mesh.port, "bookinfo.example.com", "/")
            .await
            .map(|r| r.status),
        Ok(200),
        "the warming listener replaced the serving one"
    );
    mesh.ads.set_secrets(
        "2",
        &[
            secret("kubernetes://bookinfo-cert", &server),
            ca_secret("kubernetes://bookinfo-cert-cacert", &ca1),
            ca_secret("kubernetes://other-cacert", &ca2),
        ],
    );
    wait_tls(&two, mesh.port, "bookinfo.example.com").await;
    assert!(one
        .get(mesh.port, "bookinfo.example.com", "/")
        .await
        .is_err());
    // A rotated CA applies to new handshakes.
    mesh.ads.set_secrets(
        "3",
        &[
            secret("kubernetes://bookinfo-cert", &server),
            ca_secret("kubernetes://other-cacert", &ca1),
        ],
    );
    wait_tls(&one, mesh.port, "bookinfo.example.com").await;
    assert!(two
        .get(mesh.port, "bookinfo.example.com", "/")
        .await
        .is_err());
    // A bad CA bundle is refused by name; the last good one keeps serving.
    mesh.ads.set_secrets(
        "4",
        &[
            secret("kubernetes://bookinfo-cert", &server),
            Secret {
                name: "kubernetes://other-cacert".into(),
                r#type: Some(secret::Type::ValidationContext(
                    CertificateValidationContext {
                        trusted_ca: inline(
                            "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
                        ),
                        ..Default::default()
                    },
                )),
            },
        ],
    );
    let nack = mesh.ads.wait_for_nack(SDS, PROPAGATION).await;
    let detail = nack.error.unwrap_or_default();
    eprintln!("bad CA NACK: {detail}");
    if !is_envoy(&gateway_bin()) {
        assert!(detail.contains("kubernetes://other-cacert"), "{detail}");
    }
    let r = one
        .get(mesh.port, "bookinfo.example.com", "/")
        .await
        .expect("last good CA");
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_certificate_without_a_validation_context() {
    let pki = Pki::new("portico server CA");
    let server = pki.leaf(&["req.example.com"]);
    let any_client = client_leaf(&Pki::new("whoever"), "w", "spiffe://w");
    let backend = Backend::start("req-backend").await;
    let ctx = DownstreamTlsContext {
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue {
            value: true,
        }),
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&server)],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mesh = mtls_mesh(
        &ctx,
        http_connection_manager::ForwardClientCertDetails::SanitizeSet,
        None,
        &backend,
    )
    .await;
    let with = Client::new(&pki).cert(&any_client);
    // With nothing to check the certificate against, Envoy does not ask for one: clients
    // with and without are served alike, and no client certificate is reported.
    let r = wait_tls(&with, mesh.port, "req.example.com").await;
    assert_eq!((r.status, xfcc_of(&r)), (200, None));
    let r = Client::new(&pki)
        .get(mesh.port, "req.example.com", "/")
        .await
        .expect("no certificate");
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_client_certificates_over_h2() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        common_tls_context::ValidationContextType, CertificateValidationContext,
    };
    let pki = Pki::new("portico server CA");
    let clients = Pki::new("portico client CA");
    let server = pki.leaf(&["pin.example.com"]);
    let pinned = client_leaf(&clients, "pinned", "spiffe://td/pinned");
    let other = client_leaf(&clients, "other", "spiffe://td/other");
    let backend = Backend::start("pin-backend").await;
    let ctx = DownstreamTlsContext {
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue {
            value: true,
        }),
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&server)],
            alpn_protocols: alpn(&["h2", "http/1.1"]),
            // A pinned hash alone: no CA, so the chain is not checked, only the pin.
            validation_context_type: Some(ValidationContextType::ValidationContext(
                CertificateValidationContext {
                    verify_certificate_hash: vec![sha256_hex(&pinned.der)],
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mesh = mtls_mesh(
        &ctx,
        http_connection_manager::ForwardClientCertDetails::SanitizeSet,
        None,
        &backend,
    )
    .await;
    let ok = Client::new(&pki).alpn(&["h2"]).cert(&pinned);
    let r = wait_tls(&ok, mesh.port, "pin.example.com").await;
    assert_eq!(r.alpn.as_deref(), Some(&b"h2"[..]));
    // The connection's certificate reaches requests on HTTP/2 streams too.
    assert_eq!(
        xfcc_of(&r),
        Some(format!("Hash={}", sha256_hex(&pinned.der)))
    );
    let r = Client::new(&pki)
        .alpn(&["h2"])
        .cert(&other)
        .get(mesh.port, "pin.example.com", "/")
        .await;
    assert!(r.is_err(), "a certificate that is not pinned was accepted");
    // A refused handshake is counted when the gateway ends it, which may be just after the
    // client has seen it fail.
    eventually("the refusals counted", PROPAGATION, || async {
        let prom = mesh.gw.prometheus().await;
        let addr = format!("127.0.0.1_{}", mesh.port);
        let got: f64 = ["envoy_listener_ssl_fail_verify_cert_hash"]
            .iter()
            .map(|m| prom_value(&prom, m, "envoy_listener_address", &addr))
            .sum();
        if got >= 1.0 {
            Ok(())
        } else {
            Err(format!("{got} counted"))
        }
    })
    .await;
    let prom = mesh.gw.prometheus().await;
    let addr = format!("127.0.0.1_{}", mesh.port);
    assert_eq!(
        prom_value(
            &prom,
            "envoy_listener_ssl_fail_verify_cert_hash",
            "envoy_listener_address",
            &addr
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ecdh_curves_limit_the_key_exchange() {
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["k.example.com"]);
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "k",
                &[],
                Some(inline_tls(
                    &leaf,
                    &[],
                    Some(TlsParameters {
                        ecdh_curves: vec!["P-384".into()],
                        ..Default::default()
                    }),
                )),
                "route-k",
            )],
            None,
        )],
        routes: vec![answering("route-k", "k")],
        ..Default::default()
    })
    .await;
    // rustls offers X25519 first; the listener takes only P-384 (a HelloRetryRequest).
    let r = wait_tls(&Client::new(&pki), mesh.port, "k.example.com").await;
    assert_eq!(r.body, "k");
    let prom = mesh.gw.prometheus().await;
    let addr = format!("127.0.0.1_{}", mesh.port);
    let p384: f64 = prom_samples(&prom, "envoy_listener_ssl_curves")
        .into_iter()
        .filter(|(l, _)| {
            l.get("envoy_listener_address") == Some(&addr)
                && l.get("envoy_ssl_curve").map(String::as_str) == Some("P-384")
        })
        .map(|(_, v)| v)
        .sum();
    assert!(p384 >= 1.0, "P-384 handshakes: {p384}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_sni_is_accepted_and_not_enforced_as_in_envoy() {
    let pki = Pki::new("portico test CA");
    // The IP SAN lets a client without SNI verify the certificate: only the SNI is missing.
    let leaf = pki.leaf(&["sni.example.com", "127.0.0.1"]);
    let ctx = DownstreamTlsContext {
        require_sni: Some(envoy_types::pb::google::protobuf::BoolValue { value: true }),
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&leaf)],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "sni",
                &[],
                Some(mtls_transport(ctx.clone())),
                "route-sni",
            )],
            None,
        )],
        routes: vec![answering("route-sni", "sni")],
        ..Default::default()
    })
    .await;
    let client = Client::new(&pki);
    assert_eq!(
        wait_tls(&client, mesh.port, "sni.example.com").await.body,
        "sni"
    );
    // Envoy 1.40 does not implement require_sni (its API hides it as not implemented).
    let r = client
        .get(mesh.port, "127.0.0.1", "/")
        .await
        .expect("served without SNI");
    assert_eq!(r.body, "sni");
}

/// The certificate a listener presents for `sni` (None: no SNI), whatever it is.
async fn presented_cert(port: u16, sni: Option<&str>) -> Result<Vec<u8>, String> {
    #[derive(Debug)]
    struct AnyCert(rustls::crypto::WebPkiSupportedAlgorithms);
    impl rustls::client::danger::ServerCertVerifier for AnyCert {
        fn verify_server_cert(
            &self,
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &[rustls::pki_types::CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: rustls::pki_types::UnixTime,
        ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &rustls::pki_types::CertificateDer<'_>,
            d: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(m, c, d, &self.0)
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &rustls::pki_types::CertificateDer<'_>,
            d: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(m, c, d, &self.0)
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.supported_schemes()
        }
    }
    let provider = rustls::crypto::ring::default_provider();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(provider.clone()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(
            provider.signature_verification_algorithms,
        )))
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    // An IP address as the name: rustls then sends no SNI.
    let name =
        ServerName::try_from(sni.unwrap_or("127.0.0.1").to_string()).map_err(|e| e.to_string())?;
    let tls = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp),
    )
    .await
    .map_err(|_| "timed out".to_string())?
    .map_err(|e| e.to_string())?;
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or_else(|| "no certificate".to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_certificates_on_one_chain_are_chosen_by_sni() {
    let pki = Pki::new("portico test CA");
    let a = pki.leaf(&["a.example.com"]);
    let b = pki.leaf(&["b.example.com", "*.wild.example.com"]);
    // What Envoy Gateway renders for a listener with two certificateRefs: one chain, both.
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "both",
                &[],
                Some(transport(CommonTlsContext {
                    tls_certificates: vec![tls_certificate(&a), tls_certificate(&b)],
                    ..Default::default()
                })),
                "route-both",
            )],
            None,
        )],
        routes: vec![answering("route-both", "both")],
        ..Default::default()
    })
    .await;
    let r = wait_tls(&Client::new(&pki), mesh.port, "b.example.com").await;
    assert_eq!(r.peer_cert.as_deref(), Some(&b.der[..]));
    for (sni, want, what) in [
        (Some("a.example.com"), &a, "exact"),
        (Some("b.example.com"), &b, "exact, second certificate"),
        (Some("x.wild.example.com"), &b, "wildcard"),
        (Some("c.example.com"), &a, "no match: the first"),
        (None, &a, "no SNI: the first"),
    ] {
        let got = presented_cert(mesh.port, sni).await.expect(what);
        assert!(got == want.der, "{what}: presented the other certificate");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateways_mutual_tls_shape_two_sds_certificates_and_a_ca() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        common_tls_context::ValidationContextType, CertificateValidationContext,
    };
    let pki = Pki::new("portico test CA");
    let clients = Pki::new("portico client CA");
    let one = pki.leaf(&["one.example.com"]);
    let two = pki.leaf(&["two.example.com"]);
    let client = client_leaf(&clients, "c", "spiffe://td/c");
    let sds = |name: &str| SdsSecretConfig {
        name: name.into(),
        sds_config: Some(ads_source()),
    };
    // mutual-tls.listeners.yaml in Envoy Gateway's goldens: secret-1, secret-2, ca-cert.
    let ctx = DownstreamTlsContext {
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue {
            value: true,
        }),
        common_tls_context: Some(CommonTlsContext {
            alpn_protocols: alpn(&["h2", "http/1.1"]),
            tls_certificate_sds_secret_configs: vec![sds("secret-1"), sds("secret-2")],
            validation_context_type: Some(ValidationContextType::ValidationContextSdsSecretConfig(
                sds("ca-cert"),
            )),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ca = Secret {
        name: "ca-cert".into(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(&clients.ca_pem()),
                ..Default::default()
            },
        )),
    };
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![tls_listener(
            port,
            vec![chain(
                "eg",
                &[],
                Some(mtls_transport(ctx.clone())),
                "route-eg",
            )],
            None,
        )],
        routes: vec![answering("route-eg", "eg")],
        secrets: vec![secret("secret-1", &one), secret("secret-2", &two), ca],
        ..Default::default()
    })
    .await;
    let c = Client::new(&pki).cert(&client);
    for (sni, leaf) in [("one.example.com", &one), ("two.example.com", &two)] {
        let r = wait_tls(&c, mesh.port, sni).await;
        assert_eq!(
            (r.body.as_str(), r.peer_cert.as_deref()),
            ("eg", Some(&leaf.der[..]))
        );
    }
    assert!(Client::new(&pki)
        .get(mesh.port, "one.example.com", "/")
        .await
        .is_err());
}

/// Two handshakes in a row with one client config (so one session cache); whether the second
/// resumed the first's session.
async fn resumes(pki: &Pki, port: u16, version: &'static rustls::SupportedProtocolVersion) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let cfg = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[version])
        .expect("versions")
        .with_root_certificates(pki.roots())
        .with_no_client_auth(),
    );
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let name = ServerName::try_from("r.example.com").expect("name");
        let mut tls = tokio_rustls::TlsConnector::from(cfg.clone())
            .connect(name, tcp)
            .await
            .expect("handshake");
        // A request and its answer, so TLS 1.3 tickets (sent after the handshake) arrive.
        tls.write_all(b"GET / HTTP/1.1\r\nhost: r.example.com\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = Vec::new();
        let _ = tls.read_to_end(&mut out).await;
        kinds.push(tls.get_ref().1.handshake_kind());
    }
    kinds[1] == Some(rustls::HandshakeKind::Resumed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_resumption_as_envoy_offers_it() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::downstream_tls_context::SessionTicketKeysType;
    let pki = Pki::new("portico test CA");
    let leaf = pki.leaf(&["r.example.com"]);
    let ctx = |stateless_off: bool, stateful_off: bool| DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&leaf)],
            ..Default::default()
        }),
        session_ticket_keys_type: stateless_off.then_some(
            SessionTicketKeysType::DisableStatelessSessionResumption(true),
        ),
        disable_stateful_session_resumption: stateful_off,
        ..Default::default()
    };
    let listener = |port: u16, c: DownstreamTlsContext| {
        tls_listener(
            port,
            vec![chain("r", &[], Some(mtls_transport(c)), "route-r")],
            None,
        )
    };
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![listener(port, ctx(false, false))],
        routes: vec![answering("route-r", "r")],
        ..Default::default()
    })
    .await;
    wait_tls(&Client::new(&pki), mesh.port, "r.example.com").await;
    let mut seen = Vec::new();
    for (i, (stateless_off, stateful_off)) in
        [(false, false), (true, false), (false, true), (true, true)]
            .into_iter()
            .enumerate()
    {
        let v = format!("r{i}");
        mesh.ads
            .set_listeners(&v, &[listener(mesh.port, ctx(stateless_off, stateful_off))]);
        mesh.ads.wait_for_ack(LDS, &v, PROPAGATION).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t13 = resumes(&pki, mesh.port, &rustls::version::TLS13).await;
        let t12 = resumes(&pki, mesh.port, &rustls::version::TLS12).await;
        seen.push((stateless_off, stateful_off, t13, t12));
    }
    // What Envoy 1.40 does: TLS 1.3 resumes by tickets only, TLS 1.2 by tickets or the cache.
    assert_eq!(
        seen,
        [
            (false, false, true, true),
            (true, false, false, true),
            (false, true, true, true),
            (true, true, false, false),
        ],
        "(stateless off, stateful off, TLS 1.3 resumed, TLS 1.2 resumed)"
    );
    let prom = mesh.gw.prometheus().await;
    let reused = prom_value(
        &prom,
        "envoy_listener_ssl_session_reused",
        "envoy_listener_address",
        &format!("127.0.0.1_{}", mesh.port),
    );
    assert!(reused >= 5.0, "ssl.session_reused {reused}");
}

/// RBAC's `requested_server_name` on an HTTPS chain reads the SNI of the connection the
/// request came on (and the access log's `%REQUESTED_SERVER_NAME%` with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_reads_the_server_name_of_the_tls_connection() {
    use envoy_types::pb::envoy::config::rbac::v3::{
        permission, principal, Permission, Policy, Principal, Rbac as Rules,
    };
    use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
        http_filter, HttpFilter,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
    let pki = Pki::new("portico test CA");
    let wild = pki.leaf(&["*.example.com"]);
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm_for("route-sni");
        let router = h.http_filters.pop().expect("router");
        let deny = Rbac {
            rules: Some(Rules {
                action: 1,
                policies: [(
                    "blocked-name".to_string(),
                    Policy {
                        permissions: vec![Permission {
                            rule: Some(permission::Rule::RequestedServerName(StringMatcher {
                                match_pattern: Some(string_matcher::MatchPattern::Exact(
                                    "blocked.example.com".into(),
                                )),
                                ..Default::default()
                            })),
                        }],
                        principals: vec![Principal {
                            identifier: Some(principal::Identifier::Any(true)),
                        }],
                        ..Default::default()
                    },
                )]
                .into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        h.http_filters = vec![
            HttpFilter {
                name: "envoy.filters.http.rbac".into(),
                config_type: Some(http_filter::ConfigType::TypedConfig(any(deny))),
                ..Default::default()
            },
            router,
        ];
        let chain = FilterChain {
            name: "wild".into(),
            transport_socket: Some(inline_tls(&wild, &[], None)),
            filters: vec![Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(filter::ConfigType::TypedConfig(any(h))),
            }],
            ..Default::default()
        };
        Snapshot {
            listeners: vec![tls_listener(port, vec![chain], None)],
            routes: vec![answering("route-sni", "served")],
            ..Default::default()
        }
    })
    .await;
    let client = Client::new(&pki);
    let r = wait_tls(&client, mesh.port, "a.example.com").await;
    assert_eq!(r.body, "served");
    let r = client
        .get(mesh.port, "blocked.example.com", "/")
        .await
        .expect("an answer");
    assert_eq!((r.status, r.body.as_str()), (403, "RBAC: access denied"));
}

/// Network RBAC in front of a chain that terminates mTLS decides once the handshake is done,
/// so an `authenticated` principal names the client certificate (as Envoy's network filters
/// see the decrypted connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_rbac_on_an_mtls_chain_reads_the_client_certificate() {
    use envoy_types::pb::envoy::config::rbac::v3::{
        permission, principal, Permission, Policy, Principal, Rbac as Rules,
    };
    use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
    use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
    use http_connection_manager::ForwardClientCertDetails;
    let pki = Pki::new("portico server CA");
    let clients = Pki::new("portico client CA");
    let server = pki.leaf(&["mtls.example.com"]);
    let good = client_leaf(&clients, "good client", "spiffe://td/ns/good/sa/a");
    let other = client_leaf(&clients, "other", "spiffe://td/ns/other/sa/b");
    let backend = Backend::start("mtls-backend").await;
    let ctx = DownstreamTlsContext {
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue { value: true }),
        common_tls_context: Some(CommonTlsContext {
            tls_certificates: vec![tls_certificate(&server)],
            validation_context_type: Some(
                envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType::ValidationContext(
                    validation(&clients.ca_pem(), None),
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    let rbac = NetworkRbac {
        stat_prefix: "tcp.".into(),
        rules: Some(Rules {
            action: 0,
            policies: [(
                "good-only".to_string(),
                Policy {
                    permissions: vec![Permission {
                        rule: Some(permission::Rule::Any(true)),
                    }],
                    principals: vec![Principal {
                        identifier: Some(principal::Identifier::Authenticated(
                            principal::Authenticated {
                                principal_name: Some(StringMatcher {
                                    match_pattern: Some(string_matcher::MatchPattern::Exact(
                                        "spiffe://td/ns/good/sa/a".into(),
                                    )),
                                    ..Default::default()
                                }),
                            },
                        )),
                    }],
                    ..Default::default()
                },
            )]
            .into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mesh = Mesh::start_raw(|port| {
        let mut chain = xfcc_chain(
            mtls_transport(ctx.clone()),
            ForwardClientCertDetails::Sanitize,
            None,
        );
        chain.filters.insert(
            0,
            Filter {
                name: "envoy.filters.network.rbac".into(),
                config_type: Some(filter::ConfigType::TypedConfig(any(rbac))),
            },
        );
        Snapshot {
            listeners: vec![tls_listener(port, vec![chain], None)],
            routes: vec![to_backend(&backend.name)],
            ..Default::default()
        }
        .with_backends(&[(backend.name.as_str(), &backend)])
    })
    .await;
    let ok = Client::new(&pki).cert(&good);
    let r = wait_tls(&ok, mesh.port, "mtls.example.com").await;
    assert_eq!(r.body, "mtls-backend");
    let r = Client::new(&pki)
        .cert(&other)
        .get(mesh.port, "mtls.example.com", "/")
        .await;
    assert!(
        r.is_err(),
        "another principal is closed: {:?}",
        r.map(|r| r.status)
    );
}
