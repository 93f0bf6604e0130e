//! The control plane's ADS server: state-of-the-world `StreamAggregatedResources`, answering
//! as istiod answers a gateway.
//!
//! One [`Generation`] is current at a time (the config of one reload, with its push version);
//! each stream translates it for its node (cached per labels and namespace, so a fleet of
//! identical gateways costs one translation) and, when a new generation is published, pushes
//! only the types whose resources changed for it, in istiod's order: CDS, EDS, LDS, RDS.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;

use super::{Config, Invalid, NodeInfo, Options, Xds};
use crate::xds::types;

/// istiod's push order: clusters and their endpoints before the listeners and routes that
/// may reference them, so a gateway never routes to a cluster it has not heard of; secrets
/// last (a listener names them, and waits for them).
const PUSH_ORDER: [&str; 5] = [
    types::CLUSTER,
    types::ENDPOINT,
    types::LISTENER,
    types::ROUTE,
    types::SECRET,
];

type Source = dyn Fn(&NodeInfo) -> (Xds, Vec<Invalid>) + Send + Sync;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot read config directory {}: {error}", dir.display())]
    ConfigDir {
        dir: std::path::PathBuf,
        error: std::io::Error,
    },
    #[error("cannot listen on {addr}: {error}")]
    Bind {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("ADS server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("ADS server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// One published config: the push version and the xDS of every gateway for it.
pub struct Generation {
    pub version: String,
    source: Box<Source>,
    cache: Mutex<HashMap<NodeInfo, Arc<Xds>>>,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl Generation {
    /// A generation whose xDS comes from `source` (tests serve fixed resources this way).
    pub fn new(
        version: impl Into<String>,
        source: impl Fn(&NodeInfo) -> (Xds, Vec<Invalid>) + Send + Sync + 'static,
    ) -> Generation {
        Generation {
            version: version.into(),
            source: Box::new(source),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The generation serving `config` through the Istio translation.
    pub fn from_config(version: impl Into<String>, config: Config, options: Options) -> Generation {
        Generation::new(version, move |node| {
            super::translate(&config, node, &options)
        })
    }

    /// The xDS for `node`, translated on first use. Objects the translation leaves out are
    /// logged then, once per generation and gateway kind.
    pub fn xds_for(&self, node: &NodeInfo) -> Arc<Xds> {
        // istiod's gateway config depends on the gateway's labels and namespace, not on which
        // pod asks: the id stays out of the key and out of the translation.
        let key = NodeInfo {
            id: String::new(),
            ..node.clone()
        };
        // Held while translating so gateways connecting together wait for one translation.
        let mut cache = lock(&self.cache);
        if let Some(xds) = cache.get(&key) {
            return xds.clone();
        }
        let (xds, invalid) = (self.source)(&key);
        for i in &invalid {
            tracing::warn!(version = %self.version, gateway = %labels_text(&key.labels), "invalid: {i}");
        }
        let xds = Arc::new(xds);
        cache.insert(key, xds.clone());
        xds
    }
}

/// [`Generation::xds_for`] off the async workers: a translation can take a while (seconds
/// for a large config in a debug build) and must not stall the other streams meanwhile.
async fn translated(generation: &Arc<Generation>, node: &NodeInfo) -> Result<Arc<Xds>, End> {
    let (generation, node) = (generation.clone(), node.clone());
    tokio::task::spawn_blocking(move || generation.xds_for(&node))
        .await
        .map_err(|e| {
            // Ending the stream keeps the gateway on its last good config; an empty answer
            // would take its routes away.
            tracing::error!("translation failed: {e}");
            End::Error(tonic::Status::internal(format!("translation failed: {e}")))
        })
}

/// `k=v,k=v`, for logs.
pub fn labels_text(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing holding these locks leaves them half-updated, so a panic elsewhere is no reason
    // to stop serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The current generation and the gateways that have asked for it; cheap to clone.
#[derive(Clone)]
pub struct ControlPlane {
    current: watch::Sender<Arc<Generation>>,
    stopping: watch::Sender<bool>,
    nodes: Arc<Mutex<BTreeSet<NodeInfo>>>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("version", &self.current().version)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    pub fn new(first: Generation) -> ControlPlane {
        ControlPlane {
            current: watch::Sender::new(Arc::new(first)),
            stopping: watch::Sender::new(false),
            nodes: Arc::default(),
        }
    }

    /// Makes `next` current; every open stream pushes what changed for its gateway.
    pub fn publish(&self, next: Generation) {
        self.current.send_replace(Arc::new(next));
    }

    pub fn current(&self) -> Arc<Generation> {
        self.current.borrow().clone()
    }

    /// The kinds of gateway (labels and namespace, id left out) that have connected so far.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        lock(&self.nodes).iter().cloned().collect()
    }

    /// Ends every open stream (the gateways see UNAVAILABLE and reconnect elsewhere) and
    /// lets [`ControlPlane::serve`] return.
    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves once [`ControlPlane::stop`] was called.
    pub async fn stopped(&self) {
        until_true(&mut self.stopping.subscribe()).await;
    }

    /// The tonic service, for a server built elsewhere.
    pub fn service(&self) -> AggregatedDiscoveryServiceServer<AdsService> {
        AggregatedDiscoveryServiceServer::new(AdsService { cp: self.clone() })
            .max_encoding_message_size(usize::MAX)
    }

    /// Serves ADS on `listener` until `shutdown` resolves or [`ControlPlane::stop`] is called.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let cp = self.clone();
        // Open streams never end on their own: tonic's graceful shutdown would wait for them
        // forever, so they are told to end first.
        let stop = async move {
            tokio::select! {
                () = shutdown => cp.stop(),
                () = cp.stopped() => {}
            }
        };
        tonic::transport::Server::builder()
            .add_service(self.service())
            .serve_with_incoming_shutdown(incoming, stop)
            .await?;
        Ok(())
    }
}

/// A control plane serving in the background (see [`spawn`]).
#[derive(Debug)]
pub struct Running {
    pub local_addr: SocketAddr,
    pub control_plane: ControlPlane,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Running {
    /// Stops serving and watching and waits for the server to wind down.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        self.control_plane.stop();
        self.task.await?
    }

    /// Resolves when the server ends by itself (an error) or after [`ControlPlane::stop`].
    pub async fn wait(self) -> Result<(), ServeError> {
        self.task.await?
    }
}

/// Loads `dir`, binds `listen` and serves its config over ADS in the background, reloading
/// when a file changes. Fails before anything is served if the directory cannot be read or
/// the address cannot be bound.
pub async fn spawn(
    dir: &Path,
    listen: SocketAddr,
    options: Options,
) -> Result<Running, ServeError> {
    let (watcher, first) =
        super::watch::DirWatch::open(dir, options).map_err(|error| ServeError::ConfigDir {
            dir: dir.to_path_buf(),
            error,
        })?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|error| ServeError::Bind {
            addr: listen,
            error,
        })?;
    let local_addr = listener.local_addr().map_err(|error| ServeError::Bind {
        addr: listen,
        error,
    })?;
    let cp = ControlPlane::new(first);
    tracing::info!(addr = %local_addr, dir = %dir.display(), "control plane serving ADS");
    tokio::spawn(watcher.run(cp.clone()));
    let server = cp.clone();
    let task = tokio::spawn(async move {
        let res = server.serve(listener, std::future::pending()).await;
        server.stop();
        res
    });
    Ok(Running {
        local_addr,
        control_plane: cp,
        task,
    })
}

/// Serves `dir` over ADS on `listen` until `shutdown` resolves.
pub async fn serve(
    dir: &Path,
    listen: SocketAddr,
    options: Options,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let running = spawn(dir, listen, options).await?;
    let cp = running.control_plane.clone();
    tokio::select! {
        () = shutdown => running.shutdown().await,
        () = cp.stopped() => running.wait().await,
    }
}

pub struct AdsService {
    cp: ControlPlane,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, tonic::Status>> + Send>>;
type DeltaStream =
    Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, tonic::Status>> + Send>>;
type Tx = mpsc::Sender<Result<DiscoveryResponse, tonic::Status>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsService {
    type StreamAggregatedResourcesStream = ResponseStream;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<ResponseStream>, tonic::Status> {
        let peer = request.remote_addr();
        let (tx, rx) = mpsc::channel(16);
        let stream = AdsStream {
            cp: self.cp.clone(),
            generation: self.cp.current.subscribe(),
            tx,
            node: None,
            xds: Arc::default(),
            version: String::new(),
            subs: BTreeMap::new(),
        };
        tokio::spawn(stream.run(request.into_inner(), peer));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type DeltaAggregatedResourcesStream = DeltaStream;

    async fn delta_aggregated_resources(
        &self,
        _request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<DeltaStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "portico control-plane serves state-of-the-world ADS only \
             (StreamAggregatedResources); configure the gateway without delta xDS",
        ))
    }
}

/// What one stream has asked for and been sent, per type URL.
#[derive(Default)]
struct Sub {
    names: BTreeSet<String>,
    /// The nonce of the last response; a request carrying another one is stale.
    nonce: String,
    /// What the last response held, to push only what changed.
    sent: BTreeMap<String, Any>,
}

struct AdsStream {
    cp: ControlPlane,
    generation: watch::Receiver<Arc<Generation>>,
    tx: Tx,
    node: Option<NodeInfo>,
    xds: Arc<Xds>,
    version: String,
    subs: BTreeMap<String, Sub>,
}

/// Why a stream ends.
enum End {
    /// The gateway closed it or went away.
    Gone,
    Error(tonic::Status),
}

impl AdsStream {
    async fn run(
        mut self,
        mut inbound: tonic::Streaming<DiscoveryRequest>,
        peer: Option<SocketAddr>,
    ) {
        let mut stopping = self.cp.stopping.subscribe();
        let end = loop {
            let step = tokio::select! {
                () = until_true(&mut stopping) => Err(End::Error(tonic::Status::unavailable("control plane stopping"))),
                msg = inbound.message() => match msg {
                    Ok(Some(req)) => self.on_request(req).await,
                    Ok(None) => Err(End::Gone),
                    Err(status) => {
                        tracing::debug!(?peer, "ADS stream error: {status}");
                        Err(End::Gone)
                    }
                },
                changed = self.generation.changed() => match changed {
                    Ok(()) => self.on_generation().await,
                    Err(_) => Err(End::Error(tonic::Status::unavailable("control plane stopping"))),
                },
            };
            if let Err(end) = step {
                break end;
            }
        };
        let id = self.node.as_ref().map(|n| n.id.as_str()).unwrap_or("");
        match end {
            End::Gone => tracing::info!(node = id, ?peer, "gateway disconnected"),
            End::Error(status) => {
                tracing::info!(node = id, ?peer, "closing ADS stream: {}", status.message());
                let _ = self.tx.send(Err(status)).await;
            }
        }
    }

    async fn on_request(&mut self, req: DiscoveryRequest) -> Result<(), End> {
        if self.node.is_none() {
            let Some(node) = &req.node else {
                return Err(End::Error(tonic::Status::invalid_argument(
                    "the first DiscoveryRequest of a stream must carry the node",
                )));
            };
            let info = NodeInfo::from_node(node);
            tracing::info!(node = %info.id, labels = %labels_text(&info.labels), "gateway connected");
            lock(&self.cp.nodes).insert(NodeInfo {
                id: String::new(),
                ..info.clone()
            });
            let generation = self.generation.borrow_and_update().clone();
            self.xds = translated(&generation, &info).await?;
            self.version = generation.version.clone();
            self.node = Some(info);
        }
        let id = self.node.as_ref().map(|n| n.id.as_str()).unwrap_or("");
        let type_url = req.type_url.as_str();
        if let Some(error) = &req.error_detail {
            tracing::warn!(
                node = id,
                type_url,
                version = %req.version_info,
                nonce = %req.response_nonce,
                "gateway rejected the config (NACK): {}",
                error.message
            );
            return Ok(());
        }
        let names: BTreeSet<String> = req.resource_names.iter().cloned().collect();
        let served = self.xds.by_type(type_url).is_some();
        let send = match self.subs.get_mut(type_url) {
            None => {
                if !served {
                    // Envoy accepts an empty answer and keeps waiting for the named resources
                    // (e.g. SDS secrets); silence would leave the type without an ACK.
                    tracing::debug!(node = id, type_url, "type not served: answering empty");
                }
                self.subs.insert(
                    type_url.to_string(),
                    Sub {
                        names,
                        ..Sub::default()
                    },
                );
                true
            }
            Some(sub) if !req.response_nonce.is_empty() && req.response_nonce != sub.nonce => {
                // Answers a response older than the last one sent, which is already on its way
                // with the same or newer content: the gateway will answer that one too.
                tracing::debug!(node = id, type_url, nonce = %req.response_nonce, "stale nonce, ignored");
                false
            }
            // An empty nonce on a known type: the gateway asks afresh (e.g. after it dropped
            // and re-added the subscription), so it gets the full current state.
            Some(sub) if req.response_nonce.is_empty() => {
                sub.names = names;
                true
            }
            // An ACK. Only the names can ask for something new; config changes are pushed
            // when they are published, not when acknowledged.
            Some(sub) => {
                let changed = !is_wildcard(type_url) && sub.names != names;
                sub.names = names;
                changed
            }
        };
        if send {
            self.send(type_url).await?;
        }
        Ok(())
    }

    async fn on_generation(&mut self) -> Result<(), End> {
        let generation = self.generation.borrow_and_update().clone();
        let Some(node) = &self.node else {
            return Ok(());
        };
        self.xds = translated(&generation, node).await?;
        self.version = generation.version.clone();
        for type_url in PUSH_ORDER {
            let Some(sub) = self.subs.get(type_url) else {
                continue;
            };
            let now = self.select(type_url, &sub.names);
            if is_wildcard(type_url) {
                if !same_resources(&now, &sub.sent) {
                    self.send(type_url).await?;
                }
                continue;
            }
            // RDS and EDS: a gateway keeps what a response leaves out, so only the resources
            // that changed (or appeared) travel, as istiod's incremental EDS pushes.
            let changed: BTreeMap<String, Any> = now
                .iter()
                .filter(|(n, a)| sub.sent.get(*n).is_none_or(|b| !same_resource(a, b)))
                .map(|(n, a)| (n.clone(), a.clone()))
                .collect();
            if !changed.is_empty() {
                self.send_some(type_url, changed, now).await?;
            }
        }
        Ok(())
    }

    fn xds_by_type(&self, type_url: &str) -> Option<&BTreeMap<String, Any>> {
        self.xds.by_type(type_url)
    }

    /// What a response of `type_url` holds for `names`: the whole set for LDS and CDS, the
    /// named resources that exist for the others, nothing for types not served.
    fn select(&self, type_url: &str, names: &BTreeSet<String>) -> BTreeMap<String, Any> {
        match self.xds_by_type(type_url) {
            None => BTreeMap::new(),
            Some(all) if is_wildcard(type_url) => all.clone(),
            Some(all) => names
                .iter()
                .filter_map(|n| all.get(n).map(|a| (n.clone(), a.clone())))
                .collect(),
        }
    }

    async fn send(&mut self, type_url: &str) -> Result<(), End> {
        let names = self
            .subs
            .get(type_url)
            .map(|s| s.names.clone())
            .unwrap_or_default();
        let resources = self.select(type_url, &names);
        self.send_some(type_url, resources.clone(), resources).await
    }

    /// Sends `resources`; `now` is everything the gateway holds of the type afterwards.
    async fn send_some(
        &mut self,
        type_url: &str,
        resources: BTreeMap<String, Any>,
        now: BTreeMap<String, Any>,
    ) -> Result<(), End> {
        let nonce = next_nonce();
        let response = DiscoveryResponse {
            version_info: self.version.clone(),
            resources: resources.values().cloned().collect(),
            type_url: type_url.to_string(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        let sub = self.subs.entry(type_url.to_string()).or_default();
        sub.nonce = nonce;
        sub.sent = now;
        tracing::debug!(
            node = self.node.as_ref().map(|n| n.id.as_str()).unwrap_or(""),
            type_url,
            version = %response.version_info,
            resources = response.resources.len(),
            "push"
        );
        self.tx.send(Ok(response)).await.map_err(|_| End::Gone)
    }
}

/// Resolves once `rx` holds true; the borrow guard is not `Send`, so it must not outlive this.
async fn until_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

fn is_wildcard(type_url: &str) -> bool {
    type_url == types::LISTENER || type_url == types::CLUSTER
}

/// Unique across streams and across restarts of the control plane, so a gateway that
/// reconnects to a new instance never has an old nonce mistaken for a current one.
fn next_nonce() -> String {
    static PREFIX: OnceLock<u32> = OnceLock::new();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let prefix = PREFIX.get_or_init(|| fastrand::u32(..));
    format!("{prefix:08x}-{}", SEQ.fetch_add(1, Ordering::Relaxed) + 1)
}

fn same_resources(a: &BTreeMap<String, Any>, b: &BTreeMap<String, Any>) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|((na, ra), (nb, rb))| na == nb && same_resource(ra, rb))
}

/// Equal encodings are the same resource. Different encodings may still be: prost writes
/// map fields (metadata, typed_per_filter_config) in HashMap order, which differs between
/// two translations of the same config, so those are decoded and compared as messages.
fn same_resource(a: &Any, b: &Any) -> bool {
    fn decoded_eq<M: Message + Default + PartialEq>(a: &[u8], b: &[u8]) -> bool {
        matches!((M::decode(a), M::decode(b)), (Ok(x), Ok(y)) if x == y)
    }
    if a == b {
        return true;
    }
    if a.type_url != b.type_url {
        return false;
    }
    match a.type_url.as_str() {
        types::LISTENER => decoded_eq::<Listener>(&a.value, &b.value),
        types::ROUTE => decoded_eq::<RouteConfiguration>(&a.value, &b.value),
        types::CLUSTER => decoded_eq::<Cluster>(&a.value, &b.value),
        types::ENDPOINT => decoded_eq::<ClusterLoadAssignment>(&a.value, &b.value),
        types::SECRET => decoded_eq::<Secret>(&a.value, &b.value),
        _ => false,
    }
}

/// A push version as istiod writes them: the time of the reload and a counter.
pub fn push_version(counter: u64) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    format!("{}/{counter}", rfc3339(secs))
}

/// `secs` since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (Howard Hinnant's civil-from-days).
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;
