//! Ambient HBONE origination at the gateway, in istiod's shape (PILOT_ENABLE_AMBIENT): the
//! internal listener `connect_originate` (original_dst listener filter, tcp_proxy with
//! `tunneling_config` to cluster `connect_originate`), that cluster (ORIGINAL_DST,
//! `upstream_port_override` to the pods' HBONE port, HTTP/2, Istio mTLS from SDS `default` and
//! `ROOTCA`, ALPN h2), and service clusters whose EDS endpoints are `envoy_internal_address`
//! entries with the `envoy.filters.listener.original_dst` metadata, picked by the `hbone`
//! transport socket match (`internal_upstream` passing that metadata).
//!
//! A fake ztunnel stands in for the pods' HBONE port: an mTLS HTTP/2 server accepting CONNECT
//! to `127.0.0.1:<port>`, recording each CONNECT, and splicing the stream to a real backend
//! there. Runs against Envoy too (PORTICO_GATEWAY_BIN), whose bootstrap needs the
//! `envoy.bootstrap.internal_listener` extension (added here for both).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    self as cpb, LbConfig, OriginalDstLbConfig, TransportSocketMatch,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    address, data_source, envoy_internal_address, transport_socket, Address, DataSource,
    EnvoyInternalAddress, Http2ProtocolOptions, Metadata, TransportSocket,
};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, listener, listener_filter, Filter, FilterChain, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::{
    ClusterSpecifier, TunnelingConfig,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::{
    internal_upstream_transport::MetadataValueSource, InternalUpstreamTransport,
};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    secret, CertificateValidationContext, CommonTlsContext, SdsSecretConfig, Secret,
    TlsCertificate, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::r#type::metadata::v3::{
    metadata_key::{path_segment::Segment, PathSegment},
    metadata_kind, MetadataKey, MetadataKind,
};
use envoy_types::pb::google::protobuf::{value::Kind, BoolValue, Duration as PbDuration};
use envoy_types::pb::google::protobuf::{Struct, UInt32Value, Value};
use hyper::body::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOST: &str = "hbone.example.com";
const ORIG_DST: &str = "envoy.filters.listener.original_dst";
const BAGGAGE: &str = "k8s.cluster.name=Kubernetes,service.name=gateway";

// ---------------------------------------------------------------------------------------------
// The fake ztunnel

/// One CONNECT the fake received: its `:authority`, its `baggage` header, and the TLS
/// connection (by accept order) it came on.
#[derive(Debug, Clone)]
struct Connect {
    authority: String,
    baggage: Option<String>,
    conn: usize,
}

struct Ztunnel {
    port: u16,
    connects: Arc<Mutex<Vec<Connect>>>,
    tls_conns: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Ztunnel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Ztunnel {
    fn connects(&self) -> Vec<Connect> {
        self.connects.lock().expect("lock").clone()
    }
}

/// An mTLS (client certificates from `pki` required) HTTP/2-only server. A CONNECT to
/// `127.0.0.1:<refuse>` is answered 503; any other is spliced to that address.
async fn ztunnel(pki: &Pki, refuse: u16) -> Ztunnel {
    let leaf = pki.leaf_with_uris(
        &["localhost"],
        &["spiffe://cluster.local/ns/default/sa/pod"],
    );
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_client_cert_verifier(
        rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(pki.roots()),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .expect("client verifier"),
    )
    .with_single_cert(
        vec![rustls::pki_types::CertificateDer::from(leaf.der.clone())],
        rustls::pki_types::PrivateKeyDer::Pkcs8(leaf.key_der.clone().into()),
    )
    .expect("server config");
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let connects: Arc<Mutex<Vec<Connect>>> = Arc::default();
    let tls_conns = Arc::new(AtomicUsize::new(0));
    let (seen, count) = (connects.clone(), tls_conns.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, seen, count) = (acceptor.clone(), seen.clone(), count.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
                    return;
                }
                let conn_id = count.fetch_add(1, Ordering::SeqCst) + 1;
                let Ok(mut h2) = h2::server::handshake(tls).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = h2.accept().await {
                    let seen = seen.clone();
                    tokio::spawn(serve_connect(req, respond, seen, conn_id, refuse));
                }
            });
        }
    });
    Ztunnel {
        port,
        connects,
        tls_conns,
        task,
    }
}

async fn serve_connect(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    seen: Arc<Mutex<Vec<Connect>>>,
    conn: usize,
    refuse: u16,
) {
    let status = |s: u16| http::Response::builder().status(s).body(()).expect("resp");
    if req.method() != http::Method::CONNECT {
        let _ = respond.send_response(status(405), true);
        return;
    }
    let authority = req
        .uri()
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default();
    seen.lock().expect("lock").push(Connect {
        authority: authority.clone(),
        baggage: req
            .headers()
            .get("baggage")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        conn,
    });
    let target: Option<std::net::SocketAddr> = authority.parse().ok();
    let Some(target) = target.filter(|t| t.ip().is_loopback() && t.port() != refuse) else {
        let _ = respond.send_response(status(503), true);
        return;
    };
    let Ok(tcp) = tokio::net::TcpStream::connect(target).await else {
        let _ = respond.send_response(status(503), true);
        return;
    };
    let Ok(mut send) = respond.send_response(status(200), false) else {
        return;
    };
    let mut body = req.into_body();
    let (mut tr, mut tw) = tcp.into_split();
    let up = async move {
        while let Some(Ok(d)) = body.data().await {
            let _ = body.flow_control().release_capacity(d.len());
            if tw.write_all(&d).await.is_err() {
                break;
            }
        }
        let _ = tw.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0u8; 16384];
        loop {
            match tr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if send
                        .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
        let _ = send.send_data(Bytes::new(), true);
    };
    tokio::join!(up, down);
}

// ---------------------------------------------------------------------------------------------
// istiod's xDS

fn inline(s: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(s.to_string())),
        ..Default::default()
    })
}

fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.into(),
        sds_config: Some(ads_source()),
    }
}

fn string_struct(pairs: &[(&str, &str)]) -> Struct {
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
    }
}

/// istiod's `buildConnectOriginateListener`.
fn connect_originate_listener() -> Listener {
    let tcp = TcpProxy {
        stat_prefix: "connect_originate".into(),
        cluster_specifier: Some(ClusterSpecifier::Cluster("connect_originate".into())),
        tunneling_config: Some(TunnelingConfig {
            hostname: "%DOWNSTREAM_LOCAL_ADDRESS%".into(),
            headers_to_add: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: "baggage".into(),
                    value: BAGGAGE.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    Listener {
        name: "connect_originate".into(),
        use_original_dst: Some(BoolValue { value: false }),
        listener_specifier: Some(listener::ListenerSpecifier::InternalListener(
            listener::InternalListenerConfig {},
        )),
        listener_filters: vec![ListenerFilter {
            name: ORIG_DST.into(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(any(
                OriginalDst::default(),
            ))),
            ..Default::default()
        }],
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.tcp_proxy".into(),
                config_type: Some(filter::ConfigType::TypedConfig(any(tcp))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// istiod's `buildConnectOriginate`, with the pods' HBONE port at the fake's.
fn connect_originate_cluster(hbone_port: u16) -> Cluster {
    let tls = UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds("default")],
            validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext::default()),
                    validation_context_sds_secret_config: Some(sds("ROOTCA")),
                    ..Default::default()
                },
            )),
            alpn_protocols: vec!["h2".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    let h2 = HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(Http2ProtocolOptions {
                    allow_connect: true,
                    ..Default::default()
                })),
            },
        )),
        ..Default::default()
    };
    let mut c = Cluster {
        name: "connect_originate".into(),
        cluster_discovery_type: Some(cpb::ClusterDiscoveryType::Type(
            cpb::DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: cpb::LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(PbDuration {
            seconds: 2,
            nanos: 0,
        }),
        cleanup_interval: Some(PbDuration {
            seconds: 60,
            nanos: 0,
        }),
        lb_config: Some(LbConfig::OriginalDstLbConfig(OriginalDstLbConfig {
            upstream_port_override: Some(UInt32Value {
                value: u32::from(hbone_port),
            }),
            metadata_key: Some(MetadataKey {
                key: ORIG_DST.into(),
                path: vec![PathSegment {
                    segment: Some(Segment::Key("waypoint".into())),
                }],
            }),
            ..Default::default()
        })),
        transport_socket: Some(TransportSocket {
            name: "tls".into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(any(tls))),
        }),
        ..Default::default()
    };
    c.typed_extension_protocol_options.insert(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
        any(h2),
    );
    c
}

fn raw_buffer() -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.raw_buffer".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(any(
            RawBuffer::default(),
        ))),
    }
}

/// A service cluster as `applyHBONETransportSocketMatches` leaves it (`hboneOrPlaintextSocket`).
fn service_cluster(name: &str) -> Cluster {
    let kind = |k| MetadataKind { kind: Some(k) };
    let host = || kind(metadata_kind::Kind::Host(metadata_kind::Host {}));
    let internal = InternalUpstreamTransport {
        passthrough_metadata: vec![
            MetadataValueSource {
                kind: Some(host()),
                name: ORIG_DST.into(),
            },
            MetadataValueSource {
                kind: Some(kind(metadata_kind::Kind::Cluster(
                    metadata_kind::Cluster {},
                ))),
                name: "istio".into(),
            },
            MetadataValueSource {
                kind: Some(host()),
                name: "istio".into(),
            },
        ],
        transport_socket: Some(raw_buffer()),
    };
    let mut c = eds_cluster(name);
    c.transport_socket_matches = vec![
        TransportSocketMatch {
            name: "hbone".into(),
            r#match: Some(string_struct(&[("tunnel", "http")])),
            transport_socket: Some(TransportSocket {
                name: "envoy.transport_sockets.internal_upstream".into(),
                config_type: Some(transport_socket::ConfigType::TypedConfig(any(internal))),
            }),
        },
        TransportSocketMatch {
            name: "tlsMode-disabled".into(),
            r#match: Some(Struct::default()),
            transport_socket: Some(raw_buffer()),
        },
    ];
    c
}

/// istiod's ambient endpoints: the internal address with the pod's address as its id, the
/// original destination and the `tunnel: http` socket match in the metadata.
fn hbone_endpoints(cluster: &str, pods: &[std::net::SocketAddr]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster.into(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: pods
                .iter()
                .map(|pod| {
                    let target = pod.to_string();
                    let mut meta = Metadata::default();
                    meta.filter_metadata
                        .insert(ORIG_DST.into(), string_struct(&[("local", &target)]));
                    meta.filter_metadata.insert(
                        "envoy.transport_socket_match".into(),
                        string_struct(&[("tunnel", "http")]),
                    );
                    LbEndpoint {
                        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                            address: Some(Address {
                                address: Some(address::Address::EnvoyInternalAddress(
                                    EnvoyInternalAddress {
                                        endpoint_id: target,
                                        address_name_specifier: Some(
                                            envoy_internal_address::AddressNameSpecifier::ServerListenerName(
                                                "connect_originate".into(),
                                            ),
                                        ),
                                    },
                                )),
                            }),
                            ..Default::default()
                        })),
                        metadata: Some(meta),
                        ..Default::default()
                    }
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn secrets(pki: &Pki) -> Vec<Secret> {
    let gateway = pki.leaf_with_uris(&[], &["spiffe://cluster.local/ns/default/sa/gateway"]);
    vec![
        Secret {
            name: "default".into(),
            r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
                certificate_chain: inline(&gateway.cert),
                private_key: inline(&gateway.key),
                ..Default::default()
            })),
        },
        Secret {
            name: "ROOTCA".into(),
            r#type: Some(secret::Type::ValidationContext(
                CertificateValidationContext {
                    trusted_ca: inline(&pki.ca_pem()),
                    ..Default::default()
                },
            )),
        },
    ]
}

/// The gateway bootstrap plus the extension Envoy needs for internal listeners.
fn bootstrap(admin: u16, ads: u16) -> String {
    format!(
        "{}bootstrap_extensions:\n- name: envoy.bootstrap.internal_listener\n  typed_config:\n    \"@type\": type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener\n",
        bootstrap_yaml(admin, ads)
    )
}

struct Setup {
    _ads: AdsServer,
    _gw: Gateway,
    port: u16,
    client: HttpClient,
}

impl Setup {
    async fn get(&self, path: &str) -> Resp {
        self.client
            .get(
                &format!("http://127.0.0.1:{}{path}", self.port),
                Some(HOST),
                &[],
            )
            .await
    }
}

/// Routes: `/` to `svc` (`pods`), `/refused` to `refused` (`refused_pod`, which the fake
/// ztunnel answers 503).
async fn start(
    pki: &Pki,
    zt: &Ztunnel,
    pods: &[std::net::SocketAddr],
    refused_pod: std::net::SocketAddr,
) -> Setup {
    let port = free_port();
    let snapshot = Snapshot {
        listeners: vec![l(port), connect_originate_listener()],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "h",
                &[HOST],
                vec![
                    rt(prefix("/refused"), to_cluster("refused")),
                    rt(prefix("/"), to_cluster("svc")),
                ],
            )],
        )],
        clusters: vec![
            connect_originate_cluster(zt.port),
            service_cluster("svc"),
            service_cluster("refused"),
        ],
        endpoints: vec![
            hbone_endpoints("svc", pods),
            hbone_endpoints("refused", &[refused_pod]),
        ],
        secrets: secrets(pki),
    };
    let ads = AdsServer::start_any("1", &snapshot).await;
    let ads_port = ads.port;
    let gw = Gateway::start_bootstrap(|admin| bootstrap(admin, ads_port)).await;
    Setup {
        _ads: ads,
        _gw: gw,
        port,
        client: HttpClient::new(),
    }
}

async fn wait_served(s: &Setup, path: &str) -> Resp {
    eventually(&format!("{path} served"), PROPAGATION, || async {
        let r = s.get(path).await;
        if r.status == 200 {
            Ok(r)
        } else {
            Err(format!("{} {:?} {:?}", r.status, r.body, r.error))
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_ambient_pods_through_an_hbone_tunnel() {
    let pki = Pki::new("mesh CA");
    let pod = Backend::start("pod").await;
    let refused = Backend::start("never").await;
    let zt = ztunnel(&pki, refused.addr.port()).await;
    let s = start(&pki, &zt, &[pod.addr], refused.addr).await;

    let r = wait_served(&s, "/").await;
    assert_eq!(r.backend(), Some("pod"));
    assert_eq!(r.body, "pod");
    // The CONNECT named the pod's address (%DOWNSTREAM_LOCAL_ADDRESS%, restored from the
    // endpoint's metadata) and carried headers_to_add.
    let first = zt.connects();
    let last = first.last().expect("a CONNECT");
    assert_eq!(last.authority, pod.addr.to_string());
    assert_eq!(last.baggage.as_deref(), Some(BAGGAGE));

    // Keep-alive: more requests ride the same pooled connection (one TLS connection, one
    // CONNECT stream), as Envoy pools the service cluster's connection to the internal
    // listener.
    let (conns, streams) = (zt.tls_conns.load(Ordering::SeqCst), first.len());
    for _ in 0..3 {
        let r = s.get("/").await;
        assert_eq!((r.status, r.backend()), (200, Some("pod")));
    }
    assert_eq!(
        zt.tls_conns.load(Ordering::SeqCst),
        conns,
        "TLS connections"
    );
    assert_eq!(zt.connects().len(), streams, "CONNECT streams");
    assert_eq!(refused.served(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connect_is_a_503() {
    let pki = Pki::new("mesh CA");
    let pod = Backend::start("pod").await;
    let refused = Backend::start("never").await;
    let zt = ztunnel(&pki, refused.addr.port()).await;
    let s = start(&pki, &zt, &[pod.addr], refused.addr).await;
    wait_served(&s, "/").await;

    let r = s.get("/refused").await;
    eprintln!("refused CONNECT: {} {:?} {:?}", r.status, r.body, r.headers);
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.body, REFUSED_BODY);
    assert!(zt
        .connects()
        .iter()
        .any(|c| c.authority == refused.addr.to_string()));
    assert_eq!(refused.served(), 0);
    // The gateway still serves the pod that accepts.
    let r = s.get("/").await;
    assert_eq!((r.status, r.backend()), (200, Some("pod")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_never_share_a_tunnel() {
    let pki = Pki::new("mesh CA");
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    let refused = Backend::start("never").await;
    let zt = ztunnel(&pki, refused.addr.port()).await;
    let s = start(&pki, &zt, &[a.addr, b.addr], refused.addr).await;
    wait_served(&s, "/").await;
    for _ in 0..10 {
        let r = s.get("/").await;
        assert_eq!(r.status, 200);
    }
    // Round robin reached both pods; each answer came from the pod its CONNECT named, so
    // every pooled connection carries one pod's tunnel.
    assert!(
        a.served() > 0 && b.served() > 0,
        "{} {}",
        a.served(),
        b.served()
    );
    let mut by_conn: std::collections::BTreeMap<usize, std::collections::BTreeSet<String>> =
        Default::default();
    for c in zt.connects() {
        by_conn.entry(c.conn).or_default().insert(c.authority);
    }
    eprintln!("CONNECTs by TLS connection: {by_conn:?}");
    let authorities: std::collections::BTreeSet<String> =
        by_conn.values().flatten().cloned().collect();
    assert_eq!(
        authorities,
        [a.addr.to_string(), b.addr.to_string()]
            .into_iter()
            .collect()
    );
}

/// What the client gets when the tunnel cannot be made (checked against Envoy 1.40).
const REFUSED_BODY: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: connection termination";
