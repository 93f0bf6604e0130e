//! Shared harness for the gateway integration tests.
//!
//! The same tests run against Envoy (to prove they describe Envoy's behaviour)
//! and against Portico; `PORTICO_GATEWAY_BIN` selects the binary.

// Each test binary uses a different subset of the harness.
#![allow(dead_code)]

#[allow(dead_code)]
pub mod jwt;
pub mod pki;
#[allow(unused_imports)] // each binary uses what it needs
pub use pki::{Leaf, Pki};

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, data_source, socket_address, Address, AggregatedConfigSource,
    ApiVersion, ConfigSource, DataSource, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher, route, route_action, route_match, weighted_cluster, DirectResponseAction,
    HeaderMatcher, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost,
    WeightedCluster,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, RegexMatcher, StringMatcher};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use http_body_util::Full;
use hyper::body::Bytes;
use prost::{Message, Name};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;

pub const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const SDS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// Config propagation is asynchronous; every wait in the suite uses this bound.
pub const PROPAGATION: Duration = Duration::from_secs(10);

pub const NODE_ID: &str = "router~127.0.0.1~portico-test.default~default.svc.cluster.local";
pub const NODE_CLUSTER: &str = "portico-test";

// ---------------------------------------------------------------------------
// Small utilities
// ---------------------------------------------------------------------------

/// A port the kernel just handed out. Racy by nature (the socket is closed
/// before the gateway binds it) but the kernel rotates ephemeral ports, so
/// parallel tests practically never collide.
/// A port nobody listens on now, for a gateway listener or admin to bind later. Picked at
/// random below the kernel's ephemeral range (32768+), so outgoing connections of parallel
/// tests cannot take it between this check and the gateway's bind.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Each test binary is its own process: start at a per-process random offset and walk.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let seed = (std::process::id() as u16).wrapping_mul(7919) % 10_000;
    for _ in 0..10_000 {
        let step = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (seed.wrapping_add(step.wrapping_mul(13))) % 12_000;
        if StdTcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 20000..32000");
}

pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let name = format!(
            "{prefix}-{}-{}-{nanos}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Keep the bootstrap and logs of a failed test for post-mortem.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Polls `check` until it yields `Ok`, or panics after `timeout` with the last
/// observation. `check` returns `Err(description)` while the condition does
/// not hold yet, so a timeout explains what was actually seen.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) => {
                if Instant::now() >= deadline {
                    panic!(
                        "timed out after {timeout:?} waiting for {what}; last observation: {last}"
                    );
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------

/// An HTTP/1.1 upstream that identifies itself and echoes what the gateway
/// forwarded, so tests can see both routing decisions and header rewriting.
pub struct Backend {
    pub name: String,
    pub addr: SocketAddr,
    served: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Backend {
    pub async fn start(name: &str) -> Backend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        let addr = listener.local_addr().expect("backend addr");
        let served = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(backend_accept_loop(
            listener,
            name.to_string(),
            served.clone(),
        ));
        Backend {
            name: name.to_string(),
            addr,
            served,
            task,
        }
    }

    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn backend_accept_loop(
    listener: tokio::net::TcpListener,
    name: String,
    served: Arc<AtomicUsize>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                // e.g. EMFILE under heavy parallelism; don't spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let name = name.clone();
        let served = served.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let name = name.clone();
                    let served = served.clone();
                    async move {
                        served.fetch_add(1, Ordering::SeqCst);
                        let mut resp = hyper::Response::builder()
                            .status(200)
                            .header("x-backend", name.as_str())
                            .header("x-echo-path", req.uri().to_string());
                        for (from, to) in [
                            ("x-forwarded-for", "x-echo-xff"),
                            ("x-request-id", "x-echo-request-id"),
                            ("host", "x-echo-host"),
                            ("x-forwarded-proto", "x-echo-xfp"),
                            ("x-forwarded-client-cert", "x-echo-xfcc"),
                        ] {
                            if let Some(v) = req.headers().get(from) {
                                resp = resp.header(to, v.clone());
                            }
                        }
                        let resp = resp
                            .body(Full::new(Bytes::from(name)))
                            .expect("static response is well-formed");
                        Ok::<_, Infallible>(resp)
                    }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

// ---------------------------------------------------------------------------
// Resource builders (Istio naming)
// ---------------------------------------------------------------------------

pub fn any<T: Message + Name>(m: T) -> Any {
    envoy_types::util::pack_any(m)
}

/// Istio's name for a subset cluster of `<service>.default.svc.cluster.local:9080`.
pub fn subset_cluster(subset: &str, service: &str) -> String {
    format!("outbound|9080|{subset}|{service}.default.svc.cluster.local")
}

pub fn listener_name(port: u16) -> String {
    format!("0.0.0.0_{port}")
}

pub fn route_name(port: u16) -> String {
    format!("http.{port}")
}

pub fn socket_addr(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

pub fn ads_source() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// The HCM a listener on `port` uses: RDS over ADS for `http.<port>`, router only.
pub fn hcm(port: u16) -> HttpConnectionManager {
    HttpConnectionManager {
        stat_prefix: format!("outbound_0.0.0.0_{port}"),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads_source()),
            route_config_name: route_name(port),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(any(Router::default()))),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Listener `0.0.0.0_<port>` (Istio's name) bound on 127.0.0.1 so tests stay on loopback.
pub fn l(port: u16) -> Listener {
    listener_with(port, hcm(port))
}

pub fn listener_with(port: u16, hcm: HttpConnectionManager) -> Listener {
    Listener {
        name: listener_name(port),
        address: Some(socket_addr("127.0.0.1", port)),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.http_connection_manager".to_string(),
                config_type: Some(filter::ConfigType::TypedConfig(any(hcm))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

pub fn route_config(name: &str, vhosts: Vec<VirtualHost>) -> RouteConfiguration {
    RouteConfiguration {
        name: name.to_string(),
        virtual_hosts: vhosts,
        ..Default::default()
    }
}

pub fn vhost(name: &str, domains: &[&str], routes: Vec<Route>) -> VirtualHost {
    VirtualHost {
        name: name.to_string(),
        domains: domains.iter().map(|d| d.to_string()).collect(),
        routes,
        ..Default::default()
    }
}

pub fn prefix(p: &str) -> RouteMatch {
    RouteMatch {
        path_specifier: Some(route_match::PathSpecifier::Prefix(p.to_string())),
        ..Default::default()
    }
}

pub fn path(p: &str) -> RouteMatch {
    RouteMatch {
        path_specifier: Some(route_match::PathSpecifier::Path(p.to_string())),
        ..Default::default()
    }
}

pub fn regex(r: &str) -> RouteMatch {
    RouteMatch {
        path_specifier: Some(route_match::PathSpecifier::SafeRegex(RegexMatcher {
            regex: r.to_string(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Adds an exact header matcher (`string_match.exact`, the non-deprecated form).
pub fn with_header(mut m: RouteMatch, name: &str, exact: &str) -> RouteMatch {
    m.headers.push(HeaderMatcher {
        name: name.to_string(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact(exact.to_string())),
                ..Default::default()
            },
        )),
        ..Default::default()
    });
    m
}

pub fn to_cluster(cluster: &str) -> route::Action {
    route::Action::Route(RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.to_string())),
        ..Default::default()
    })
}

pub fn weighted(split: &[(&str, u32)]) -> route::Action {
    route::Action::Route(RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::WeightedClusters(
            WeightedCluster {
                clusters: split
                    .iter()
                    .map(|(name, w)| weighted_cluster::ClusterWeight {
                        name: name.to_string(),
                        weight: Some(UInt32Value { value: *w }),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            },
        )),
        ..Default::default()
    })
}

pub fn direct(status: u32, body: &str) -> route::Action {
    route::Action::DirectResponse(DirectResponseAction {
        status,
        body: Some(DataSource {
            specifier: Some(data_source::Specifier::InlineString(body.to_string())),
            ..Default::default()
        }),
        ..Default::default()
    })
}

pub fn rt(m: RouteMatch, action: route::Action) -> Route {
    Route {
        r#match: Some(m),
        action: Some(action),
        ..Default::default()
    }
}

/// EDS cluster fed over ADS; service_name equals the cluster name, as Istio does.
pub fn eds_cluster(name: &str) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads_source()),
            service_name: name.to_string(),
        }),
        connect_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 1,
            nanos: 0,
        }),
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        ..Default::default()
    }
}

/// An EDS cluster whose upstream speaks HTTP/2 (explicit `http2_protocol_options`).
pub fn h2_cluster(name: &str) -> Cluster {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
        explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
    };
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
    let mut c = eds_cluster(name);
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
    c
}

pub fn cla(cluster_name: &str, endpoints: &[SocketAddr]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster_name.to_string(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: endpoints
                .iter()
                .map(|a| LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket_addr(&a.ip().to_string(), a.port())),
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// One full state-of-the-world configuration.
#[derive(Clone, Default)]
pub struct Snapshot {
    pub listeners: Vec<Listener>,
    pub routes: Vec<RouteConfiguration>,
    pub clusters: Vec<Cluster>,
    pub endpoints: Vec<ClusterLoadAssignment>,
    pub secrets: Vec<envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret>,
}

impl Snapshot {
    /// Cluster + endpoints for each `(cluster name, backend)` pair.
    pub fn with_backends(mut self, pairs: &[(&str, &Backend)]) -> Snapshot {
        for (cluster, backend) in pairs {
            self.clusters.push(eds_cluster(cluster));
            self.endpoints.push(cla(cluster, &[backend.addr]));
        }
        self
    }
}

// ---------------------------------------------------------------------------
// In-process ADS server (state of the world)
// ---------------------------------------------------------------------------

/// One DiscoveryRequest as the gateway sent it.
#[derive(Clone, Debug, Default)]
pub struct LoggedRequest {
    pub node_id: Option<String>,
    pub node_cluster: Option<String>,
    pub type_url: String,
    /// SotW: the request's version_info. Delta: the system_version_info of the response its
    /// nonce answers (so an ACK names the version it accepts either way).
    pub version_info: String,
    pub response_nonce: String,
    /// SotW: the names subscribed to. Delta: the names the request subscribes to.
    pub resource_names: Vec<String>,
    pub error: Option<String>,
    /// Delta only: the names the request unsubscribes from.
    pub unsubscribe: Vec<String>,
    /// Delta only: the resources (name -> version) the client already has, on a new stream.
    pub initial_versions: std::collections::BTreeMap<String, String>,
    pub delta: bool,
}

impl LoggedRequest {
    pub fn is_nack(&self) -> bool {
        self.error.is_some()
    }
}

#[derive(Clone)]
struct TypeState {
    version: String,
    /// (resource name, packed resource)
    resources: Vec<(String, Any)>,
}

#[derive(Default)]
struct Shared {
    config: Mutex<HashMap<String, TypeState>>,
    log: Mutex<Vec<LoggedRequest>>,
    /// Encoded bytes of every response sent, both protocols: what went on the wire.
    sent_bytes: AtomicU64,
}

/// Order in which a multi-type change is pushed: clusters and endpoints before
/// the listeners and routes that may reference them (make-before-break).
const PUSH_ORDER: [&str; 5] = [CDS, EDS, LDS, RDS, SDS];

pub struct AdsServer {
    pub port: u16,
    shared: Arc<Shared>,
    generation: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl AdsServer {
    /// Serves `snapshot` (all types at `version`) on 127.0.0.1:`port`.
    pub async fn start(port: u16, version: &str, snapshot: &Snapshot) -> AdsServer {
        let shared = Arc::new(Shared::default());
        let (generation, _) = watch::channel(0u64);
        let (shutdown, _) = watch::channel(false);
        let mut server = AdsServer {
            port,
            shared,
            generation,
            shutdown,
            task: None,
        };
        server.store_snapshot(version, snapshot);

        // The port may still be held for a moment by the previous instance in
        // the restart scenario; tokio sets SO_REUSEADDR so this is brief.
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("ads: bind 127.0.0.1:{port} failed ({e}), retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("ads: cannot bind 127.0.0.1:{port}: {e}"),
            }
        };
        let svc = AdsService {
            shared: server.shared.clone(),
            generation: server.generation.clone(),
            shutdown: server.shutdown.subscribe(),
        };
        let mut stop = server.shutdown.subscribe();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        server.task = Some(tokio::spawn(async move {
            let res = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(svc))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = res {
                eprintln!("ads: server error: {e}");
            }
        }));
        server
    }

    /// Serves `snapshot` on a unix socket at `path`, as istio-agent serves xDS to its proxy
    /// (`./etc/istio/proxy/XDS`). `port` is 0.
    pub async fn start_unix(path: &Path, version: &str, snapshot: &Snapshot) -> AdsServer {
        let (generation, _) = watch::channel(0u64);
        let (shutdown, _) = watch::channel(false);
        let mut server = AdsServer {
            port: 0,
            shared: Arc::new(Shared::default()),
            generation,
            shutdown,
            task: None,
        };
        server.store_snapshot(version, snapshot);
        let listener = tokio::net::UnixListener::bind(path)
            .unwrap_or_else(|e| panic!("ads: cannot bind {}: {e}", path.display()));
        let incoming = futures::stream::unfold(listener, |l| async move {
            let conn = l.accept().await.map(|(s, _)| s);
            Some((conn, l))
        });
        let svc = AdsService {
            shared: server.shared.clone(),
            generation: server.generation.clone(),
            shutdown: server.shutdown.subscribe(),
        };
        let mut stop = server.shutdown.subscribe();
        server.task = Some(tokio::spawn(async move {
            let res = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(svc))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = res {
                eprintln!("ads: server error: {e}");
            }
        }));
        server
    }

    /// Starts on a fresh port.
    pub async fn start_any(version: &str, snapshot: &Snapshot) -> AdsServer {
        AdsServer::start(free_port(), version, snapshot).await
    }

    /// Stops serving: every open ADS stream is ended (the gateway sees its
    /// stream close) and the listening socket is closed.
    pub async fn stop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(Duration::from_secs(5), &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
    }

    fn store_snapshot(&self, version: &str, s: &Snapshot) {
        let mut cfg = self.shared.config.lock().expect("ads config lock");
        let named = |v: Vec<(String, Any)>| TypeState {
            version: version.to_string(),
            resources: v,
        };
        cfg.insert(
            LDS.into(),
            named(
                s.listeners
                    .iter()
                    .map(|x| (x.name.clone(), any(x.clone())))
                    .collect(),
            ),
        );
        cfg.insert(
            RDS.into(),
            named(
                s.routes
                    .iter()
                    .map(|x| (x.name.clone(), any(x.clone())))
                    .collect(),
            ),
        );
        cfg.insert(
            CDS.into(),
            named(
                s.clusters
                    .iter()
                    .map(|x| (x.name.clone(), any(x.clone())))
                    .collect(),
            ),
        );
        cfg.insert(
            SDS.into(),
            named(
                s.secrets
                    .iter()
                    .map(|x| (x.name.clone(), any(x.clone())))
                    .collect(),
            ),
        );
        cfg.insert(
            EDS.into(),
            named(
                s.endpoints
                    .iter()
                    .map(|x| (x.cluster_name.clone(), any(x.clone())))
                    .collect(),
            ),
        );
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Replaces every type with `snapshot` at `version` and pushes.
    pub fn set_snapshot(&self, version: &str, snapshot: &Snapshot) {
        self.store_snapshot(version, snapshot);
        self.bump();
    }

    fn set_type(&self, type_url: &str, version: &str, resources: Vec<(String, Any)>) {
        self.shared.config.lock().expect("ads config lock").insert(
            type_url.to_string(),
            TypeState {
                version: version.to_string(),
                resources,
            },
        );
        self.bump();
    }

    pub fn set_routes(&self, version: &str, routes: &[RouteConfiguration]) {
        let r = routes
            .iter()
            .map(|x| (x.name.clone(), any(x.clone())))
            .collect();
        self.set_type(RDS, version, r);
    }

    pub fn set_clusters(&self, version: &str, clusters: &[Cluster]) {
        let r = clusters
            .iter()
            .map(|x| (x.name.clone(), any(x.clone())))
            .collect();
        self.set_type(CDS, version, r);
    }

    pub fn set_endpoints(&self, version: &str, endpoints: &[ClusterLoadAssignment]) {
        let r = endpoints
            .iter()
            .map(|x| (x.cluster_name.clone(), any(x.clone())))
            .collect();
        self.set_type(EDS, version, r);
    }

    pub fn set_secrets(
        &self,
        version: &str,
        secrets: &[envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret],
    ) {
        let r = secrets
            .iter()
            .map(|x| (x.name.clone(), any(x.clone())))
            .collect();
        self.set_type(SDS, version, r);
    }

    pub fn set_listeners(&self, version: &str, listeners: &[Listener]) {
        let r = listeners
            .iter()
            .map(|x| (x.name.clone(), any(x.clone())))
            .collect();
        self.set_type(LDS, version, r);
    }

    pub fn log(&self) -> Vec<LoggedRequest> {
        self.shared.log.lock().expect("ads log lock").clone()
    }

    /// Encoded bytes of every response sent so far, on all streams.
    pub fn sent_bytes(&self) -> u64 {
        self.shared.sent_bytes.load(Ordering::Relaxed)
    }

    fn log_tail(&self) -> String {
        let log = self.log();
        let start = log.len().saturating_sub(12);
        log[start..]
            .iter()
            .map(|r| format!("\n    {r:?}"))
            .collect::<String>()
    }

    pub fn first_node_id(&self) -> Option<String> {
        self.log().into_iter().find_map(|r| r.node_id)
    }

    /// Waits for a request that acknowledges `version` of `type_url`.
    pub async fn wait_for_ack(&self, type_url: &str, version: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let acked = self.log().iter().any(|r| {
                r.type_url == type_url
                    && r.version_info == version
                    && !r.response_nonce.is_empty()
                    && r.error.is_none()
            });
            if acked {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no ACK of {type_url} version {version:?} within {timeout:?}; last requests:{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for a NACK (request carrying error_detail) of `type_url`.
    pub async fn wait_for_nack(&self, type_url: &str, timeout: Duration) -> LoggedRequest {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self
                .log()
                .into_iter()
                .find(|r| r.type_url == type_url && r.is_nack())
            {
                return r;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no NACK of {type_url} within {timeout:?}; last requests:{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for AdsServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
        if std::thread::panicking() {
            eprintln!(
                "---- ADS requests seen on port {} (last 12):{}",
                self.port,
                self.log_tail()
            );
        }
    }
}

struct AdsService {
    shared: Arc<Shared>,
    generation: watch::Sender<u64>,
    shutdown: watch::Receiver<bool>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, tonic::Status>> + Send>>;
type DeltaStream =
    Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsService {
    type StreamAggregatedResourcesStream = ResponseStream;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<ResponseStream>, tonic::Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(ads_stream(
            self.shared.clone(),
            request.into_inner(),
            tx,
            self.generation.subscribe(),
            self.shutdown.clone(),
        ));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type DeltaAggregatedResourcesStream = DeltaStream;

    async fn delta_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<DeltaStream>, tonic::Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(delta_stream(
            self.shared.clone(),
            request.into_inner(),
            tx,
            self.generation.subscribe(),
            self.shutdown.clone(),
        ));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Per-stream, per-type subscription state.
#[derive(Default)]
struct Subscription {
    names: BTreeSet<String>,
    last_nonce: String,
    sent_version: Option<String>,
}

type Tx = mpsc::Sender<Result<DiscoveryResponse, tonic::Status>>;

async fn ads_stream(
    shared: Arc<Shared>,
    mut inbound: tonic::Streaming<DiscoveryRequest>,
    tx: Tx,
    mut generation: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut subs: HashMap<String, Subscription> = HashMap::new();
    let mut nonce_seq: u64 = 0;
    loop {
        tokio::select! {
            () = stopped(&mut shutdown) => {
                let _ = tx.send(Err(tonic::Status::unavailable("ADS server stopping"))).await;
                return;
            }
            msg = inbound.message() => {
                let req = match msg {
                    Ok(Some(req)) => req,
                    _ => return,
                };
                shared.log.lock().expect("ads log lock").push(LoggedRequest {
                    node_id: req.node.as_ref().map(|n| n.id.clone()),
                    node_cluster: req.node.as_ref().map(|n| n.cluster.clone()),
                    type_url: req.type_url.clone(),
                    version_info: req.version_info.clone(),
                    response_nonce: req.response_nonce.clone(),
                    resource_names: req.resource_names.clone(),
                    error: req.error_detail.as_ref().map(|e| e.message.clone()),
                    unsubscribe: Vec::new(),
                    initial_versions: Default::default(),
                    delta: false,
                });
                if req.error_detail.is_some() {
                    // A NACK: keep serving the same config, the gateway keeps its last good one.
                    continue;
                }
                let first = !subs.contains_key(&req.type_url);
                let sub = subs.entry(req.type_url.clone()).or_default();
                if !first && !req.response_nonce.is_empty() && req.response_nonce != sub.last_nonce {
                    // Answers an older response while a newer one is in flight: stale.
                    continue;
                }
                let names: BTreeSet<String> = req.resource_names.iter().cloned().collect();
                if first || names != sub.names {
                    sub.names = names;
                    if !send(&shared, &req.type_url, sub, &mut nonce_seq, &tx).await {
                        return;
                    }
                }
            }
            changed = generation.changed() => {
                if changed.is_err() {
                    return;
                }
                for type_url in PUSH_ORDER {
                    let Some(sub) = subs.get_mut(type_url) else { continue };
                    let current = shared
                        .config
                        .lock()
                        .expect("ads config lock")
                        .get(type_url)
                        .map(|t| t.version.clone());
                    if current.is_some() && current != sub.sent_version
                        && !send(&shared, type_url, sub, &mut nonce_seq, &tx).await
                    {
                        return;
                    }
                }
            }
        }
    }
}

/// Resolves once the server is stopping (the watch guard must not live across awaits).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Sends the current state of `type_url`; returns false when the stream is gone.
async fn send(
    shared: &Shared,
    type_url: &str,
    sub: &mut Subscription,
    nonce_seq: &mut u64,
    tx: &Tx,
) -> bool {
    let Some(state) = shared
        .config
        .lock()
        .expect("ads config lock")
        .get(type_url)
        .cloned()
    else {
        return true;
    };
    // LDS and CDS are wildcard subscriptions; RDS and EDS get what was asked for.
    let wildcard = type_url == LDS || type_url == CDS || sub.names.is_empty();
    let resources = state
        .resources
        .into_iter()
        .filter(|(name, _)| wildcard || sub.names.contains(name))
        .map(|(_, a)| a)
        .collect();
    *nonce_seq += 1;
    let nonce = format!("n{nonce_seq}");
    sub.last_nonce = nonce.clone();
    sub.sent_version = Some(state.version.clone());
    let resp = DiscoveryResponse {
        version_info: state.version,
        resources,
        type_url: type_url.to_string(),
        nonce,
        ..Default::default()
    };
    shared
        .sent_bytes
        .fetch_add(resp.encoded_len() as u64, Ordering::Relaxed);
    tx.send(Ok(resp)).await.is_ok()
}

// ---------------------------------------------------------------------------
// In-process ADS server (incremental)
// ---------------------------------------------------------------------------

/// Per-stream, per-type delta state: what the client subscribed to and what it holds.
#[derive(Default)]
struct DeltaSub {
    /// LDS and CDS: everything, whatever was named.
    wildcard: bool,
    names: BTreeSet<String>,
    /// name -> version the client has (sent by us, or reported on a new stream).
    has: HashMap<String, String>,
    /// nonce -> system version of each response sent, for the log.
    sent: HashMap<String, String>,
}

type DeltaTx = mpsc::Sender<Result<DeltaDiscoveryResponse, tonic::Status>>;

/// A resource's delta version: a digest of its bytes, so only changed resources are sent.
fn delta_version(a: &Any) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    a.value.hash(&mut h);
    format!("{:016x}", h.finish())
}

async fn delta_stream(
    shared: Arc<Shared>,
    mut inbound: tonic::Streaming<DeltaDiscoveryRequest>,
    tx: DeltaTx,
    mut generation: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut subs: HashMap<String, DeltaSub> = HashMap::new();
    let mut nonce_seq: u64 = 0;
    loop {
        tokio::select! {
            () = stopped(&mut shutdown) => {
                let _ = tx.send(Err(tonic::Status::unavailable("ADS server stopping"))).await;
                return;
            }
            msg = inbound.message() => {
                let req = match msg {
                    Ok(Some(req)) => req,
                    _ => return,
                };
                let first = !subs.contains_key(&req.type_url);
                let sub = subs.entry(req.type_url.clone()).or_default();
                shared.log.lock().expect("ads log lock").push(LoggedRequest {
                    node_id: req.node.as_ref().map(|n| n.id.clone()),
                    node_cluster: req.node.as_ref().map(|n| n.cluster.clone()),
                    type_url: req.type_url.clone(),
                    version_info: sub.sent.get(&req.response_nonce).cloned().unwrap_or_default(),
                    response_nonce: req.response_nonce.clone(),
                    resource_names: req.resource_names_subscribe.clone(),
                    error: req.error_detail.as_ref().map(|e| e.message.clone()),
                    unsubscribe: req.resource_names_unsubscribe.clone(),
                    initial_versions: req.initial_resource_versions.clone().into_iter().collect(),
                    delta: true,
                });
                if req.error_detail.is_some() {
                    // A NACK: keep serving the same config, the gateway keeps its last good one.
                    continue;
                }
                if first {
                    sub.wildcard = req.type_url == LDS || req.type_url == CDS;
                    sub.has = req.initial_resource_versions.clone().into_iter().collect();
                }
                let changed = !req.resource_names_subscribe.is_empty()
                    || !req.resource_names_unsubscribe.is_empty();
                for n in &req.resource_names_subscribe {
                    if n == "*" {
                        sub.wildcard = true;
                    } else {
                        sub.names.insert(n.clone());
                    }
                }
                for n in &req.resource_names_unsubscribe {
                    sub.names.remove(n);
                    // The client drops what it unsubscribed from.
                    sub.has.remove(n);
                }
                if (first || changed)
                    && !send_delta(&shared, &req.type_url, sub, &mut nonce_seq, &tx, first).await
                {
                    return;
                }
            }
            changed = generation.changed() => {
                if changed.is_err() {
                    return;
                }
                for type_url in PUSH_ORDER {
                    let Some(sub) = subs.get_mut(type_url) else { continue };
                    if !send_delta(&shared, type_url, sub, &mut nonce_seq, &tx, false).await {
                        return;
                    }
                }
            }
        }
    }
}

/// Sends what changed of `type_url` since the client's state: new or changed resources it is
/// subscribed to and removals. Sends nothing when nothing changed, unless `always` (the first
/// request of a type is answered even when empty). Returns false when the stream is gone.
async fn send_delta(
    shared: &Shared,
    type_url: &str,
    sub: &mut DeltaSub,
    nonce_seq: &mut u64,
    tx: &DeltaTx,
    always: bool,
) -> bool {
    let Some(state) = shared
        .config
        .lock()
        .expect("ads config lock")
        .get(type_url)
        .cloned()
    else {
        return true;
    };
    let wanted = |n: &str| sub.wildcard || sub.names.contains(n);
    let mut resources = Vec::new();
    let mut present = BTreeSet::new();
    for (name, any) in &state.resources {
        if !wanted(name) {
            continue;
        }
        present.insert(name.clone());
        let version = delta_version(any);
        if sub.has.get(name) == Some(&version) {
            continue;
        }
        sub.has.insert(name.clone(), version.clone());
        resources.push(envoy_types::pb::envoy::service::discovery::v3::Resource {
            name: name.clone(),
            version,
            resource: Some(any.clone()),
            ..Default::default()
        });
    }
    let removed: Vec<String> = sub
        .has
        .keys()
        .filter(|n| !present.contains(*n))
        .cloned()
        .collect();
    for n in &removed {
        sub.has.remove(n);
    }
    if resources.is_empty() && removed.is_empty() && !always {
        return true;
    }
    *nonce_seq += 1;
    let nonce = format!("d{nonce_seq}");
    sub.sent.insert(nonce.clone(), state.version.clone());
    let resp = DeltaDiscoveryResponse {
        system_version_info: state.version,
        resources,
        type_url: type_url.to_string(),
        removed_resources: removed,
        nonce,
        ..Default::default()
    };
    shared
        .sent_bytes
        .fetch_add(resp.encoded_len() as u64, Ordering::Relaxed);
    tx.send(Ok(resp)).await.is_ok()
}

// ---------------------------------------------------------------------------
// Gateway process
// ---------------------------------------------------------------------------

/// The flags pilot-agent (Istio 1.30) passes to the proxy besides `-c`, `--config-yaml` and
/// `--concurrency`, in its order.
pub const PILOT_AGENT_FLAGS: &[&str] = &[
    "--drain-time-s",
    "45",
    "--drain-strategy",
    "immediate",
    "--local-address-ip-version",
    "v4",
    "--file-flush-interval-msec",
    "1000",
    "--disable-hot-restart",
    "--allow-unknown-static-fields",
    "-l",
    "warning",
    "--component-log-level",
    "misc:error",
    "--skip-deprecated-logs",
];

pub fn gateway_bin() -> PathBuf {
    match std::env::var_os("PORTICO_GATEWAY_BIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_portico")),
    }
}

pub fn is_envoy(bin: &Path) -> bool {
    bin.file_name()
        .map(|n| n.to_string_lossy().contains("envoy"))
        .unwrap_or(false)
}

/// The ADS protocol the suite's gateways speak: GRPC (state of the world), or DELTA_GRPC when
/// `PORTICO_TEST_XDS=delta`, so the whole suite can run over incremental xDS too.
pub fn ads_api_type() -> &'static str {
    match std::env::var("PORTICO_TEST_XDS").as_deref() {
        Ok("delta") => "DELTA_GRPC",
        _ => "GRPC",
    }
}

/// The bootstrap of [`bootstrap_yaml`] with the ADS protocol chosen by the test.
pub fn bootstrap_yaml_api(admin_port: u16, ads_port: u16, api_type: &str) -> String {
    bootstrap_yaml(admin_port, ads_port).replacen(
        &format!("api_type: {}", ads_api_type()),
        &format!("api_type: {api_type}"),
        1,
    )
}

pub fn bootstrap_yaml(admin_port: u16, ads_port: u16) -> String {
    bootstrap_yaml_labeled(admin_port, ads_port, &[])
}

/// The bootstrap with node metadata LABELS, as istio-agent writes them: a control plane
/// selects Gateways by them.
pub fn bootstrap_yaml_labeled(admin_port: u16, ads_port: u16, labels: &[(&str, &str)]) -> String {
    let api_type = ads_api_type();
    let metadata = if labels.is_empty() {
        String::new()
    } else {
        let entries: String = labels
            .iter()
            .map(|(k, v)| format!("      {k}: \"{v}\"\n"))
            .collect();
        format!("  metadata:\n    LABELS:\n{entries}")
    };
    format!(
        r#"node:
  id: "{NODE_ID}"
  cluster: "{NODE_CLUSTER}"
{metadata}admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
dynamic_resources:
  ads_config:
    api_type: {api_type}
    transport_api_version: V3
    grpc_services:
    - envoy_grpc: {{ cluster_name: xds-grpc }}
  lds_config: {{ ads: {{}}, resource_api_version: V3 }}
  cds_config: {{ ads: {{}}, resource_api_version: V3 }}
static_resources:
  clusters:
  - name: xds-grpc
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: xds-grpc
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {ads_port} }}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
"#
    )
}

/// The gateway under test, killed on drop. Its stderr is printed if the test fails.
pub struct Gateway {
    child: Child,
    pub admin_port: u16,
    stderr_path: PathBuf,
    _dir: TempDir,
}

impl Gateway {
    /// Launches the gateway against the ADS server on `ads_port` and waits for `/ready`.
    pub async fn start(ads_port: u16) -> Gateway {
        Gateway::start_labeled(ads_port, &[]).await
    }

    /// As [`Gateway::start`], with node metadata LABELS.
    pub async fn start_labeled(ads_port: u16, labels: &[(&str, &str)]) -> Gateway {
        Gateway::start_bootstrap(|admin_port| bootstrap_yaml_labeled(admin_port, ads_port, labels))
            .await
    }

    /// Launches the gateway on the bootstrap `make` writes for the admin port it is given,
    /// and waits for `/ready`.
    pub async fn start_bootstrap(make: impl FnOnce(u16) -> String) -> Gateway {
        Gateway::start_bootstrap_args(make, &[]).await
    }

    /// As [`Gateway::start_bootstrap`], with extra command-line flags (`--drain-time-s` ...).
    pub async fn start_bootstrap_args(make: impl FnOnce(u16) -> String, args: &[&str]) -> Gateway {
        let bin = gateway_bin();
        let dir = TempDir::new("portico-it");
        let admin_port = free_port();
        let bootstrap = dir.path.join("bootstrap.yaml");
        std::fs::write(&bootstrap, make(admin_port)).expect("write bootstrap");
        let stderr_path = dir.path.join("gateway.stderr");
        let stderr = std::fs::File::create(&stderr_path).expect("create stderr file");
        let mut cmd = Command::new(&bin);
        cmd.arg("-c").arg(&bootstrap).args(["--concurrency", "1"]);
        if is_envoy(&bin) {
            // No shared memory: parallel Envoys need no distinct --base-id.
            cmd.arg("--disable-hot-restart");
        }
        cmd.args(args);
        cmd.args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                stderr.try_clone().expect("dup stderr file for stdout"),
            ))
            .stderr(Stdio::from(stderr));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn gateway {}: {e}", bin.display()));
        let mut gw = Gateway {
            child,
            admin_port,
            stderr_path,
            _dir: dir,
        };
        gw.wait_ready().await;
        gw
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Polls the admin `/ready` endpoint until it answers 200.
    pub async fn wait_ready(&mut self) {
        let url = self.admin_url("/ready");
        let deadline = Instant::now() + Duration::from_secs(15);
        let last;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "gateway exited early with {status}; stderr:\n{}",
                    self.stderr()
                );
            }
            let r = get(&url, None, &[]).await;
            if r.status == 200 {
                return;
            }
            if Instant::now() >= deadline {
                last = format!("status {} {} {:?}", r.status, r.body.trim(), r.error);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("gateway not ready within 15s (last: {last})");
    }

    /// Current `/stats/prometheus` text.
    pub async fn prometheus(&self) -> String {
        let r = get(&self.admin_url("/stats/prometheus"), None, &[]).await;
        assert_eq!(r.status, 200, "GET /stats/prometheus: {}", r.body);
        r.body
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            // eprintln! (not io::stderr) so the test harness shows it with the failure.
            eprintln!(
                "---- gateway output ({}):\n{}\n---- end of gateway output",
                self.stderr_path.display(),
                self.stderr()
            );
        }
    }
}

// ---------------------------------------------------------------------------
// HTTP client
// ---------------------------------------------------------------------------

/// A response, or `status == 0` and `error` set when the request failed at the
/// transport level (so polling loops can keep going instead of panicking).
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
    pub error: Option<String>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `x-backend`, i.e. which upstream served the request.
    pub fn backend(&self) -> Option<&str> {
        self.header("x-backend")
    }

    fn failed(e: impl std::fmt::Display) -> Resp {
        Resp {
            status: 0,
            headers: Default::default(),
            body: String::new(),
            error: Some(e.to_string()),
        }
    }
}

/// A keep-alive client; use one per sequential loop so connections are reused.
#[derive(Clone)]
pub struct HttpClient(reqwest::Client);

impl Default for HttpClient {
    fn default() -> Self {
        HttpClient::new()
    }
}

impl HttpClient {
    pub fn new() -> HttpClient {
        HttpClient(
            reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("build reqwest client"),
        )
    }

    pub async fn get(&self, url: &str, host: Option<&str>, headers: &[(&str, &str)]) -> Resp {
        let mut req = self.0.get(url);
        if let Some(h) = host {
            req = req.header("host", h);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let headers = resp.headers().clone();
                match resp.text().await {
                    Ok(body) => Resp {
                        status,
                        headers,
                        body,
                        error: None,
                    },
                    Err(e) => Resp::failed(format!("reading body: {e}")),
                }
            }
            Err(e) => Resp::failed(e),
        }
    }
}

/// One-off GET on a fresh connection.
pub async fn get(url: &str, host: Option<&str>, headers: &[(&str, &str)]) -> Resp {
    HttpClient::new().get(url, host, headers).await
}

// ---------------------------------------------------------------------------
// Fixture: ADS server + gateway + listener
// ---------------------------------------------------------------------------

/// A gateway fed by its own ADS server, with one HTTP listener on `port`.
pub struct Mesh {
    pub ads: AdsServer,
    pub gw: Gateway,
    pub port: u16,
    pub client: HttpClient,
}

impl Mesh {
    /// `build` receives the listener port and returns the initial snapshot
    /// (version "1"); the listener itself is added here.
    pub async fn start(build: impl FnOnce(u16) -> Snapshot) -> Mesh {
        Mesh::start_raw(|port| {
            let mut snapshot = build(port);
            snapshot.listeners.push(l(port));
            snapshot
        })
        .await
    }

    /// Like `start`, but `build` supplies the listener on the given port itself.
    pub async fn start_raw(build: impl FnOnce(u16) -> Snapshot) -> Mesh {
        Mesh::start_api(ads_api_type(), build).await
    }

    /// Like `start_raw`, with the ADS protocol given: `GRPC` or `DELTA_GRPC`.
    pub async fn start_api(api_type: &str, build: impl FnOnce(u16) -> Snapshot) -> Mesh {
        Mesh::start_args(api_type, &[], build).await
    }

    /// Like `start_api`, with extra command-line flags for the gateway.
    pub async fn start_args(
        api_type: &str,
        args: &[&str],
        build: impl FnOnce(u16) -> Snapshot,
    ) -> Mesh {
        let port = free_port();
        let snapshot = build(port);
        let ads = AdsServer::start_any("1", &snapshot).await;
        let ads_port = ads.port;
        let gw = Gateway::start_bootstrap_args(
            |admin| bootstrap_yaml_api(admin, ads_port, api_type),
            args,
        )
        .await;
        Mesh {
            ads,
            gw,
            port,
            client: HttpClient::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub async fn get(&self, path: &str, host: &str, headers: &[(&str, &str)]) -> Resp {
        self.client.get(&self.url(path), Some(host), headers).await
    }

    /// Waits until `path` with `host` is served by `backend` (config propagated).
    pub async fn wait_backend(
        &self,
        path: &str,
        host: &str,
        headers: &[(&str, &str)],
        backend: &str,
    ) {
        self.wait_backend_within(PROPAGATION, path, host, headers, backend)
            .await
    }

    pub async fn wait_backend_within(
        &self,
        timeout: Duration,
        path: &str,
        host: &str,
        headers: &[(&str, &str)],
        backend: &str,
    ) {
        let what = format!("{host}{path} {headers:?} to reach {backend}");
        eventually(&what, timeout, || async {
            let r = self.get(path, host, headers).await;
            match r.backend() {
                Some(b) if b == backend && r.status == 200 => Ok(()),
                _ => Err(format!(
                    "status {} backend {:?} error {:?} body {:?}",
                    r.status,
                    r.backend(),
                    r.error,
                    r.body
                )),
            }
        })
        .await
    }

    /// Waits until routes are in without sending anything to a backend (a host no virtual
    /// host serves answers 404 once the route table exists), then leaves the gateway a moment
    /// to warm clusters: for backends whose script readiness probes would use up.
    pub async fn wait_routes_untouched(&self) {
        eventually("routes", PROPAGATION, || async {
            let r = self.get("/", "nowhere.example", &[]).await;
            if r.status == 404 {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Waits until the route table answers `path`/`host` with `status`.
    pub async fn wait_status(&self, path: &str, host: &str, status: u16) -> Resp {
        let what = format!("{host}{path} to answer {status}");
        eventually(&what, PROPAGATION, || async {
            let r = self.get(path, host, &[]).await;
            if r.status == status {
                Ok(r)
            } else {
                Err(format!(
                    "status {} error {:?} body {:?}",
                    r.status, r.error, r.body
                ))
            }
        })
        .await
    }
}

// ---------------------------------------------------------------------------
// Prometheus text format
// ---------------------------------------------------------------------------

/// Parses `name{labels} value` lines of the Prometheus text format. Label
/// order and extra labels are irrelevant to callers.
pub fn prom_samples(text: &str, metric: &str) -> Vec<(HashMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let (labels, value) = if let Some(body) = rest.strip_prefix('{') {
            match parse_labels(body) {
                Some((labels, after)) => (labels, after),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            (HashMap::new(), rest)
        } else {
            // Another metric sharing the prefix.
            continue;
        };
        let Some(v) = value.split_whitespace().next().and_then(|v| v.parse().ok()) else {
            continue;
        };
        out.push((labels, v));
    }
    out
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows the `}`.
fn parse_labels(s: &str) -> Option<(HashMap<String, String>, &str)> {
    let mut labels = HashMap::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_string();
        rest = rest[eq + 1..].strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        rest = &rest[end + 1..];
        labels.insert(key, value);
    }
}

/// Sum of `metric` samples whose `label` equals `value` (0 when absent).
pub fn prom_value(text: &str, metric: &str, label: &str, value: &str) -> f64 {
    prom_samples(text, metric)
        .into_iter()
        .filter(|(l, _)| l.get(label).map(String::as_str) == Some(value))
        .map(|(_, v)| v)
        .sum()
}

/// Envoy's default `envoy.cluster_name` tag extractor is `^cluster\.((.*?)\.)`:
/// it takes the cluster name only up to its FIRST dot and leaves the rest in
/// the metric name. So `outbound|9080|v1|reviews.default.svc.cluster.local`
/// shows up as
/// `envoy_cluster_default_svc_cluster_local_<stat>{envoy_cluster_name="outbound|9080|v1|reviews"}`.
/// Returns (metric name, envoy_cluster_name label value) for a cluster stat.
pub fn envoy_cluster_metric(cluster: &str, stat: &str) -> (String, String) {
    match cluster.split_once('.') {
        Some((head, rest)) => {
            let rest: String = rest
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            (format!("envoy_cluster_{rest}_{stat}"), head.to_string())
        }
        None => (format!("envoy_cluster_{stat}"), cluster.to_string()),
    }
}

// ===========================================================================
// BEGIN conformance_routing helpers (appended for tests/conformance_routing.rs)
// ===========================================================================

/// A response read off a raw HTTP/1.1 connection: exactly what went over the
/// wire, header names lowercased, body de-chunked.
#[derive(Debug, Clone)]
pub struct RawResp {
    pub status: u16,
    /// The status line's reason phrase, as written.
    pub reason: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Writes `request` verbatim to 127.0.0.1:`port` and reads one response.
/// The read stops as soon as the response is complete by its framing
/// (content-length, chunked, or a 204/304 status), or at EOF when it has no
/// framing. With `head` the response has no body whatever its headers say: the
/// read goes on until the server closes the connection (send `connection:
/// close`) and any byte after the headers is reported as body, so a body sent
/// in violation of HEAD is seen. Transport failures and unparsable answers
/// yield status 0 with the reason in the body.
pub async fn raw_http1(port: u16, request: &[u8], head: bool) -> RawResp {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let failed = |why: String| RawResp {
        status: 0,
        reason: String::new(),
        headers: Vec::new(),
        body: why.into_bytes(),
    };
    let io = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(request).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>((buf, true));
            }
            buf.extend_from_slice(&chunk[..n]);
            if !head && parse_raw_response(&buf, false).is_some() {
                return Ok((buf, false));
            }
        }
    };
    let (buf, eof) = match tokio::time::timeout(Duration::from_secs(5), io).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return failed(format!("io error: {e}")),
        Err(_) => return failed("timed out".into()),
    };
    match parse_raw_response(&buf, head || eof) {
        Some(r) => r,
        None => failed(format!(
            "incomplete response {:?}",
            String::from_utf8_lossy(&buf)
        )),
    }
}

/// HEAD `path`, followed on the same connection by a pipelined GET of `path`.
/// Returns the HEAD response; its body is whatever the server wrote between
/// the HEAD response's headers and the GET response's status line (a
/// conformant server writes nothing there). Deterministic: no waiting for a
/// body that may or may not come.
pub async fn raw_head(port: u16, path: &str, host: &str) -> RawResp {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "HEAD {path} HTTP/1.1\r\nhost: {host}\r\n\r\nGET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
    );
    let failed = |why: String| RawResp {
        status: 0,
        reason: String::new(),
        headers: Vec::new(),
        body: why.into_bytes(),
    };
    // (HEAD response head end, GET status line start) once both are in.
    let split = |buf: &[u8]| -> Option<(usize, usize)> {
        let e1 = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let k = e1 + buf[e1..].windows(7).position(|w| w == b"HTTP/1.")?;
        parse_raw_response(&buf[k..], false)?;
        Some((e1, k))
    };
    let io = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(request.as_bytes()).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = s.read(&mut chunk).await?;
            buf.extend_from_slice(&chunk[..n]);
            if n == 0 || split(&buf).is_some() {
                return Ok::<_, std::io::Error>(buf);
            }
        }
    };
    let buf = match tokio::time::timeout(Duration::from_secs(5), io).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return failed(format!("io error: {e}")),
        Err(_) => return failed("timed out".into()),
    };
    let (e1, k) = split(&buf).unwrap_or_else(|| {
        let e1 = buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(buf.len(), |p| p + 4);
        (e1, buf.len())
    });
    match parse_raw_response(&buf[..e1], true) {
        Some(mut r) => {
            r.body = buf[e1..k].to_vec();
            r
        }
        None => failed(format!(
            "incomplete response {:?}",
            String::from_utf8_lossy(&buf)
        )),
    }
}

/// Parses a complete response out of `buf`, or None while it is incomplete.
/// With `to_eof`, everything after the headers is the (possibly chunked) body.
pub fn parse_raw_response(buf: &[u8], to_eof: bool) -> Option<RawResp> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head_text = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = head_text.split("\r\n");
    let mut status_line = lines.next().unwrap_or("").splitn(3, ' ').skip(1);
    let status: u16 = status_line.next().and_then(|c| c.parse().ok()).unwrap_or(0);
    let reason = status_line.next().unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &buf[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let length = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok());
    let body = if to_eof {
        if chunked {
            dechunk(rest).unwrap_or_else(|| rest.to_vec())
        } else {
            rest.to_vec()
        }
    } else if status == 204 || status == 304 {
        Vec::new()
    } else if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        rest.get(..n)?.to_vec()
    } else {
        return None;
    };
    Some(RawResp {
        status,
        reason,
        headers,
        body,
    })
}

/// Decodes a chunked body; None until the last chunk and trailers are in.
fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = data.windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&data[..eol]).into_owned();
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).ok()?;
        data = &data[eol + 2..];
        if size == 0 {
            // Trailers, if any, end with an empty line.
            if data.starts_with(b"\r\n") || data.windows(4).any(|w| w == b"\r\n\r\n") {
                return Some(out);
            }
            return None;
        }
        if data.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// Any request through a reqwest client; like `HttpClient::get` but with a
/// method and an optional body. Headers are appended, so a name given twice
/// is sent as two header lines.
pub async fn send_request(
    client: &reqwest::Client,
    method: &str,
    url: &str,
    host: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Resp {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("valid method");
    let mut req = client.request(method, url);
    if let Some(h) = host {
        req = req.header("host", h);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req.body(b);
    }
    match req.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            match resp.text().await {
                Ok(body) => Resp {
                    status,
                    headers,
                    body,
                    error: None,
                },
                Err(e) => Resp::failed(format!("reading body: {e}")),
            }
        }
        Err(e) => Resp::failed(e),
    }
}

/// An HTTP/1.1 upstream that echoes the whole request it received: it answers
/// with `x-backend`, `x-echo-method`, `x-echo-path`, `x-echo-host`,
/// `x-echo-content-length`, `x-echo-transfer-encoding` (when sent),
/// `x-echo-body-len`, `server: echo-backend`, and the request body as its body
/// (or its own name when the request had no body).
pub struct EchoBackend {
    pub name: String,
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl EchoBackend {
    pub async fn start(name: &str) -> EchoBackend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind echo backend");
        let addr = listener.local_addr().expect("echo backend addr");
        let task = tokio::spawn(echo_accept_loop(listener, name.to_string()));
        EchoBackend {
            name: name.to_string(),
            addr,
            task,
        }
    }
}

impl Drop for EchoBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo_accept_loop(listener: tokio::net::TcpListener, name: String) {
    use http_body_util::BodyExt;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let name = name.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let name = name.clone();
                    async move {
                        let (parts, body) = req.into_parts();
                        let body = body
                            .collect()
                            .await
                            .map(|c| c.to_bytes())
                            .unwrap_or_default();
                        let mut resp = hyper::Response::builder()
                            .status(200)
                            .header("server", "echo-backend")
                            .header("x-backend", name.as_str())
                            .header("x-echo-method", parts.method.as_str())
                            .header("x-echo-path", parts.uri.to_string())
                            .header("x-echo-body-len", body.len().to_string());
                        for (from, to) in [
                            ("host", "x-echo-host"),
                            ("content-length", "x-echo-content-length"),
                            ("transfer-encoding", "x-echo-transfer-encoding"),
                            ("x-forwarded-host", "x-echo-forwarded-host"),
                        ] {
                            if let Some(v) = parts.headers.get(from) {
                                resp = resp.header(to, v.clone());
                            }
                        }
                        let out = if body.is_empty() {
                            Bytes::from(name)
                        } else {
                            body
                        };
                        let resp = resp
                            .body(Full::new(out))
                            .expect("echo response is well-formed");
                        Ok::<_, Infallible>(resp)
                    }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

// ===========================================================================
// END conformance_routing helpers
// ===========================================================================

// ===========================================================================
// BEGIN conformance_xds helpers (appended for tests/conformance_xds.rs)
// ===========================================================================

/// Endpoint health as EDS reports it.
pub use envoy_types::pb::envoy::config::core::v3::HealthStatus as EdsHealth;

impl Backend {
    /// Like `start`, but every response is sent only after `delay`;
    /// `served()` counts requests as they arrive.
    pub async fn start_delayed(name: &str, delay: Duration) -> Backend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind delayed backend");
        let addr = listener.local_addr().expect("delayed backend addr");
        let served = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(delayed_accept_loop(
            listener,
            name.to_string(),
            served.clone(),
            delay,
        ));
        Backend {
            name: name.to_string(),
            addr,
            served,
            task,
        }
    }
}

async fn delayed_accept_loop(
    listener: tokio::net::TcpListener,
    name: String,
    served: Arc<AtomicUsize>,
    delay: Duration,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let name = name.clone();
        let served = served.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |_req: hyper::Request<hyper::body::Incoming>| {
                    let name = name.clone();
                    let served = served.clone();
                    async move {
                        // Counted on arrival, so tests can see a request in flight.
                        served.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(delay).await;
                        let resp = hyper::Response::builder()
                            .status(200)
                            .header("x-backend", name.as_str())
                            .body(Full::new(Bytes::from(name)))
                            .expect("static response is well-formed");
                        Ok::<_, Infallible>(resp)
                    }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// One EDS endpoint with an explicit health status and optional weight.
pub fn lb_ep(addr: SocketAddr, health: EdsHealth, weight: Option<u32>) -> LbEndpoint {
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(socket_addr(&addr.ip().to_string(), addr.port())),
            ..Default::default()
        })),
        health_status: health as i32,
        load_balancing_weight: weight.map(|value| UInt32Value { value }),
        ..Default::default()
    }
}

/// A locality at `priority` holding `endpoints`.
pub fn locality_at(priority: u32, endpoints: Vec<LbEndpoint>) -> LocalityLbEndpoints {
    LocalityLbEndpoints {
        lb_endpoints: endpoints,
        priority,
        ..Default::default()
    }
}

pub fn cla_localities(
    cluster_name: &str,
    localities: Vec<LocalityLbEndpoints>,
) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster_name.to_string(),
        endpoints: localities,
        ..Default::default()
    }
}

impl AdsServer {
    /// Forgets everything stored for `type_url`: subscriptions to it get no
    /// response until the type is set again.
    pub fn clear_type(&self, type_url: &str) {
        self.shared
            .config
            .lock()
            .expect("ads config lock")
            .remove(type_url);
    }

    /// Number of requests logged so far (an index for `wait_for_nack_since`).
    pub fn log_len(&self) -> usize {
        self.shared.log.lock().expect("ads log lock").len()
    }

    /// Waits for a NACK of `type_url` logged at index `since` or later.
    pub async fn wait_for_nack_since(
        &self,
        type_url: &str,
        since: usize,
        timeout: Duration,
    ) -> LoggedRequest {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self
                .log()
                .into_iter()
                .skip(since)
                .find(|r| r.type_url == type_url && r.is_nack())
            {
                return r;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no NACK of {type_url} (after request #{since}) within {timeout:?}; last requests:{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Gateway {
    /// Launches the gateway against the ADS server on `ads_port` WITHOUT
    /// waiting for `/ready`.
    pub fn spawn(ads_port: u16) -> Gateway {
        let bin = gateway_bin();
        let dir = TempDir::new("portico-it");
        let admin_port = free_port();
        let bootstrap = dir.path.join("bootstrap.yaml");
        std::fs::write(&bootstrap, bootstrap_yaml(admin_port, ads_port)).expect("write bootstrap");
        let stderr_path = dir.path.join("gateway.stderr");
        let stderr = std::fs::File::create(&stderr_path).expect("create stderr file");
        let mut cmd = Command::new(&bin);
        cmd.arg("-c").arg(&bootstrap).args(["--concurrency", "1"]);
        if is_envoy(&bin) {
            cmd.arg("--disable-hot-restart");
        }
        cmd.args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                stderr.try_clone().expect("dup stderr file for stdout"),
            ))
            .stderr(Stdio::from(stderr));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn gateway {}: {e}", bin.display()));
        Gateway {
            child,
            admin_port,
            stderr_path,
            _dir: dir,
        }
    }

    /// The gateway's process id (to signal it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The gateway's resident memory now, in KiB (0 if unreadable).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Waits up to `limit` for the gateway to exit; its status, or None if it still runs.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// GET on the admin port.
    pub async fn admin_get(&self, path: &str) -> Resp {
        get(&self.admin_url(path), None, &[]).await
    }

    /// The first counter on `/stats` whose name ends with `suffix` (0 when there is none):
    /// for a filter's counter under whatever scope prefix the proxy gives it.
    pub async fn stat_ending(&self, suffix: &str) -> u64 {
        let body = self
            .admin_get(&format!("/stats?filter={}$", suffix.replace('.', "\\.")))
            .await
            .body;
        body.lines()
            .find_map(|l| l.split_once(": ").filter(|(n, _)| n.ends_with(suffix)))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// What a TCP connect to 127.0.0.1:`port` does: `Ok(())` when accepted,
/// otherwise the error kind (e.g. `ConnectionRefused`).
pub async fn tcp_connect(port: u16) -> Result<(), std::io::ErrorKind> {
    match tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.kind()),
        Err(_) => Err(std::io::ErrorKind::TimedOut),
    }
}

/// Sends `GET <path>` with `Connection: close` on a fresh connection and
/// returns the status line, or a description of what happened instead
/// ("refused", "no answer within ...", "closed without answer").
pub async fn probe_http(
    port: u16,
    host: &str,
    path: &str,
    wait: Duration,
) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err("refused".to_string())
        }
        Err(e) => return Err(format!("connect: {e}")),
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    if let Err(e) = stream.write_all(req.as_bytes()).await {
        return Err(format!("write: {e}"));
    }
    let mut buf = Vec::new();
    let read = tokio::time::timeout(wait, async {
        let mut chunk = [0u8; 1024];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) => return Ok(()),
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.windows(2).any(|w| w == b"\r\n") {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e),
            }
        }
    })
    .await;
    match read {
        Err(_) => Err(format!("no answer within {wait:?}")),
        Ok(Err(e)) => Err(format!("read: {e}")),
        Ok(Ok(())) if buf.is_empty() => Err("closed without answer".to_string()),
        Ok(Ok(())) => Ok(String::from_utf8_lossy(&buf)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()),
    }
}

// ===========================================================================
// END conformance_xds helpers
// ===========================================================================

// ===========================================================================
// BEGIN conformance_http helpers (appended for tests/conformance_http.rs)
// ===========================================================================

/// One request exactly as a `RawBackend` read it off the wire: header names
/// keep the case and order they were sent in, repeated headers stay separate.
#[derive(Clone, Debug)]
pub struct UpstreamRequest {
    pub method: String,
    pub target: String,
    pub version: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl UpstreamRequest {
    /// First value of `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Header names as sent, in order.
    pub fn names(&self) -> Vec<&str> {
        self.headers.iter().map(|(k, _)| k.as_str()).collect()
    }
}

struct RawBackendState {
    log: Mutex<Vec<UpstreamRequest>>,
    connections: AtomicUsize,
    /// Body bytes (as on the wire) received so far, by request target.
    body_progress: Mutex<HashMap<String, usize>>,
    release: tokio::sync::Notify,
}

/// A hand-written HTTP/1.1 upstream that records every request verbatim and
/// misbehaves on demand. What it answers depends on the request target:
///
/// * `/nolength…` 200 with no framing, body `close-delimited body`, then closes
/// * `/http10…` an `HTTP/1.0 200` close-delimited response, body `ten`
/// * `/chunked…` 200 chunked `hello world` (headers only for HEAD)
/// * `/100…`, `/103…` a 100 Continue / 103 Early Hints, then 200 `ok`
/// * `/204…`, `/304…` those statuses (with `x-mode: 204` / `etag: "v1"`)
/// * `/hop…` 200 `ok` carrying hop-by-hop headers, its own `Server` and `Date`
/// * `/dupresp…` repeated and mixed-case response headers
/// * `/status/<code>…` that status with the reason phrase `Whatever`, body `ok` (none for 204
///   and 304)
/// * `/upclose…` 200 `ok` with `connection: close`, then closes
/// * `/closemid…` promises 100 bytes, sends `partial`, closes
/// * `/badstatus…`, `/garbage…`, `/clte…`, `/badhdr…` malformed responses
/// * `/closenow…` closes without answering
/// * `/raw/<hex>` the bytes the hex spells, as they are, then closes
/// * `/fields/<n>` 200 `abc` with `n` header fields (`content-length` the last)
/// * `/bighead/<n>` 200 `abc` with `x-big:` `n` bytes long (and `content-length`)
/// * `/slow/<ms>…` waits `<ms>` then answers like the default
/// * `/stream-resp…` chunked: `part1`, then waits for `release()`, then `part2`
/// * `/body…` 200 with the request body as its body
/// * anything else: 200, `x-backend: raw`, body `raw-backend`
pub struct RawBackend {
    pub addr: SocketAddr,
    state: Arc<RawBackendState>,
    task: JoinHandle<()>,
}

impl RawBackend {
    pub async fn start() -> RawBackend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind raw backend");
        let addr = listener.local_addr().expect("raw backend addr");
        let state = Arc::new(RawBackendState {
            log: Mutex::new(Vec::new()),
            connections: AtomicUsize::new(0),
            body_progress: Mutex::new(HashMap::new()),
            release: tokio::sync::Notify::new(),
        });
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                st.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(raw_backend_conn(stream, st.clone()));
            }
        });
        RawBackend { addr, state, task }
    }

    pub fn requests(&self) -> Vec<UpstreamRequest> {
        self.state.log.lock().expect("raw backend log").clone()
    }

    /// The last request whose target is exactly `target`.
    pub fn request(&self, target: &str) -> Option<UpstreamRequest> {
        self.requests()
            .into_iter()
            .rev()
            .find(|r| r.target == target)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Body bytes received so far of the (last) request to `target`.
    pub fn body_progress(&self, target: &str) -> usize {
        self.state
            .body_progress
            .lock()
            .expect("raw backend progress")
            .get(target)
            .copied()
            .unwrap_or(0)
    }

    /// Lets a waiting `/stream-resp` finish.
    pub fn release(&self) {
        self.state.release.notify_one();
    }
}

impl Drop for RawBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A complete chunked body at the start of `data`: (decoded, bytes consumed).
fn dechunk_prefix(data: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let eol = at + find_bytes(&data[at..], b"\r\n")?;
        let line = String::from_utf8_lossy(&data[at..eol]).into_owned();
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).ok()?;
        at = eol + 2;
        if size == 0 {
            // Trailers end with an empty line.
            let end = at + find_bytes(&data[at..], b"\r\n")?;
            if end == at {
                return Some((out, at + 2));
            }
            let end = at + find_bytes(&data[at..], b"\r\n\r\n")?;
            return Some((out, end + 4));
        }
        if data.len() < at + size + 2 {
            return None;
        }
        out.extend_from_slice(&data[at..at + size]);
        at += size + 2;
    }
}

async fn raw_backend_conn(mut s: tokio::net::TcpStream, st: Arc<RawBackendState>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    macro_rules! read_more {
        () => {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
    }
    loop {
        let head_end = loop {
            if let Some(p) = find_bytes(&buf, b"\r\n\r\n") {
                break p;
            }
            read_more!();
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        buf.drain(..head_end + 4);
        let mut lines = head.split("\r\n");
        let mut start = lines.next().unwrap_or_default().splitn(3, ' ');
        let method = start.next().unwrap_or_default().to_string();
        let target = start.next().unwrap_or_default().to_string();
        let version = start.next().unwrap_or_default().to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect();
        let get = |n: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, v)| v.clone())
        };
        let chunked = get("transfer-encoding").is_some_and(|v| v.contains("chunked"));
        let length = get("content-length").and_then(|v| v.parse::<usize>().ok());
        let progress = |n: usize| {
            st.body_progress
                .lock()
                .expect("raw backend progress")
                .insert(target.clone(), n);
        };
        progress(0);
        let body = if chunked {
            loop {
                if let Some((body, used)) = dechunk_prefix(&buf) {
                    buf.drain(..used);
                    break body;
                }
                read_more!();
                progress(buf.len());
            }
        } else if let Some(n) = length {
            while buf.len() < n {
                progress(buf.len());
                read_more!();
            }
            progress(n);
            buf.drain(..n).collect()
        } else {
            Vec::new()
        };
        let head_only = method == "HEAD";
        st.log
            .lock()
            .expect("raw backend log")
            .push(UpstreamRequest {
                method,
                target: target.clone(),
                version,
                headers,
                body: body.clone(),
            });

        let plain = |extra: &str, body: &[u8]| -> Vec<u8> {
            let mut out = format!(
                "HTTP/1.1 200 OK\r\n{extra}content-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            if !head_only {
                out.extend_from_slice(body);
            }
            out
        };
        // (bytes to write, close afterwards)
        let number = |prefix: &str| -> Option<usize> { target.strip_prefix(prefix)?.parse().ok() };
        let (out, close): (Vec<u8>, bool) = if let Some(n) = number("/fields/") {
            let fields: String = (1..n).map(|i| format!("x-h{i}: v\r\n")).collect();
            (plain(&fields, b"abc"), false)
        } else if let Some(n) = number("/bighead/") {
            (
                plain(&format!("x-big: {}\r\n", "a".repeat(n)), b"abc"),
                false,
            )
        } else if let Some(hex) = target.strip_prefix("/raw/") {
            // Exactly the bytes the path spells in hex, then the connection closes.
            let out = (0..hex.len() / 2)
                .filter_map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
                .collect();
            (out, true)
        } else if target.starts_with("/nolength") {
            (
                b"HTTP/1.1 200 OK\r\nx-mode: nolength\r\n\r\nclose-delimited body".to_vec(),
                true,
            )
        } else if target.starts_with("/http10") {
            (
                b"HTTP/1.0 200 OK\r\nx-mode: http10\r\n\r\nten".to_vec(),
                true,
            )
        } else if target.starts_with("/chunked") {
            let mut out = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            if !head_only {
                out.extend_from_slice(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
            }
            (out, false)
        } else if target.starts_with("/100") {
            (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    .to_vec(),
                false,
            )
        } else if target.starts_with("/103") {
            (
                b"HTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    .to_vec(),
                false,
            )
        } else if target.starts_with("/204") {
            (
                b"HTTP/1.1 204 No Content\r\nx-mode: 204\r\n\r\n".to_vec(),
                false,
            )
        } else if target.starts_with("/304") {
            (
                b"HTTP/1.1 304 Not Modified\r\netag: \"v1\"\r\n\r\n".to_vec(),
                false,
            )
        } else if target.starts_with("/hop") {
            (
                plain(
                    "Connection: x-custom\r\nx-custom: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nUpgrade: foo\r\nte: trailers\r\nTrailer: x-t\r\nProxy-Authenticate: Basic\r\nx-other: kept\r\nServer: upstream-srv\r\nDate: Mon, 01 Jan 2001 00:00:00 GMT\r\n",
                    b"ok",
                ),
                false,
            )
        } else if let Some(code) = target
            .strip_prefix("/status/")
            .and_then(|t| t.get(..3))
            .and_then(|c| c.parse::<u16>().ok())
        {
            let body: &[u8] = if matches!(code, 204 | 304) || head_only {
                b""
            } else {
                b"ok"
            };
            let length = if matches!(code, 204 | 304) {
                String::new()
            } else {
                "content-length: 2\r\n".to_string()
            };
            let mut out = format!("HTTP/1.1 {code} Whatever\r\n{length}\r\n").into_bytes();
            out.extend_from_slice(body);
            (out, false)
        } else if target.starts_with("/dupresp") {
            (
                plain(
                    "x-dup: a\r\nx-mid: m\r\nx-dup: b\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-CamelCase: v\r\n",
                    b"ok",
                ),
                false,
            )
        } else if target.starts_with("/upclose") {
            (plain("connection: close\r\n", b"ok"), true)
        } else if target.starts_with("/closemid") {
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial".to_vec(),
                true,
            )
        } else if target.starts_with("/badstatus") {
            (
                b"HTTP/1.1 abc OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
                true,
            )
        } else if target.starts_with("/garbage") {
            (b"this is not http\r\n\r\n".to_vec(), true)
        } else if target.starts_with("/clte") {
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                    .to_vec(),
                true,
            )
        } else if target.starts_with("/badhdr") {
            (
                b"HTTP/1.1 200 OK\r\nx-bad: a\x01b\r\ncontent-length: 2\r\n\r\nok".to_vec(),
                true,
            )
        } else if target.starts_with("/closenow") {
            return;
        } else if target.starts_with("/stream-resp") {
            let first = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\npart1\r\n";
            if s.write_all(first).await.is_err() {
                return;
            }
            let _ = s.flush().await;
            let _ = tokio::time::timeout(Duration::from_secs(10), st.release.notified()).await;
            (b"5\r\npart2\r\n0\r\n\r\n".to_vec(), false)
        } else if target.starts_with("/body") {
            (
                plain("content-type: application/octet-stream\r\n", &body),
                false,
            )
        } else {
            if let Some(ms) = target
                .strip_prefix("/slow/")
                .and_then(|r| r.split(['/', '?']).next())
                .and_then(|ms| ms.parse::<u64>().ok())
            {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            (plain("x-backend: raw\r\n", b"raw-backend"), false)
        };
        if s.write_all(&out).await.is_err() {
            return;
        }
        if close {
            let _ = s.shutdown().await;
            return;
        }
    }
}

// ===========================================================================
// END conformance_http helpers
// ===========================================================================

// ===========================================================================
// BEGIN conformance_more helpers (appended for tests/conformance_more.rs)
// ===========================================================================

impl AdsServer {
    /// Replaces `type_url` with `resources` exactly as given and pushes. Each
    /// pair's name is only what the server filters RDS/EDS subscriptions on:
    /// the packed resource may carry another name, another type, a
    /// `discovery.v3.Resource` envelope, or the same name twice.
    pub fn set_type_raw(&self, type_url: &str, version: &str, resources: Vec<(String, Any)>) {
        self.set_type(type_url, version, resources);
    }
}

/// An HTTP/1.1 upstream answering `/status/<code>…` with that status and
/// anything else with 200; every answer carries `x-backend` and
/// `x-echo-path`, and the backend's name as body.
pub struct StatusBackend {
    pub name: String,
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl StatusBackend {
    pub async fn start(name: &str) -> StatusBackend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind status backend");
        let addr = listener.local_addr().expect("status backend addr");
        let label = name.to_string();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let label = label.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let label = label.clone();
                            async move {
                                let status = req
                                    .uri()
                                    .path()
                                    .strip_prefix("/status/")
                                    .and_then(|r| r.split('/').next())
                                    .and_then(|c| c.parse::<u16>().ok())
                                    .unwrap_or(200);
                                let resp = hyper::Response::builder()
                                    .status(status)
                                    .header("x-backend", label.as_str())
                                    .header("x-echo-path", req.uri().to_string())
                                    .body(Full::new(Bytes::from(label)))
                                    .expect("status response is well-formed");
                                Ok::<_, Infallible>(resp)
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        StatusBackend {
            name: name.to_string(),
            addr,
            task,
        }
    }
}

impl Drop for StatusBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ===========================================================================
// END conformance_more helpers
// ===========================================================================

// ---------------------------------------------------------------------------
// Table-driven checks shared by the conformance suites
// ---------------------------------------------------------------------------

/// Collects every mismatch of a table so one run reports all differences. `gaps` lists known,
/// documented differences of Portico from Envoy (a mismatch prefix and the reason): they are
/// printed, not failed, when Portico is under test; against Envoy every case counts.
#[derive(Default)]
pub struct Checks {
    mismatches: Vec<String>,
    gaps: &'static [(&'static str, &'static str)],
}

impl Checks {
    pub fn with_gaps(gaps: &'static [(&'static str, &'static str)]) -> Checks {
        Checks {
            mismatches: Vec::new(),
            gaps,
        }
    }

    pub fn eq<T: PartialEq + std::fmt::Debug>(
        &mut self,
        what: impl std::fmt::Display,
        got: T,
        want: T,
    ) {
        if got != want {
            self.mismatches
                .push(format!("{what}: got {got:?}, want {want:?}"));
        }
    }

    pub fn ok(&mut self, what: impl std::fmt::Display, cond: bool, detail: impl std::fmt::Debug) {
        if !cond {
            self.mismatches.push(format!("{what}: {detail:?}"));
        }
    }

    pub fn finish(self) {
        let envoy = is_envoy(&gateway_bin());
        let gaps = self.gaps;
        let (known, real): (Vec<String>, Vec<String>) = self
            .mismatches
            .into_iter()
            .partition(|m| !envoy && gaps.iter().any(|(prefix, _)| m.starts_with(prefix)));
        for g in &known {
            eprintln!("known Portico gap: {g}");
        }
        assert!(
            real.is_empty(),
            "{} mismatch(es):\n  {}",
            real.len(),
            real.join("\n  ")
        );
    }
}

/// A UUID in its 8-4-4-4-12 hex form (Envoy's x-request-id).
pub fn is_uuid(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.iter().map(|p| p.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
        && parts
            .iter()
            .all(|p| p.chars().all(|c| c.is_ascii_hexdigit()))
}

/// Whether `ip` is an address of this host (binding to it succeeds).
pub fn is_local_address(ip: &str) -> bool {
    ip.parse::<std::net::IpAddr>()
        .map(|ip| StdTcpListener::bind((ip, 0)).is_ok())
        .unwrap_or(false)
}

// ===========================================================================
// Scripted backends (misbehaving on purpose), for the traffic-policy tests
// ===========================================================================

/// What the backend does with its n-th request (the last entry repeats).
#[derive(Clone, Copy, Debug)]
pub enum Step {
    Status(u16),
    /// Waits this long, then answers 200.
    Hang(Duration),
    /// Reads the request and closes the connection without answering.
    Close,
}

/// One request as the backend saw it: its `x-envoy-attempt-count` and its body.
pub type Seen = (Option<String>, String);

/// A raw HTTP/1.1 backend following a script; it records each request's attempt-count header
/// and body.
pub struct Scripted {
    pub addr: std::net::SocketAddr,
    pub served: Arc<AtomicUsize>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Each request's head, header names lowercased.
    pub heads: Arc<Mutex<Vec<String>>>,
    /// Connections accepted.
    pub connections: Arc<AtomicUsize>,
}

impl Scripted {
    pub async fn start(name: &'static str, script: Vec<Step>) -> Scripted {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let served = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (s, sn, hd) = (served.clone(), seen.clone(), heads.clone());
        let connections = Arc::new(AtomicUsize::new(0));
        let cx = connections.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    continue;
                };
                cx.fetch_add(1, Ordering::SeqCst);
                let (s, sn, hd, script) = (s.clone(), sn.clone(), hd.clone(), script.clone());
                tokio::spawn(async move {
                    loop {
                        let Some((head, body)) = read_request(&mut sock).await else {
                            return;
                        };
                        let n = s.fetch_add(1, Ordering::SeqCst);
                        let attempt = head
                            .lines()
                            .find_map(|l| l.strip_prefix("x-envoy-attempt-count: "))
                            .map(str::to_string);
                        sn.lock().expect("lock").push((attempt, body));
                        hd.lock().expect("lock").push(head);
                        let step = script[n.min(script.len() - 1)];
                        let status = match step {
                            Step::Status(c) => c,
                            Step::Hang(d) => {
                                tokio::time::sleep(d).await;
                                200
                            }
                            Step::Close => return,
                        };
                        let resp = format!(
                            "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nx-backend: {name}\r\n\r\n{name}",
                            name.len()
                        );
                        if tokio::io::AsyncWriteExt::write_all(&mut sock, resp.as_bytes())
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        Scripted {
            addr,
            served,
            seen,
            heads,
            connections,
        }
    }

    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    pub fn reset(&self) {
        self.connections.store(0, Ordering::SeqCst);
        self.served.store(0, Ordering::SeqCst);
        self.seen.lock().expect("lock").clear();
        self.heads.lock().expect("lock").clear();
    }
}

/// One request head (lowercased header names) and its content-length body.
pub async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<(String, String)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::io::AsyncReadExt::read(sock, &mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head: String = String::from_utf8_lossy(&buf[..end])
        .lines()
        .map(|l| match l.split_once(':') {
            Some((k, v)) => format!("{}:{v}\n", k.to_ascii_lowercase()),
            None => format!("{l}\n"),
        })
        .collect();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = buf[end..].to_vec();
    while body.len() < len {
        let n = tokio::io::AsyncReadExt::read(sock, &mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((head, String::from_utf8_lossy(&body).into_owned()))
}

// ---------------------------------------------------------------------------
// Small HTTP/1 servers for the policy tests
// ---------------------------------------------------------------------------

/// An HTTP/1 server on a free port answering every request with `f`.
pub async fn serve_fn(
    f: impl Fn(&hyper::Request<hyper::body::Incoming>) -> hyper::Response<Full<Bytes>>
        + Send
        + Sync
        + Clone
        + 'static,
) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let f = f.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let r = f(&req);
                    async move { Ok::<_, Infallible>(r) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// A backend that answers 200 with every request header as `x-req-<name>`.
pub async fn header_echo() -> SocketAddr {
    serve_fn(|req| {
        let mut b = hyper::Response::builder().status(200);
        for (k, v) in req.headers() {
            b = b.header(format!("x-req-{k}"), v.clone());
        }
        b.body(Full::new(Bytes::from_static(b"web")))
            .expect("response")
    })
    .await
}
