//! Upstream TLS: a cluster's `transport_socket` with an `UpstreamTlsContext` (no validation,
//! `trusted_ca`, SAN matchers, SNI, a client certificate, ALPN h2 for HTTP/2 clusters) and
//! `transport_socket_matches` choosing TLS or plain text per endpoint by its metadata, as
//! istiod renders `tlsMode: istio`. Backends are HTTPS servers (tokio-rustls + hyper) with rcgen
//! certificates that report the SNI, the ALPN offered and negotiated, and the client certificate
//! they saw. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::convert::Infallible;
use std::sync::Arc;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::TransportSocketMatch;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    data_source, transport_socket, DataSource, Metadata, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::ValidationContextType, subject_alt_name_matcher::SanType,
    CertificateValidationContext, CommonTlsContext, SubjectAltNameMatcher, TlsCertificate,
    UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use http_body_util::Full;
use hyper::body::Bytes;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const HOST: &str = "tls.example.com";

// ---------------------------------------------------------------------------------------------
// HTTPS backends

/// An HTTPS backend answering 200 with its name in `x-backend` and what it saw of the
/// handshake: `x-sni` ("-" for none), `x-alpn-offered`, `x-alpn`, `x-client-cert`, and the
/// request's HTTP version in `x-version`, and which accepted connection served it in
/// `x-conn`.
struct TlsBackend {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn pem_chain(pem: &str) -> Vec<CertificateDer<'static>> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("chain")
}

fn pem_key(pem: &str) -> PrivateKeyDer<'static> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .expect("key")
        .expect("a key")
}

/// `client_ca`: require a client certificate signed by it.
async fn tls_backend(name: &str, leaf: &Leaf, client_ca: Option<&Pki>) -> TlsBackend {
    let builder = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions");
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(ca.roots()),
                Arc::new(rustls::crypto::ring::default_provider()),
            )
            .build()
            .expect("client verifier"),
        ),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(pem_chain(&leaf.cert), pem_key(&leaf.key))
        .expect("server config");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let config = Arc::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let name = name.to_string();
    let task = tokio::spawn(async move {
        let mut accepted = 0u32;
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            accepted += 1;
            let conn_id = accepted.to_string();
            let (config, name) = (config.clone(), name.clone());
            tokio::spawn(async move {
                let Ok(start) =
                    tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), tcp)
                        .await
                else {
                    return;
                };
                let hello = start.client_hello();
                let sni = hello.server_name().unwrap_or("-").to_string();
                let offered = hello
                    .alpn()
                    .map(|it| {
                        it.map(|p| String::from_utf8_lossy(p).into_owned())
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_else(|| "-".into());
                let Ok(tls) = start.into_stream(config).await else {
                    return;
                };
                let conn = tls.get_ref().1;
                let alpn = conn
                    .alpn_protocol()
                    .map(|p| String::from_utf8_lossy(p).into_owned())
                    .unwrap_or_else(|| "-".into());
                let client_cert = if conn.peer_certificates().is_some_and(|c| !c.is_empty()) {
                    "yes"
                } else {
                    "no"
                };
                let h2 = alpn == "h2";
                let svc = hyper::service::service_fn(move |req: hyper::Request<_>| {
                    let resp = hyper::Response::builder()
                        .status(200)
                        .header("x-backend", name.as_str())
                        .header("x-sni", sni.as_str())
                        .header("x-alpn-offered", offered.as_str())
                        .header("x-alpn", alpn.as_str())
                        .header("x-client-cert", client_cert)
                        .header("x-conn", conn_id.as_str())
                        .header("x-version", format!("{:?}", req.version()))
                        .body(Full::new(Bytes::from(name.clone())))
                        .expect("response");
                    async move { Ok::<_, Infallible>(resp) }
                });
                let io = hyper_util::rt::TokioIo::new(tls);
                if h2 {
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(io, svc)
                    .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .await;
                }
            });
        }
    });
    TlsBackend { addr, task }
}

// ---------------------------------------------------------------------------------------------
// xDS builders

fn inline(s: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(s.to_string())),
        ..Default::default()
    })
}

fn tls_socket(ctx: UpstreamTlsContext) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(any(ctx))),
    }
}

fn validation(ca: &Pki, sans: Vec<SubjectAltNameMatcher>) -> CommonTlsContext {
    CommonTlsContext {
        validation_context_type: Some(ValidationContextType::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(&ca.ca_pem()),
                match_typed_subject_alt_names: sans,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

fn san(kind: SanType, pattern: MatchPattern) -> SubjectAltNameMatcher {
    SubjectAltNameMatcher {
        san_type: kind as i32,
        matcher: Some(StringMatcher {
            match_pattern: Some(pattern),
            ignore_case: false,
        }),
        ..Default::default()
    }
}

fn upstream(sni: &str, common: CommonTlsContext) -> UpstreamTlsContext {
    UpstreamTlsContext {
        sni: sni.into(),
        common_tls_context: Some(common),
        ..Default::default()
    }
}

fn http2(c: &mut Cluster) {
    let opts = HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(Default::default())),
            },
        )),
        ..Default::default()
    };
    c.typed_extension_protocol_options.insert(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
        any(opts),
    );
}

/// One route to cluster "up", whose endpoints are `la`.
fn snapshot(port: u16, cluster: Cluster, la: ClusterLoadAssignment) -> Snapshot {
    Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost("h", &[HOST], vec![rt(prefix("/"), to_cluster("up"))])],
        )],
        clusters: vec![cluster],
        endpoints: vec![la],
        ..Default::default()
    }
}

async fn start(ctx: UpstreamTlsContext, backend: &TlsBackend, h2: bool) -> Mesh {
    let addr = backend.addr;
    Mesh::start(move |port| {
        let mut c = eds_cluster("up");
        c.transport_socket = Some(tls_socket(ctx));
        if h2 {
            http2(&mut c);
        }
        snapshot(port, c, cla("up", &[addr]))
    })
    .await
}

/// Envoy's local reply for a failed handshake (its words, as checked against Envoy 1.40: no
/// TLS detail).
const TLS_FAILED: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";

async fn served(mesh: &Mesh) -> Resp {
    mesh.wait_backend("/", HOST, &[], "b").await;
    mesh.get("/", HOST, &[]).await
}

async fn refused(mesh: &Mesh) -> Resp {
    let r = mesh.wait_status("/", HOST, 503).await;
    assert_eq!(r.body, TLS_FAILED);
    r
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn without_a_validation_context_any_certificate_is_accepted_and_no_sni_sent() {
    let rogue = Pki::new("rogue CA");
    let backend = tls_backend(
        "b",
        &rogue.leaf_with_uris(&["elsewhere.example"], &[]),
        None,
    )
    .await;
    let mesh = start(UpstreamTlsContext::default(), &backend, false).await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-sni"), Some("-"), "{r:?}");
    assert_eq!(r.header("x-client-cert"), Some("no"));
    assert_eq!(r.header("x-version"), Some("HTTP/1.1"));
}

#[tokio::test]
async fn trusted_ca_checks_the_chain_but_not_the_hostname() {
    let pki = Pki::new("test CA");
    // The certificate names neither the SNI nor the address.
    let backend = tls_backend("b", &pki.leaf_with_uris(&["unrelated.example"], &[]), None).await;
    let mesh = start(
        upstream("backend.example", validation(&pki, vec![])),
        &backend,
        false,
    )
    .await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-sni"), Some("backend.example"));
}

#[tokio::test]
async fn connections_are_reused_but_never_across_tls_settings() {
    let pki = Pki::new("test CA");
    let rogue = Pki::new("rogue CA");
    let backend = tls_backend("b", &rogue.leaf_with_uris(&["b.svc.example"], &[]), None).await;
    let addr = backend.addr;
    // Two clusters on the same address: one accepts any certificate, one trusts another CA.
    let mesh = Mesh::start(move |port| {
        let mut open = eds_cluster("open");
        open.transport_socket = Some(tls_socket(upstream("b.svc.example", Default::default())));
        let mut strict = eds_cluster("strict");
        strict.transport_socket = Some(tls_socket(upstream(
            "b.svc.example",
            validation(&pki, vec![]),
        )));
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "h",
                    &[HOST],
                    vec![
                        rt(prefix("/strict"), to_cluster("strict")),
                        rt(prefix("/"), to_cluster("open")),
                    ],
                )],
            )],
            clusters: vec![open, strict],
            endpoints: vec![cla("open", &[addr]), cla("strict", &[addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "b").await;
    let client = HttpClient::new();
    let url = mesh.url("/");
    let first = client.get(&url, Some(HOST), &[]).await;
    let second = client.get(&url, Some(HOST), &[]).await;
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(first.header("x-conn"), second.header("x-conn"), "reused");
    // Many requests, one connection.
    for _ in 0..20 {
        let r = client.get(&url, Some(HOST), &[]).await;
        assert_eq!(r.header("x-conn"), first.header("x-conn"));
    }
    let r = client.get(&mesh.url("/strict"), Some(HOST), &[]).await;
    assert_eq!((r.status, r.body.as_str()), (503, TLS_FAILED));
}

#[tokio::test]
async fn trusted_ca_and_client_certificate_from_files() {
    let pki = Pki::new("test CA");
    let backend = tls_backend(
        "b",
        &pki.leaf_with_uris(&["b.svc.example"], &[]),
        Some(&pki),
    )
    .await;
    let dir = TempDir::new("upstream-tls");
    let client = pki.leaf_with_uris(&["gateway.example"], &[]);
    let write = |name: &str, text: &str| {
        let path = dir.path.join(name);
        std::fs::write(&path, text).expect("write");
        Some(DataSource {
            specifier: Some(data_source::Specifier::Filename(
                path.to_string_lossy().into_owned(),
            )),
            ..Default::default()
        })
    };
    let common = CommonTlsContext {
        tls_certificates: vec![TlsCertificate {
            certificate_chain: write("cert.pem", &client.cert),
            private_key: write("key.pem", &client.key),
            ..Default::default()
        }],
        validation_context_type: Some(ValidationContextType::ValidationContext(
            CertificateValidationContext {
                trusted_ca: write("ca.pem", &pki.ca_pem()),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let mesh = start(upstream("b.svc.example", common), &backend, false).await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-client-cert"), Some("yes"));
}

#[tokio::test]
async fn an_untrusted_certificate_fails_the_connection() {
    let pki = Pki::new("test CA");
    let rogue = Pki::new("rogue CA");
    let backend = tls_backend("b", &rogue.leaf_with_uris(&["backend.example"], &[]), None).await;
    let mesh = start(
        upstream("backend.example", validation(&pki, vec![])),
        &backend,
        false,
    )
    .await;
    refused(&mesh).await;
}

#[tokio::test]
async fn san_matchers_check_the_certificate_sans() {
    let pki = Pki::new("test CA");
    let leaf = pki.leaf_with_uris(
        &["*.svc.example"],
        &["spiffe://cluster.local/ns/default/sa/b"],
    );
    let backend = tls_backend("b", &leaf, None).await;
    // A wildcard DNS SAN covers an exact name one label down; the SNI plays no part.
    let mesh = start(
        upstream(
            "not-in-the-cert.example",
            validation(
                &pki,
                vec![san(
                    SanType::Dns,
                    MatchPattern::Exact("api.svc.example".into()),
                )],
            ),
        ),
        &backend,
        false,
    )
    .await;
    served(&mesh).await;
    drop(mesh);
    let mesh = start(
        upstream(
            "",
            validation(
                &pki,
                vec![san(
                    SanType::Uri,
                    MatchPattern::Prefix("spiffe://cluster.local/ns/default/".into()),
                )],
            ),
        ),
        &backend,
        false,
    )
    .await;
    served(&mesh).await;
}

#[tokio::test]
async fn a_san_mismatch_fails_the_connection() {
    let pki = Pki::new("test CA");
    let leaf = pki.leaf_with_uris(
        &["b.svc.example"],
        &["spiffe://cluster.local/ns/default/sa/b"],
    );
    let backend = tls_backend("b", &leaf, None).await;
    let mesh = start(
        upstream(
            // The SNI names the certificate; the matchers decide.
            "b.svc.example",
            validation(
                &pki,
                vec![
                    san(
                        SanType::Dns,
                        MatchPattern::Exact("other.svc.example".into()),
                    ),
                    // The URI SAN does not count for a DNS matcher.
                    san(
                        SanType::Dns,
                        MatchPattern::Exact("spiffe://cluster.local/ns/default/sa/b".into()),
                    ),
                ],
            ),
        ),
        &backend,
        false,
    )
    .await;
    refused(&mesh).await;
}

#[tokio::test]
async fn the_deprecated_san_list_matches_any_san_type() {
    let pki = Pki::new("test CA");
    let leaf = pki.leaf_with_uris(
        &["b.svc.example"],
        &["spiffe://cluster.local/ns/default/sa/b"],
    );
    let backend = tls_backend("b", &leaf, None).await;
    let mut common = validation(&pki, vec![]);
    if let Some(ValidationContextType::ValidationContext(v)) = &mut common.validation_context_type {
        #[allow(deprecated)]
        v.match_subject_alt_names.push(StringMatcher {
            match_pattern: Some(MatchPattern::Exact(
                "spiffe://cluster.local/ns/default/sa/b".into(),
            )),
            ignore_case: false,
        });
    }
    let mesh = start(upstream("", common), &backend, false).await;
    served(&mesh).await;
}

#[tokio::test]
async fn a_client_certificate_is_presented_when_configured() {
    let pki = Pki::new("test CA");
    let backend = tls_backend(
        "b",
        &pki.leaf_with_uris(&["b.svc.example"], &[]),
        Some(&pki),
    )
    .await;
    // Without one, the backend refuses the handshake.
    let mesh = start(
        upstream("b.svc.example", validation(&pki, vec![])),
        &backend,
        false,
    )
    .await;
    refused(&mesh).await;
    drop(mesh);
    let client = pki.leaf_with_uris(&["gateway.example"], &[]);
    let mut common = validation(&pki, vec![]);
    common.tls_certificates = vec![TlsCertificate {
        certificate_chain: inline(&client.cert),
        private_key: inline(&client.key),
        ..Default::default()
    }];
    let mesh = start(upstream("b.svc.example", common), &backend, false).await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-client-cert"), Some("yes"));
}

#[tokio::test]
async fn alpn_h2_carries_an_http2_cluster() {
    let pki = Pki::new("test CA");
    let backend = tls_backend("b", &pki.leaf_with_uris(&["b.svc.example"], &[]), None).await;
    let mut common = validation(&pki, vec![]);
    common.alpn_protocols = vec!["h2".into()];
    let mesh = start(upstream("b.svc.example", common), &backend, true).await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-alpn-offered"), Some("h2"));
    assert_eq!(r.header("x-alpn"), Some("h2"));
    assert_eq!(r.header("x-version"), Some("HTTP/2.0"));
    // Later requests are streams on the same TLS connection.
    for _ in 0..10 {
        let again = mesh.get("/", HOST, &[]).await;
        assert_eq!(again.header("x-conn"), r.header("x-conn"));
    }
}

#[tokio::test]
async fn without_alpn_protocols_what_the_cluster_speaks_is_offered() {
    let pki = Pki::new("test CA");
    let backend = tls_backend("b", &pki.leaf_with_uris(&["b.svc.example"], &[]), None).await;
    let mesh = start(
        upstream("b.svc.example", validation(&pki, vec![])),
        &backend,
        false,
    )
    .await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-alpn-offered"), Some("http/1.1"));
    assert_eq!(r.header("x-version"), Some("HTTP/1.1"));
    drop(mesh);
    let mesh = start(
        upstream("b.svc.example", validation(&pki, vec![])),
        &backend,
        true,
    )
    .await;
    let r = served(&mesh).await;
    assert_eq!(r.header("x-alpn-offered"), Some("h2"));
    assert_eq!(r.header("x-version"), Some("HTTP/2.0"));
}

fn metadata(pairs: &[(&str, &str)]) -> Metadata {
    let mut m = Metadata::default();
    m.filter_metadata.insert(
        "envoy.transport_socket_match".into(),
        Struct {
            fields: pairs
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Value {
                            kind: Some(Kind::StringValue(v.to_string())),
                        },
                    )
                })
                .collect(),
        },
    );
    m
}

#[tokio::test]
async fn transport_socket_matches_pick_tls_per_endpoint() {
    let pki = Pki::new("test CA");
    let secure = tls_backend("b", &pki.leaf_with_uris(&["b.svc.example"], &[]), None).await;
    let plain = Backend::start("plain").await;
    let (secure_addr, plain_addr) = (secure.addr, plain.addr);
    let mesh = Mesh::start(move |port| {
        let mut c = eds_cluster("up");
        // istiod's shape: TLS for `tlsMode: istio` endpoints, plain text for the rest.
        c.transport_socket_matches = vec![
            TransportSocketMatch {
                name: "tlsMode-istio".into(),
                r#match: metadata(&[("tlsMode", "istio")])
                    .filter_metadata
                    .remove("envoy.transport_socket_match"),
                transport_socket: Some(tls_socket(upstream(
                    "b.svc.example",
                    validation(&pki, vec![]),
                ))),
            },
            TransportSocketMatch {
                name: "tlsMode-disabled".into(),
                r#match: Some(Struct::default()),
                transport_socket: Some(TransportSocket {
                    name: "envoy.transport_sockets.raw_buffer".into(),
                    config_type: Some(transport_socket::ConfigType::TypedConfig(any(
                        RawBuffer::default(),
                    ))),
                }),
            },
        ];
        let mut la = cla("up", &[secure_addr, plain_addr]);
        la.endpoints[0].lb_endpoints[0].metadata = Some(metadata(&[("tlsMode", "istio")]));
        snapshot(port, c, la)
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "b").await;
    mesh.wait_backend("/", HOST, &[], "plain").await;
    for _ in 0..6 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(r.status, 200, "{r:?}");
        if r.backend() == Some("b") {
            assert_eq!(r.header("x-sni"), Some("b.svc.example"));
        }
    }
}
