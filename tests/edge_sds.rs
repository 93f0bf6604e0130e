//! SDS secrets from a named SDS cluster, as istio-agent serves them to Envoy: the bootstrap's
//! static `sds-grpc` cluster (a unix socket or a TCP address, HTTP/2) carries a state-of-the-
//! world `StreamSecrets` stream; listeners and clusters name secrets with Istio's
//! `sds_config: {api_config_source: {api_type: GRPC, envoy_grpc: {cluster_name: sds-grpc}}}`.
//! Downstream certificates, and upstream ISTIO_MUTUAL (`default` + `ROOTCA`, a spiffe SAN
//! matcher) to an mTLS backend: warming, rotation, a bad secret NACKed on the SDS stream while
//! the last good one serves, `/config_dump`. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::TransportSocketMatch;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    api_config_source::ApiType, config_source, data_source, grpc_service, transport_socket,
    ApiConfigSource, ApiVersion, ConfigSource, DataSource, GrpcService, Metadata, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, Rds,
};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    secret,
    tls_parameters::TlsProtocol,
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, Secret,
    TlsCertificate, TlsParameters, UpstreamTlsContext,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

const HOST: &str = "reviews.example.com";
const REVIEWS: &str = "spiffe://cluster.local/ns/default/sa/reviews";
const GATEWAY: &str = "spiffe://cluster.local/ns/istio-system/sa/gateway";
const GATEWAY_V2: &str = "spiffe://cluster.local/ns/istio-system/sa/gateway-v2";

// ---------------------------------------------------------------------------------------------
// An in-process SDS server (state of the world), on TCP or a unix socket

#[derive(Default)]
struct SdsShared {
    log: Mutex<Vec<LoggedRequest>>,
    streams: Mutex<usize>,
}

/// Bumped to make the server end every open stream (the gateway then reconnects).
type Kick = watch::Sender<u64>;

/// The secrets served (version, by name), and every request the gateway sent.
struct SdsServer {
    at: SdsAt,
    shared: Arc<SdsShared>,
    state: watch::Sender<(String, BTreeMap<String, Secret>)>,
    kick: Kick,
    task: tokio::task::JoinHandle<()>,
    _dir: TempDir,
}

enum SdsAt {
    Tcp(u16),
    Unix(PathBuf),
}

#[derive(Clone)]
struct SdsService {
    shared: Arc<SdsShared>,
    state: watch::Receiver<(String, BTreeMap<String, Secret>)>,
    kick: watch::Receiver<u64>,
}

#[tonic::async_trait]
impl SecretDiscoveryService for SdsService {
    type DeltaSecretsStream = ReceiverStream<Result<DeltaDiscoveryResponse, tonic::Status>>;
    type StreamSecretsStream = ReceiverStream<Result<DiscoveryResponse, tonic::Status>>;

    /// Incremental: each stream is sent the subscribed secrets it does not have at their
    /// current version (what it has: what was sent on it, or its `initial_resource_versions`).
    async fn delta_secrets(
        &self,
        request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<Self::DeltaSecretsStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let shared = self.shared.clone();
        let mut state = self.state.clone();
        let mut kick = self.kick.clone();
        kick.borrow_and_update();
        if let Ok(mut n) = shared.streams.lock() {
            *n += 1;
        }
        tokio::spawn(async move {
            let mut subscribed = std::collections::BTreeSet::new();
            let mut has: BTreeMap<String, String> = BTreeMap::new();
            let mut sent_versions: BTreeMap<String, String> = BTreeMap::new();
            let mut nonce = 0u64;
            loop {
                tokio::select! {
                    r = inbound.message() => match r {
                        Ok(Some(q)) => {
                            shared.log.lock().expect("log").push(LoggedRequest {
                                node_id: q.node.as_ref().map(|n| n.id.clone()),
                                node_cluster: q.node.as_ref().map(|n| n.cluster.clone()),
                                type_url: q.type_url.clone(),
                                version_info: sent_versions
                                    .get(&q.response_nonce)
                                    .cloned()
                                    .unwrap_or_default(),
                                response_nonce: q.response_nonce.clone(),
                                resource_names: q.resource_names_subscribe.clone(),
                                unsubscribe: q.resource_names_unsubscribe.clone(),
                                initial_versions: q
                                    .initial_resource_versions
                                    .clone()
                                    .into_iter()
                                    .collect(),
                                error: q.error_detail.as_ref().map(|e| e.message.clone()),
                                delta: true,
                            });
                            has.extend(q.initial_resource_versions);
                            subscribed.extend(q.resource_names_subscribe);
                            for n in &q.resource_names_unsubscribe {
                                subscribed.remove(n);
                                has.remove(n);
                            }
                        }
                        _ => return,
                    },
                    c = state.changed() => {
                        if c.is_err() {
                            return;
                        }
                    }
                    _ = kick.changed() => return,
                }
                let (version, secrets) = state.borrow_and_update().clone();
                let resources: Vec<_> = subscribed
                    .iter()
                    .filter_map(|n| secrets.get(n))
                    .filter(|s| has.get(&s.name) != Some(&version))
                    .map(
                        |s| envoy_types::pb::envoy::service::discovery::v3::Resource {
                            name: s.name.clone(),
                            version: version.clone(),
                            resource: Some(any(s.clone())),
                            ..Default::default()
                        },
                    )
                    .collect();
                if resources.is_empty() {
                    continue;
                }
                for r in &resources {
                    has.insert(r.name.clone(), version.clone());
                }
                nonce += 1;
                sent_versions.insert(nonce.to_string(), version.clone());
                let resp = DeltaDiscoveryResponse {
                    system_version_info: version,
                    resources,
                    type_url: SDS.into(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }

    async fn fetch_secrets(
        &self,
        _request: tonic::Request<DiscoveryRequest>,
    ) -> Result<tonic::Response<DiscoveryResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fetch"))
    }

    /// Answers each stream with the secrets it subscribed to, when they change or the
    /// subscription does (never on an ACK or NACK alone).
    async fn stream_secrets(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<Self::StreamSecretsStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let shared = self.shared.clone();
        let mut state = self.state.clone();
        if let Ok(mut n) = shared.streams.lock() {
            *n += 1;
        }
        tokio::spawn(async move {
            let mut names: Vec<String> = Vec::new();
            let mut due = false;
            let mut nonce = 0u64;
            loop {
                tokio::select! {
                    r = inbound.message() => match r {
                        Ok(Some(q)) => {
                            shared.log.lock().expect("log").push(LoggedRequest {
                                node_id: q.node.as_ref().map(|n| n.id.clone()),
                                node_cluster: q.node.as_ref().map(|n| n.cluster.clone()),
                                type_url: q.type_url.clone(),
                                version_info: q.version_info.clone(),
                                response_nonce: q.response_nonce.clone(),
                                resource_names: q.resource_names.clone(),
                                error: q.error_detail.as_ref().map(|e| e.message.clone()),
                                ..Default::default()
                            });
                            if q.resource_names != names {
                                names = q.resource_names;
                                due = true;
                            }
                        }
                        _ => return,
                    },
                    c = state.changed() => {
                        if c.is_err() {
                            return;
                        }
                        due = true;
                    }
                }
                if !due {
                    continue;
                }
                let (version, secrets) = state.borrow_and_update().clone();
                let resources: Vec<_> = names
                    .iter()
                    .filter_map(|n| secrets.get(n))
                    .map(|s| any(s.clone()))
                    .collect();
                if resources.is_empty() {
                    continue;
                }
                due = false;
                nonce += 1;
                let resp = DiscoveryResponse {
                    version_info: version,
                    resources,
                    type_url: SDS.into(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

impl SdsServer {
    async fn start(unix: bool) -> SdsServer {
        let dir = TempDir::new("portico-sds");
        let (state, rx) = watch::channel((String::new(), BTreeMap::new()));
        let (kick, kicked) = watch::channel(0);
        let shared = Arc::new(SdsShared::default());
        let svc = SecretDiscoveryServiceServer::new(SdsService {
            shared: shared.clone(),
            state: rx,
            kick: kicked,
        });
        let router = tonic::transport::Server::builder().add_service(svc);
        let (at, task) = if unix {
            let path = dir.path.join("sds.sock");
            let listener = tokio::net::UnixListener::bind(&path).expect("bind unix socket");
            let incoming = futures::stream::unfold(listener, |l| async move {
                let conn = l.accept().await.map(|(s, _)| s);
                Some((conn, l))
            });
            let task = tokio::spawn(async move {
                if let Err(e) = router.serve_with_incoming(incoming).await {
                    eprintln!("sds: server error: {e}");
                }
            });
            (SdsAt::Unix(path), task)
        } else {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let port = listener.local_addr().expect("addr").port();
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            let task = tokio::spawn(async move {
                if let Err(e) = router.serve_with_incoming(incoming).await {
                    eprintln!("sds: server error: {e}");
                }
            });
            (SdsAt::Tcp(port), task)
        };
        SdsServer {
            at,
            shared,
            state,
            kick,
            task,
            _dir: dir,
        }
    }

    /// Serves `secrets` (and only them) at `version`.
    fn set(&self, version: &str, secrets: &[Secret]) {
        let map = secrets
            .iter()
            .map(|s| (s.name.clone(), s.clone()))
            .collect();
        self.state.send_replace((version.to_string(), map));
    }

    /// Ends every open stream; the gateway reconnects.
    fn kick(&self) {
        self.kick.send_modify(|n| *n += 1);
    }

    fn streams(&self) -> usize {
        *self.shared.streams.lock().expect("streams")
    }

    fn log(&self) -> Vec<LoggedRequest> {
        self.shared.log.lock().expect("log").clone()
    }

    /// The bootstrap's static `sds-grpc` cluster pointing here, HTTP/2 as istio-agent's.
    fn cluster_yaml(&self) -> String {
        let address = match &self.at {
            SdsAt::Tcp(port) => {
                format!("socket_address: {{ address: 127.0.0.1, port_value: {port} }}")
            }
            SdsAt::Unix(path) => format!("pipe: {{ path: \"{}\" }}", path.display()),
        };
        format!(
            r#"  - name: sds-grpc
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: sds-grpc
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              {address}
"#
        )
    }

    async fn wait_for_ack(&self, version: &str) {
        eventually(&format!("SDS ACK of {version}"), PROPAGATION, || async {
            self.log()
                .iter()
                .any(|r| {
                    r.version_info == version && !r.response_nonce.is_empty() && r.error.is_none()
                })
                .then_some(())
                .ok_or_else(|| format!("{:?}", self.log().last()))
        })
        .await
    }

    async fn wait_for_nack(&self) -> LoggedRequest {
        eventually("an SDS NACK", PROPAGATION, || async {
            self.log()
                .into_iter()
                .find(|r| r.error.is_some())
                .ok_or_else(|| format!("{:?}", self.log().last()))
        })
        .await
    }
}

impl Drop for SdsServer {
    fn drop(&mut self) {
        self.task.abort();
        if std::thread::panicking() {
            eprintln!("---- SDS requests (last 12):");
            let log = self.log();
            for r in log.iter().rev().take(12).rev() {
                eprintln!(
                    "  names={:?} version={:?} nonce={:?} node={:?} error={:?}",
                    r.resource_names, r.version_info, r.response_nonce, r.node_id, r.error
                );
            }
        }
    }
}

/// The ADS server and the gateway, whose bootstrap also has `sds`'s `sds-grpc` cluster.
async fn start(sds: &SdsServer, build: impl FnOnce(u16) -> Snapshot) -> Mesh {
    let port = free_port();
    let ads = AdsServer::start_any("1", &build(port)).await;
    let cluster = sds.cluster_yaml();
    let gw = Gateway::start_bootstrap(|admin| bootstrap_yaml(admin, ads.port) + &cluster).await;
    Mesh {
        ads,
        gw,
        port,
        client: HttpClient::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// xDS builders

fn inline(s: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(s.to_string())),
        ..Default::default()
    })
}

/// Istio's `sds-grpc` config source; `initial_fetch_timeout` 0s (istiod's) waits for ever.
fn sds_grpc(cluster: &str, initial_fetch_timeout: Duration) -> ConfigSource {
    sds_source(cluster, initial_fetch_timeout, ApiType::Grpc)
}

fn sds_source(cluster: &str, initial_fetch_timeout: Duration, api_type: ApiType) -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::ApiConfigSource(
            ApiConfigSource {
                api_type: api_type as i32,
                transport_api_version: ApiVersion::V3 as i32,
                set_node_on_first_message_only: true,
                grpc_services: vec![GrpcService {
                    target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                        grpc_service::EnvoyGrpc {
                            cluster_name: cluster.into(),
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                }],
                ..Default::default()
            },
        )),
        initial_fetch_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: initial_fetch_timeout.as_secs() as i64,
            nanos: 0,
        }),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn sds_config(name: &str, source: ConfigSource) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.into(),
        sds_config: Some(source),
    }
}

fn cert_secret(name: &str, leaf: &Leaf) -> Secret {
    Secret {
        name: name.into(),
        r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(&leaf.cert),
            private_key: inline(&leaf.key),
            ..Default::default()
        })),
    }
}

/// istio-agent's `ROOTCA`: the mesh CA as a validation context.
fn root_secret(pki: &Pki) -> Secret {
    Secret {
        name: "ROOTCA".into(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(&pki.ca_pem()),
                ..Default::default()
            },
        )),
    }
}

fn tls_socket<M: prost::Message + prost::Name>(ctx: M) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(any(ctx))),
    }
}

/// A TLS listener whose certificate is secret `name` from sds-grpc, answering with `body`.
fn https_listener(port: u16, name: &str, body_route: &str) -> Listener {
    https_listener_api(port, name, body_route, ApiType::Grpc)
}

fn https_listener_api(port: u16, name: &str, body_route: &str, api: ApiType) -> Listener {
    let mut h = hcm(port);
    h.stat_prefix = "https".into();
    h.route_specifier = Some(http_connection_manager::RouteSpecifier::Rds(Rds {
        config_source: Some(ads_source()),
        route_config_name: body_route.into(),
    }));
    let ctx = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds_config(
                name,
                sds_source("sds-grpc", Duration::from_secs(1), api),
            )],
            alpn_protocols: vec!["http/1.1".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        filter_chains: vec![FilterChain {
            transport_socket: Some(tls_socket(ctx)),
            filters: vec![Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(filter::ConfigType::TypedConfig(any(h))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// istiod's ISTIO_MUTUAL socket: `default` and `ROOTCA` from sds-grpc, the peer's spiffe
/// identity as a (deprecated, as istiod writes it) SAN matcher, Istio's ALPN and SNI.
fn istio_mutual(san: &str, sds_cluster: &str) -> UpstreamTlsContext {
    #[allow(deprecated)]
    let default = CertificateValidationContext {
        match_subject_alt_names: vec![StringMatcher {
            match_pattern: Some(MatchPattern::Exact(san.into())),
            ignore_case: false,
        }],
        ..Default::default()
    };
    let source = sds_grpc(sds_cluster, Duration::ZERO);
    UpstreamTlsContext {
        sni: "outbound_.9080_._.reviews.default.svc.cluster.local".into(),
        common_tls_context: Some(CommonTlsContext {
            tls_params: Some(TlsParameters {
                tls_minimum_protocol_version: TlsProtocol::TlSv12 as i32,
                tls_maximum_protocol_version: TlsProtocol::TlSv13 as i32,
                ..Default::default()
            }),
            alpn_protocols: vec!["istio-peer-exchange".into(), "istio".into()],
            tls_certificate_sds_secret_configs: vec![sds_config("default", source.clone())],
            validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                CombinedCertificateValidationContext {
                    default_validation_context: Some(default),
                    validation_context_sds_secret_config: Some(sds_config("ROOTCA", source)),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn label(k: &str, v: &str) -> Struct {
    Struct {
        fields: [(
            k.to_string(),
            Value {
                kind: Some(Kind::StringValue(v.into())),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// An EDS cluster as istiod renders one for a sidecar'd service: tlsMode-istio endpoints get
/// the ISTIO_MUTUAL socket, the others plain text.
fn mesh_cluster(name: &str, ctx: UpstreamTlsContext) -> Cluster {
    let mut c = eds_cluster(name);
    c.transport_socket_matches = vec![
        TransportSocketMatch {
            name: "tlsMode-istio".into(),
            r#match: Some(label("tlsMode", "istio")),
            transport_socket: Some(tls_socket(ctx)),
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
    c
}

/// Endpoints with Istio's `tlsMode: istio` match metadata.
fn istio_endpoints(cluster: &str, addr: std::net::SocketAddr) -> ClusterLoadAssignment {
    let mut metadata = Metadata::default();
    metadata.filter_metadata.insert(
        "envoy.transport_socket_match".into(),
        label("tlsMode", "istio"),
    );
    ClusterLoadAssignment {
        cluster_name: cluster.into(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: vec![LbEndpoint {
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(socket_addr("127.0.0.1", addr.port())),
                    ..Default::default()
                })),
                metadata: Some(metadata),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------------------------
// An mTLS backend (a sidecar'd pod): requires a client certificate from the mesh CA, reports
// the client's URI SAN, the SNI and the ALPN offered, and closes each connection after one
// response, so every request is a new handshake (and a rotated client certificate shows).

struct MtlsBackend {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MtlsBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn uri_sans(der: &[u8]) -> String {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return "-".into();
    };
    let Ok(Some(ext)) = cert.subject_alternative_name() else {
        return "-".into();
    };
    ext.value
        .general_names
        .iter()
        .filter_map(|g| match g {
            GeneralName::URI(u) => Some(u.to_string()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(",")
}

async fn mtls_backend(name: &str, leaf: &Leaf, mesh: &Pki) -> MtlsBackend {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(mesh.roots()),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .expect("client verifier");
    let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut leaf.cert.as_bytes())
        .collect::<Result<_, _>>()
        .expect("chain");
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut leaf.key.as_bytes())
        .expect("key")
        .expect("a key");
    // No ALPN list: Istio's "istio-peer-exchange"/"istio" are offered and ignored.
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .expect("server config"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let name = name.to_string();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
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
                let client = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| uri_sans(c))
                    .unwrap_or_else(|| "-".into());
                let svc = hyper::service::service_fn(move |_req: hyper::Request<_>| {
                    let resp = hyper::Response::builder()
                        .status(200)
                        .header("x-backend", name.as_str())
                        .header("x-sni", sni.as_str())
                        .header("x-alpn-offered", offered.as_str())
                        .header("x-client-uri", client.as_str())
                        .header("connection", "close")
                        .body(Full::new(Bytes::from(name.clone())))
                        .expect("response");
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(false)
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    MtlsBackend { addr, task }
}

// ---------------------------------------------------------------------------------------------
// A TLS client for the downstream listener

/// One GET on a fresh TLS connection: (status, body, the server's certificate).
async fn tls_get(pki: &Pki, port: u16, sni: &str) -> Result<(u16, String, Vec<u8>), String> {
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(pki.roots())
    .with_no_client_auth();
    let run = async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .unwrap_or_default();
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| format!("h1 handshake: {e}"))?;
        tokio::spawn(conn);
        let req = hyper::Request::get("/")
            .header("host", sni)
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned(), cert))
    };
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .map_err(|_| "timed out".to_string())?
}

async fn config_dump_secrets(mesh: &Mesh) -> serde_json::Value {
    let r = mesh.gw.admin_get("/config_dump").await;
    let dump: serde_json::Value = serde_json::from_str(&r.body).expect("json");
    dump["configs"]
        .as_array()
        .and_then(|c| {
            c.iter()
                .find(|c| c["@type"] == "type.googleapis.com/envoy.admin.v3.SecretsConfigDump")
        })
        .cloned()
        .unwrap_or_else(|| panic!("no SecretsConfigDump in {dump}"))
}

fn named<'a>(list: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    list.as_array()?.iter().find(|s| s["name"] == name)
}

// ---------------------------------------------------------------------------------------------
// Tests

/// (a) A downstream certificate from sds-grpc on a unix socket: start-up waits no longer than
/// the source's `initial_fetch_timeout` (1 s here), the listener serves once the secret
/// arrives, and a rotation applies to new handshakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_certificate_from_the_sds_cluster_serves_once_it_arrives_and_rotates() {
    const NAME: &str = "kubernetes://gateway-cert";
    let pki = Pki::new("gateway CA");
    let first = pki.leaf(&["gw.example.com"]);
    let second = pki.leaf(&["gw.example.com"]);
    let sds = SdsServer::start(true).await;
    let mesh = start(&sds, |port| Snapshot {
        listeners: vec![https_listener(port, NAME, "route-gw")],
        routes: vec![route_config(
            "route-gw",
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), direct(200, "gw"))],
            )],
        )],
        ..Default::default()
    })
    .await;
    // Ready although the secret has not come: its fetch timed out.
    eventually("the secret is asked for", PROPAGATION, || async {
        sds.log()
            .iter()
            .any(|r| r.resource_names == [NAME.to_string()])
            .then_some(())
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    let log = sds.log();
    assert_eq!(log[0].type_url, SDS);
    assert_eq!(log[0].node_id.as_deref(), Some(NODE_ID), "the node, first");
    assert!(
        log.iter().skip(1).all(|r| r.node_id.is_none()),
        "set_node_on_first_message_only"
    );
    assert!(
        tls_get(&pki, mesh.port, "gw.example.com").await.is_err(),
        "no certificate yet: no TLS"
    );

    sds.set("1", &[cert_secret(NAME, &first)]);
    sds.wait_for_ack("1").await;
    let (status, body, cert) = eventually("serving", PROPAGATION, || async {
        tls_get(&pki, mesh.port, "gw.example.com").await
    })
    .await;
    assert_eq!((status, body.as_str()), (200, "gw"));
    assert_eq!(cert, first.der);

    sds.set("2", &[cert_secret(NAME, &second)]);
    sds.wait_for_ack("2").await;
    eventually(
        "a new handshake sees the new certificate",
        PROPAGATION,
        || async {
            match tls_get(&pki, mesh.port, "gw.example.com").await {
                Ok((_, _, c)) if c == second.der => Ok(()),
                Ok(_) => Err("old certificate".to_string()),
                Err(e) => Err(e),
            }
        },
    )
    .await;

    let secrets = config_dump_secrets(&mesh).await;
    let active = named(&secrets["dynamic_active_secrets"], NAME)
        .unwrap_or_else(|| panic!("{NAME} in {secrets}"));
    assert_eq!(active["version_info"], "2", "{secrets}");
    assert_eq!(
        active["secret"]["tls_certificate"]["private_key"],
        serde_json::json!({ "inline_string": "[redacted]" }),
        "{secrets}"
    );
}

/// The same source over `DELTA_GRPC` (incremental SDS): the secret is subscribed to by name,
/// served and rotated; a reconnect names what the gateway has (`initial_resource_versions`) so
/// nothing is sent again; a bad certificate is NACKed and the last good one keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_certificate_over_delta_sds() {
    const NAME: &str = "kubernetes://gateway-cert";
    let pki = Pki::new("gateway CA");
    let first = pki.leaf(&["gw.example.com"]);
    let second = pki.leaf(&["gw.example.com"]);
    let sds = SdsServer::start(true).await;
    sds.set("1", &[cert_secret(NAME, &first)]);
    let mesh = start(&sds, |port| Snapshot {
        listeners: vec![https_listener_api(
            port,
            NAME,
            "route-gw",
            ApiType::DeltaGrpc,
        )],
        routes: vec![route_config(
            "route-gw",
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), direct(200, "gw"))],
            )],
        )],
        ..Default::default()
    })
    .await;
    sds.wait_for_ack("1").await;
    let log = sds.log();
    assert!(log[0].delta, "a DeltaSecrets stream");
    assert_eq!(log[0].type_url, SDS);
    assert_eq!(log[0].resource_names, [NAME.to_string()], "{:?}", log[0]);
    assert!(
        log[0].initial_versions.is_empty(),
        "a first stream has nothing"
    );
    assert_eq!(log[0].node_id.as_deref(), Some(NODE_ID), "the node, first");
    let (status, body, cert) = eventually("serving", PROPAGATION, || async {
        tls_get(&pki, mesh.port, "gw.example.com").await
    })
    .await;
    assert_eq!((status, body.as_str()), (200, "gw"));
    assert_eq!(cert, first.der);

    sds.set("2", &[cert_secret(NAME, &second)]);
    sds.wait_for_ack("2").await;
    let serves = |want: Vec<u8>| {
        let pki = &pki;
        async move {
            match tls_get(pki, mesh.port, "gw.example.com").await {
                Ok((_, _, c)) if c == want => Ok(()),
                Ok(_) => Err("another certificate".to_string()),
                Err(e) => Err(e),
            }
        }
    };
    eventually("the rotated certificate", PROPAGATION, || {
        serves(second.der.clone())
    })
    .await;

    // A reconnect names the version held; the server has nothing newer to send.
    let before = sds.log().len();
    sds.kick();
    let again = eventually("a second stream", PROPAGATION, || async {
        sds.log()
            .into_iter()
            .skip(before)
            .find(|r| r.response_nonce.is_empty())
            .ok_or_else(|| format!("streams: {}", sds.streams()))
    })
    .await;
    assert_eq!(
        again.initial_versions,
        BTreeMap::from([(NAME.to_string(), "2".to_string())]),
        "{again:?}"
    );
    assert_eq!(again.resource_names, [NAME.to_string()]);
    serves(second.der.clone()).await.expect("still serving");

    // A bad certificate: NACKed, the rotated one keeps serving.
    let mut bad = cert_secret(NAME, &first);
    if let Some(secret::Type::TlsCertificate(c)) = &mut bad.r#type {
        c.certificate_chain = inline("not a certificate");
    }
    sds.set("3", &[bad]);
    let nack = sds.wait_for_nack().await;
    assert_eq!(nack.version_info, "3", "the NACK answers version 3's nonce");
    assert!(nack.delta);
    serves(second.der.clone())
        .await
        .expect("the last good certificate");
}

/// (b, c, d) Istio's ISTIO_MUTUAL upstream from sds-grpc over TCP: the cluster reaches an
/// mTLS pod whose certificate has the spiffe identity the SAN matcher names, and fails with
/// another; a rotated `default` is the client certificate of new connections; a bad
/// `default` is NACKed on the SDS stream while the last good one keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_mutual_upstream_with_secrets_from_the_sds_cluster() {
    let mesh_ca = Pki::new("cluster.local");
    let backend = mtls_backend(
        "reviews",
        &mesh_ca.leaf_with_uris(&[], &[REVIEWS]),
        &mesh_ca,
    )
    .await;
    let sds = SdsServer::start(false).await;
    let gateway = mesh_ca.leaf_with_uris(&[], &[GATEWAY]);
    sds.set(
        "1",
        &[cert_secret("default", &gateway), root_secret(&mesh_ca)],
    );
    let addr = backend.addr;
    let snapshot = move |port: u16| Snapshot {
        listeners: vec![l(port)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "h",
                &[HOST],
                vec![
                    rt(prefix("/wrong"), to_cluster("wrong")),
                    rt(prefix("/"), to_cluster("reviews")),
                ],
            )],
        )],
        clusters: vec![
            mesh_cluster("reviews", istio_mutual(REVIEWS, "sds-grpc")),
            mesh_cluster(
                "wrong",
                istio_mutual("spiffe://cluster.local/ns/default/sa/ratings", "sds-grpc"),
            ),
        ],
        endpoints: vec![
            istio_endpoints("reviews", addr),
            istio_endpoints("wrong", addr),
        ],
        ..Default::default()
    };
    let mesh = start(&sds, snapshot).await;
    mesh.wait_backend("/", HOST, &[], "reviews").await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.header("x-client-uri"), Some(GATEWAY), "{r:?}");
    assert_eq!(
        r.header("x-sni"),
        Some("outbound_.9080_._.reviews.default.svc.cluster.local")
    );
    assert_eq!(
        r.header("x-alpn-offered"),
        Some("istio-peer-exchange,istio")
    );
    // The pod's identity is not the one the other cluster expects.
    mesh.wait_status("/wrong", HOST, 503).await;
    assert_eq!(backend_count(&mesh, "/", "reviews").await, 3);

    // (c) A rotated certificate is what new connections present.
    let rotated = mesh_ca.leaf_with_uris(&[], &[GATEWAY_V2]);
    sds.set(
        "2",
        &[cert_secret("default", &rotated), root_secret(&mesh_ca)],
    );
    sds.wait_for_ack("2").await;
    eventually(
        "new connections use the rotated certificate",
        PROPAGATION,
        || async {
            let r = mesh.get("/", HOST, &[]).await;
            (r.header("x-client-uri") == Some(GATEWAY_V2))
                .then_some(())
                .ok_or(format!("{} {:?}", r.status, r.header("x-client-uri")))
        },
    )
    .await;

    // (d) A bad key is NACKed on the SDS stream; the rotated certificate keeps serving.
    let mut bad = cert_secret("default", &rotated);
    if let Some(secret::Type::TlsCertificate(c)) = &mut bad.r#type {
        c.private_key =
            inline("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n");
    }
    sds.set("3", &[bad, root_secret(&mesh_ca)]);
    let nack = sds.wait_for_nack().await;
    let detail = nack.error.unwrap_or_default();
    eprintln!("bad secret NACK: {detail}");
    assert_eq!(
        nack.version_info, "2",
        "the NACK carries the last good version"
    );
    if !is_envoy(&gateway_bin()) {
        assert!(
            detail.contains("secret 'default'"),
            "names the secret: {detail}"
        );
    }
    for _ in 0..3 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.header("x-client-uri"), Some(GATEWAY_V2));
    }

    // /config_dump: the SDS cluster's secrets, keys redacted, and a secret nobody serves as
    // warming.
    let mut clusters = snapshot(mesh.port).clusters;
    let mut pending = istio_mutual(REVIEWS, "sds-grpc");
    if let Some(c) = &mut pending.common_tls_context {
        c.tls_certificate_sds_secret_configs[0].name = "spiffe-pending".into();
    }
    clusters.push(mesh_cluster("pending", pending));
    // Envoy asks for a cluster's secrets once its endpoints are in (its pre-init).
    mesh.ads.set_endpoints(
        "2",
        &[
            istio_endpoints("reviews", addr),
            istio_endpoints("wrong", addr),
            istio_endpoints("pending", addr),
        ],
    );
    mesh.ads.set_clusters("2", &clusters);
    eventually("the pending secret is asked for", PROPAGATION, || async {
        sds.log()
            .iter()
            .any(|r| r.resource_names.iter().any(|n| n == "spiffe-pending"))
            .then_some(())
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    let secrets = config_dump_secrets(&mesh).await;
    let default = named(&secrets["dynamic_active_secrets"], "default")
        .unwrap_or_else(|| panic!("default in {secrets}"));
    assert_eq!(
        default["secret"]["tls_certificate"]["private_key"],
        serde_json::json!({ "inline_string": "[redacted]" }),
        "{secrets}"
    );
    assert!(
        named(&secrets["dynamic_active_secrets"], "ROOTCA").is_some(),
        "{secrets}"
    );
    let warming = named(&secrets["dynamic_warming_secrets"], "spiffe-pending")
        .unwrap_or_else(|| panic!("spiffe-pending warming in {secrets}"));
    assert_eq!(warming["version_info"], "uninitialized", "{secrets}");
    // The other clusters keep serving.
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
}

async fn backend_count(mesh: &Mesh, path: &str, name: &str) -> usize {
    let mut n = 0;
    for _ in 0..3 {
        if mesh.get(path, HOST, &[]).await.backend() == Some(name) {
            n += 1;
        }
    }
    n
}

/// An SDS config naming a cluster the bootstrap does not have: Portico refuses the resource
/// naming it (a NACK). Envoy 1.40 accepts it and keeps the cluster warming for ever, with no
/// NACK and nothing logged at warning level; the test records that difference. Either way the
/// clusters in force keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sds_cluster_missing_from_the_bootstrap() {
    let mesh_ca = Pki::new("cluster.local");
    let backend = mtls_backend(
        "reviews",
        &mesh_ca.leaf_with_uris(&[], &[REVIEWS]),
        &mesh_ca,
    )
    .await;
    let sds = SdsServer::start(false).await;
    sds.set(
        "1",
        &[
            cert_secret("default", &mesh_ca.leaf_with_uris(&[], &[GATEWAY])),
            root_secret(&mesh_ca),
        ],
    );
    let addr = backend.addr;
    let mesh = start(&sds, move |port| Snapshot {
        listeners: vec![l(port)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "h",
                &[HOST],
                vec![rt(prefix("/"), to_cluster("reviews"))],
            )],
        )],
        clusters: vec![mesh_cluster("reviews", istio_mutual(REVIEWS, "sds-grpc"))],
        endpoints: vec![istio_endpoints("reviews", addr)],
        ..Default::default()
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews").await;
    mesh.ads.set_clusters(
        "2",
        &[
            mesh_cluster("reviews", istio_mutual(REVIEWS, "sds-grpc")),
            mesh_cluster("elsewhere", istio_mutual(REVIEWS, "no-such-sds")),
        ],
    );
    mesh.ads.set_endpoints(
        "2",
        &[
            istio_endpoints("reviews", addr),
            istio_endpoints("elsewhere", addr),
        ],
    );
    if is_envoy(&gateway_bin()) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            !mesh.ads.log().iter().any(|r| r.is_nack()),
            "Envoy does not NACK it"
        );
        let dump = mesh.gw.admin_get("/config_dump").await;
        let dump: serde_json::Value = serde_json::from_str(&dump.body).expect("json");
        let warming = dump["configs"]
            .as_array()
            .and_then(|c| {
                c.iter().find(|c| {
                    c["@type"]
                        .as_str()
                        .is_some_and(|t| t.ends_with("ClustersConfigDump"))
                })
            })
            .map(|c| c["dynamic_warming_clusters"].to_string())
            .unwrap_or_default();
        assert!(warming.contains("elsewhere"), "warming for ever: {warming}");
    } else {
        let nack = mesh.ads.wait_for_nack(CDS, PROPAGATION).await;
        let detail = nack.error.unwrap_or_default();
        assert!(
            detail.contains("cluster 'elsewhere'")
                && detail.contains(
                    "gRPC cluster 'no-such-sds' is not a static cluster of the bootstrap"
                ),
            "names the resource and the cluster: {detail}"
        );
    }
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.backend(), Some("reviews"), "{r:?}");
}

/// Upstream SDS over the ADS stream (`sds_config: {ads: {}}`): the same ISTIO_MUTUAL socket,
/// its cluster warming until both secrets have come, then reaching the mTLS pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_secrets_over_ads() {
    let mesh_ca = Pki::new("cluster.local");
    let backend = mtls_backend(
        "reviews",
        &mesh_ca.leaf_with_uris(&[], &[REVIEWS]),
        &mesh_ca,
    )
    .await;
    let mut ctx = istio_mutual(REVIEWS, "unused");
    if let Some(c) = &mut ctx.common_tls_context {
        c.tls_certificate_sds_secret_configs[0].sds_config = Some(ads_source());
        if let Some(ValidationContextType::CombinedValidationContext(cv)) =
            &mut c.validation_context_type
        {
            if let Some(s) = &mut cv.validation_context_sds_secret_config {
                s.sds_config = Some(ads_source());
            }
        }
    }
    let addr = backend.addr;
    let gateway = mesh_ca.leaf_with_uris(&[], &[GATEWAY]);
    let mesh = Mesh::start(move |port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "h",
                &[HOST],
                vec![rt(prefix("/"), to_cluster("reviews"))],
            )],
        )],
        clusters: vec![mesh_cluster("reviews", ctx)],
        endpoints: vec![istio_endpoints("reviews", addr)],
        secrets: vec![cert_secret("default", &gateway), root_secret(&mesh_ca)],
        ..Default::default()
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews").await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.header("x-client-uri"), Some(GATEWAY), "{r:?}");
    let asked: std::collections::BTreeSet<String> = mesh
        .ads
        .log()
        .iter()
        .filter(|q| q.type_url == SDS)
        .flat_map(|q| q.resource_names.clone())
        .collect();
    assert!(
        asked.contains("default") && asked.contains("ROOTCA"),
        "{asked:?}"
    );
}
