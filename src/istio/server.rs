//! The control plane's ADS server: state-of-the-world `StreamAggregatedResources` and
//! incremental `DeltaAggregatedResources` on the same port, answering as istiod answers a
//! gateway.
//!
//! One [`Generation`] is current at a time (the config of one reload, with its push version);
//! each stream translates it for its node (cached per labels and namespace, so a fleet of
//! identical gateways costs one translation) and, when a new generation is published, pushes
//! only what changed for it, in istiod's order: CDS, EDS, LDS, RDS, SDS. Both protocols share
//! the stream loop and the bookkeeping ([`Conn`], [`Sub`]); they differ in what a response
//! carries (the whole set of a type, or the changed resources and the names removed).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
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
    cache: Mutex<HashMap<NodeInfo, Arc<Served>>>,
}

/// One gateway's xDS for one generation, with the version of each resource: a hash of its
/// content, so an unchanged resource keeps its version across reloads and restarts (what
/// delta xDS compares with the versions a reconnecting gateway reports).
pub struct Served {
    pub xds: Arc<Xds>,
    /// Type URL -> resource name -> version.
    versions: HashMap<&'static str, BTreeMap<String, String>>,
}

impl Served {
    fn new(xds: Xds) -> Served {
        // Every version goes through the descriptor pool: one stays alive for the batch.
        let _pool = crate::protojson::pool();
        let versions = PUSH_ORDER
            .iter()
            .map(|t| {
                let of_type = xds
                    .by_type(t)
                    .into_iter()
                    .flatten()
                    .map(|(name, any)| (name.clone(), resource_version(any)))
                    .collect();
                (*t, of_type)
            })
            .collect();
        Served {
            xds: Arc::new(xds),
            versions,
        }
    }

    /// The version of resource `name` of `type_url`, if it exists.
    pub fn version(&self, type_url: &str, name: &str) -> Option<&str> {
        self.versions
            .get(type_url)
            .and_then(|v| v.get(name))
            .map(String::as_str)
    }

    /// Every resource of `type_url` with its version (empty for a type not served).
    fn of_type(&self, type_url: &str) -> impl Iterator<Item = (&String, &String)> {
        self.versions.get(type_url).into_iter().flatten()
    }

    fn resource(&self, type_url: &str, name: &str) -> Option<&Any> {
        self.xds.by_type(type_url).and_then(|m| m.get(name))
    }
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
        self.served_for(node).xds.clone()
    }

    /// [`Generation::xds_for`] with the version of each resource.
    pub fn served_for(&self, node: &NodeInfo) -> Arc<Served> {
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
        let served = Arc::new(Served::new(xds));
        cache.insert(key, served.clone());
        served
    }
}

/// [`Generation::served_for`] off the async workers: a translation can take a while (seconds
/// for a large config in a debug build) and must not stall the other streams meanwhile.
async fn translated(generation: &Arc<Generation>, node: &NodeInfo) -> Result<Arc<Served>, End> {
    let (generation, node) = (generation.clone(), node.clone());
    tokio::task::spawn_blocking(move || generation.served_for(&node))
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
    /// Resources sent so far, per type in [`PUSH_ORDER`], over both protocols.
    sent: Arc<[AtomicU64; PUSH_ORDER.len()]>,
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
            sent: Arc::default(),
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

    /// How many resources of `type_url` the streams have sent so far (each resource of each
    /// response counts; removals do not).
    pub fn resources_sent(&self, type_url: &str) -> u64 {
        PUSH_ORDER
            .iter()
            .position(|t| *t == type_url)
            .map_or(0, |i| self.sent[i].load(Ordering::Relaxed))
    }

    fn count_sent(&self, type_url: &str, n: usize) {
        if let Some(i) = PUSH_ORDER.iter().position(|t| *t == type_url) {
            self.sent[i].fetch_add(n as u64, Ordering::Relaxed);
        }
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
type Tx<R> = mpsc::Sender<Result<R, tonic::Status>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsService {
    type StreamAggregatedResourcesStream = ResponseStream;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<ResponseStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(self.open(request))))
    }

    type DeltaAggregatedResourcesStream = DeltaStream;

    async fn delta_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<DeltaStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(self.open(request))))
    }
}

impl AdsService {
    /// Serves one stream of either protocol in its own task; the responses, as tonic wants them.
    fn open<R>(
        &self,
        request: tonic::Request<tonic::Streaming<<AdsStream<R> as Protocol>::Request>>,
    ) -> ReceiverStream<Result<R, tonic::Status>>
    where
        R: Send + 'static,
        AdsStream<R>: Protocol,
    {
        let (tx, rx) = mpsc::channel(16);
        let stream = AdsStream {
            conn: Conn::new(&self.cp),
            tx,
        };
        let peer = request.remote_addr();
        tokio::spawn(run(stream, request.into_inner(), peer));
        ReceiverStream::new(rx)
    }
}

/// What one stream has asked for and been sent, for one type URL.
#[derive(Debug, Default, Clone, PartialEq)]
struct Sub {
    /// Every resource of the type, whatever the names (LDS and CDS).
    wildcard: bool,
    /// The names asked for explicitly.
    names: BTreeSet<String>,
    /// The nonce of the last response; a request carrying another one is stale.
    nonce: String,
    /// What the gateway holds, by name, with the version it was sent (or reported on
    /// reconnecting): the base every push is computed against.
    sent: BTreeMap<String, String>,
}

/// How the resources the gateway should hold differ from what it holds.
#[derive(Debug, Default, PartialEq)]
struct Diff {
    /// Wanted and new, or with another version than the one sent.
    changed: Vec<String>,
    /// Held by the gateway but gone from the config, or no longer wanted.
    gone: Vec<String>,
}

impl Sub {
    fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    /// The resources of `type_url` in `served` this subscription covers, with versions.
    fn wanted<'a>(
        &'a self,
        served: &'a Served,
        type_url: &'a str,
    ) -> Box<dyn Iterator<Item = (&'a String, &'a String)> + 'a> {
        if self.wildcard {
            Box::new(served.of_type(type_url))
        } else {
            Box::new(self.names.iter().filter_map(move |n| {
                served
                    .versions
                    .get(type_url)
                    .and_then(|v| v.get_key_value(n))
            }))
        }
    }

    fn diff(&self, served: &Served, type_url: &str) -> Diff {
        let changed = self
            .wanted(served, type_url)
            .filter(|(n, v)| self.sent.get(*n) != Some(*v))
            .map(|(n, _)| n.clone())
            .collect();
        let gone = self
            .sent
            .keys()
            .filter(|n| !self.wants(n) || served.version(type_url, n).is_none())
            .cloned()
            .collect();
        Diff { changed, gone }
    }
}

/// The part of an ADS stream both protocols share: the gateway, the generation it is served
/// from, and the subscriptions.
struct Conn {
    cp: ControlPlane,
    generation: watch::Receiver<Arc<Generation>>,
    node: Option<NodeInfo>,
    served: Arc<Served>,
    version: String,
    subs: BTreeMap<String, Sub>,
}

impl Conn {
    fn new(cp: &ControlPlane) -> Conn {
        Conn {
            cp: cp.clone(),
            generation: cp.current.subscribe(),
            node: None,
            // Nothing until the gateway says who it is (no descriptor pool needed for that).
            served: Arc::new(Served {
                xds: Arc::default(),
                versions: HashMap::new(),
            }),
            version: String::new(),
            subs: BTreeMap::new(),
        }
    }

    fn id(&self) -> &str {
        self.node.as_ref().map(|n| n.id.as_str()).unwrap_or("")
    }

    /// Learns the gateway from the first request of the stream (the node goes on the first
    /// request only) and translates the current generation for it.
    async fn hello(&mut self, node: Option<&Node>) -> Result<(), End> {
        if self.node.is_some() {
            return Ok(());
        }
        let Some(node) = node else {
            return Err(End::Error(tonic::Status::invalid_argument(
                "the first request of a stream must carry the node",
            )));
        };
        let info = NodeInfo::from_node(node);
        tracing::info!(node = %info.id, labels = %labels_text(&info.labels), "gateway connected");
        lock(&self.cp.nodes).insert(NodeInfo {
            id: String::new(),
            ..info.clone()
        });
        let generation = self.generation.borrow_and_update().clone();
        self.served = translated(&generation, &info).await?;
        self.version = generation.version.clone();
        self.node = Some(info);
        Ok(())
    }

    /// Moves to the newly published generation and says, per subscribed type in push
    /// order, how what the gateway holds differs from it (whether the subscription is a
    /// wildcard, and the diff). Nothing before the gateway said who it is.
    async fn changes(&mut self) -> Result<Vec<(&'static str, bool, Diff)>, End> {
        let generation = self.generation.borrow_and_update().clone();
        let Some(node) = &self.node else {
            return Ok(Vec::new());
        };
        self.served = translated(&generation, node).await?;
        self.version = generation.version.clone();
        Ok(PUSH_ORDER
            .iter()
            .filter_map(|t| {
                let sub = self.subs.get(*t)?;
                Some((*t, sub.wildcard, sub.diff(&self.served, t)))
            })
            .collect())
    }

    /// A rejection is the gateway's to report; the stream keeps serving.
    fn nack(&self, type_url: &str, nonce: &str, message: &str) {
        tracing::warn!(
            node = self.id(),
            type_url,
            nonce,
            "gateway rejected the config (NACK): {message}"
        );
    }

    /// True if a request answering `nonce` answers the last response of `type_url`: an older
    /// one was overtaken by a response already on its way, which the gateway answers too.
    fn is_current(&self, type_url: &str, nonce: &str) -> bool {
        let current = self.subs.get(type_url).is_none_or(|s| s.nonce == nonce);
        if !current {
            tracing::debug!(node = self.id(), type_url, nonce, "stale nonce, ignored");
        }
        current
    }

    /// Records a response of `type_url`: its nonce, and the versions the gateway now holds.
    fn sent(&mut self, type_url: &str, nonce: String, holds: impl FnOnce(&mut Sub)) {
        let sub = self.subs.entry(type_url.to_string()).or_default();
        sub.nonce = nonce;
        holds(sub);
    }
}

/// One ADS stream: the shared part, and where its responses go.
struct AdsStream<R> {
    conn: Conn,
    tx: Tx<R>,
}

/// One ADS protocol over the shared stream loop.
trait Protocol: Send + 'static {
    type Request: prost::Message + Default + Send + 'static;
    fn on_request(&mut self, req: Self::Request) -> impl Future<Output = Result<(), End>> + Send;
    fn on_generation(&mut self) -> impl Future<Output = Result<(), End>> + Send;
}

/// Why a stream ends.
enum End {
    /// The gateway closed it or went away.
    Gone,
    Error(tonic::Status),
}

/// Serves one stream until the gateway leaves or the control plane stops: requests as they
/// come, and every newly published generation.
async fn run<R>(
    mut p: AdsStream<R>,
    mut inbound: tonic::Streaming<<AdsStream<R> as Protocol>::Request>,
    peer: Option<SocketAddr>,
) where
    AdsStream<R>: Protocol,
{
    let mut stopping = p.conn.cp.stopping.subscribe();
    let mut generation = p.conn.generation.clone();
    let end = loop {
        let step = tokio::select! {
            () = until_true(&mut stopping) => Err(End::Error(tonic::Status::unavailable("control plane stopping"))),
            msg = inbound.message() => match msg {
                Ok(Some(req)) => p.on_request(req).await,
                Ok(None) => Err(End::Gone),
                Err(status) => {
                    tracing::debug!(?peer, "ADS stream error: {status}");
                    Err(End::Gone)
                }
            },
            changed = generation.changed() => match changed {
                Ok(()) => p.on_generation().await,
                Err(_) => Err(End::Error(tonic::Status::unavailable("control plane stopping"))),
            },
        };
        if let Err(end) = step {
            break end;
        }
    };
    let id = p.conn.id();
    match end {
        End::Gone => tracing::info!(node = id, ?peer, "gateway disconnected"),
        End::Error(status) => {
            tracing::info!(node = id, ?peer, "closing ADS stream: {}", status.message());
            let _ = p.tx.send(Err(status)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------
// State of the world

type SotwStream = AdsStream<DiscoveryResponse>;

impl Protocol for SotwStream {
    type Request = DiscoveryRequest;

    async fn on_request(&mut self, req: DiscoveryRequest) -> Result<(), End> {
        self.conn.hello(req.node.as_ref()).await?;
        let type_url = req.type_url.as_str();
        if let Some(error) = &req.error_detail {
            self.conn
                .nack(type_url, &req.response_nonce, &error.message);
            return Ok(());
        }
        let names: BTreeSet<String> = req.resource_names.iter().cloned().collect();
        let stale =
            !req.response_nonce.is_empty() && !self.conn.is_current(type_url, &req.response_nonce);
        let send = match self.conn.subs.get_mut(type_url) {
            None => {
                if self.conn.served.xds.by_type(type_url).is_none() {
                    // Envoy accepts an empty answer and keeps waiting for the named resources
                    // (e.g. SDS secrets); silence would leave the type without an ACK.
                    tracing::debug!(
                        node = self.conn.id(),
                        type_url,
                        "type not served: answering empty"
                    );
                }
                self.conn.subs.insert(
                    type_url.to_string(),
                    Sub {
                        wildcard: is_wildcard(type_url),
                        names,
                        ..Sub::default()
                    },
                );
                true
            }
            Some(_) if stale => false,
            // An empty nonce on a known type: the gateway asks afresh (e.g. after it dropped
            // and re-added the subscription), so it gets the full current state.
            Some(sub) if req.response_nonce.is_empty() => {
                sub.names = names;
                true
            }
            // An ACK. Only the names can ask for something new; config changes are pushed
            // when they are published, not when acknowledged.
            Some(sub) => {
                let changed = !sub.wildcard && sub.names != names;
                sub.names = names;
                changed
            }
        };
        if send {
            let all = self.all(type_url);
            self.send(type_url, all.clone(), all).await?;
        }
        Ok(())
    }

    async fn on_generation(&mut self) -> Result<(), End> {
        for (type_url, wildcard, diff) in self.conn.changes().await? {
            let all = self.all(type_url);
            if wildcard {
                // A state-of-the-world response replaces the whole set of LDS and CDS.
                if !diff.changed.is_empty() || !diff.gone.is_empty() {
                    self.send(type_url, all.clone(), all).await?;
                }
            } else if !diff.changed.is_empty() {
                // RDS, EDS, SDS: a gateway keeps what a response leaves out, so only the
                // resources that changed (or appeared) travel, as istiod's incremental EDS.
                self.send(type_url, diff.changed, all).await?;
            }
        }
        Ok(())
    }
}

impl SotwStream {
    /// Every resource of `type_url` the subscription covers now.
    fn all(&self, type_url: &str) -> Vec<String> {
        self.conn
            .subs
            .get(type_url)
            .map(|s| {
                s.wanted(&self.conn.served, type_url)
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Sends the resources `names`; the gateway then holds `holds`.
    async fn send(
        &mut self,
        type_url: &str,
        names: Vec<String>,
        holds: Vec<String>,
    ) -> Result<(), End> {
        let served = self.conn.served.clone();
        let resources: Vec<Any> = names
            .iter()
            .filter_map(|n| served.resource(type_url, n).cloned())
            .collect();
        let nonce = next_nonce();
        let response = DiscoveryResponse {
            version_info: self.conn.version.clone(),
            resources,
            type_url: type_url.to_string(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        self.conn.sent(type_url, nonce, |sub| {
            sub.sent = holds
                .into_iter()
                .filter_map(|n| {
                    let v = served.version(type_url, &n)?.to_string();
                    Some((n, v))
                })
                .collect();
        });
        self.conn.cp.count_sent(type_url, response.resources.len());
        tracing::debug!(
            node = self.conn.id(),
            type_url,
            version = %response.version_info,
            resources = response.resources.len(),
            "push"
        );
        self.tx.send(Ok(response)).await.map_err(|_| End::Gone)
    }
}

// ---------------------------------------------------------------------------------------
// Incremental (delta)

type DeltaAdsStream = AdsStream<DeltaDiscoveryResponse>;

impl Protocol for DeltaAdsStream {
    type Request = DeltaDiscoveryRequest;

    async fn on_request(&mut self, req: DeltaDiscoveryRequest) -> Result<(), End> {
        self.conn.hello(req.node.as_ref()).await?;
        let type_url = req.type_url.clone();
        let acked =
            req.response_nonce.is_empty() || self.conn.is_current(&type_url, &req.response_nonce);
        if let Some(error) = &req.error_detail {
            if acked {
                self.conn
                    .nack(&type_url, &req.response_nonce, &error.message);
            }
        }
        // Subscription changes count even on a stale or rejecting request: they are
        // incremental, and the gateway does not send them again.
        let first = !self.conn.subs.contains_key(&type_url);
        let sub = self.conn.subs.entry(type_url.clone()).or_default();
        let asked = subscribe(sub, &req, first);
        let reply = if first {
            // The first request of a type (a new stream, or a reconnection reporting what the
            // gateway kept): everything that differs from what it holds.
            Some(sub.diff(&self.conn.served, &type_url))
        } else if asked.wildcard {
            Some(sub.diff(&self.conn.served, &type_url))
        } else if !asked.names.is_empty() {
            Some(newly_asked(&self.conn.served, sub, &type_url, &asked.names))
        } else {
            // An ACK, a NACK or an unsubscription: nothing new to send.
            None
        };
        if let Some(Diff { changed, mut gone }) = reply {
            if first && !sub.wildcard {
                // A name asked for that does not exist is said to be removed, as istiod says
                // it: the gateway stops waiting for it.
                let missing: Vec<String> = sub
                    .names
                    .iter()
                    .filter(|n| self.conn.served.version(&type_url, n).is_none())
                    .filter(|n| !gone.contains(n))
                    .cloned()
                    .collect();
                gone.extend(missing);
                gone.sort();
            }
            self.send(&type_url, changed, gone).await?;
        }
        Ok(())
    }

    async fn on_generation(&mut self) -> Result<(), End> {
        for (type_url, _, diff) in self.conn.changes().await? {
            if !diff.changed.is_empty() || !diff.gone.is_empty() {
                self.send(type_url, diff.changed, diff.gone).await?;
            }
        }
        Ok(())
    }
}

/// What a request newly subscribes to.
#[derive(Debug, Default)]
struct Asked {
    wildcard: bool,
    names: Vec<String>,
}

/// Applies a delta request's subscriptions to `sub`. On the first request of a type, an
/// empty subscription or `*` is the wildcard (LDS, CDS), and `initial_resource_versions` is
/// what the gateway kept from an earlier stream.
fn subscribe(sub: &mut Sub, req: &DeltaDiscoveryRequest, first: bool) -> Asked {
    let mut asked = Asked::default();
    if first {
        sub.wildcard = req.resource_names_subscribe.is_empty();
        sub.sent = req
            .initial_resource_versions
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
    }
    for name in &req.resource_names_subscribe {
        if name == "*" {
            asked.wildcard |= !sub.wildcard;
            sub.wildcard = true;
        } else if sub.names.insert(name.clone()) {
            asked.names.push(name.clone());
        }
    }
    for name in &req.resource_names_unsubscribe {
        if name == "*" {
            sub.wildcard = false;
        } else {
            sub.names.remove(name);
        }
    }
    if first && !sub.wildcard {
        // A reconnecting gateway still holds these: they stay subscribed.
        sub.names.extend(sub.sent.keys().cloned());
    }
    // The gateway forgets what it unsubscribed from by itself: no removal is sent for it.
    let Sub {
        sent,
        wildcard,
        names,
        ..
    } = sub;
    sent.retain(|n, _| *wildcard || names.contains(n));
    asked
}

/// The answer to names newly asked for: each one that exists (unless the gateway has it
/// already), the others as removed.
fn newly_asked(served: &Served, sub: &Sub, type_url: &str, names: &[String]) -> Diff {
    let mut diff = Diff::default();
    for n in names {
        match served.version(type_url, n) {
            Some(v) if sub.sent.get(n).map(String::as_str) == Some(v) => {}
            Some(_) => diff.changed.push(n.clone()),
            None => diff.gone.push(n.clone()),
        }
    }
    diff
}

impl DeltaAdsStream {
    /// Sends `changed` and `removed` of `type_url`. A cluster the gateway already had and
    /// gets again is rebuilt by it and waits for its endpoints, which it will not ask for
    /// again: they follow (envoyproxy/envoy#13009; istiod pushes EDS after CDS likewise).
    async fn send(
        &mut self,
        type_url: &str,
        changed: Vec<String>,
        removed: Vec<String>,
    ) -> Result<(), End> {
        let rebuilt: Vec<String> = if type_url == types::CLUSTER {
            let had = self.conn.subs.get(type_url).map(|s| &s.sent);
            changed
                .iter()
                .filter(|n| had.is_some_and(|h| h.contains_key(*n)))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        self.send_one(type_url, changed, removed).await?;
        if rebuilt.is_empty() {
            return Ok(());
        }
        let Some(eds) = self.conn.subs.get(types::ENDPOINT) else {
            return Ok(());
        };
        let again: Vec<String> = rebuilt
            .into_iter()
            .filter(|n| eds.sent.contains_key(n))
            .collect();
        if again.is_empty() {
            return Ok(());
        }
        self.send_one(types::ENDPOINT, again, Vec::new()).await
    }

    async fn send_one(
        &mut self,
        type_url: &str,
        changed: Vec<String>,
        removed: Vec<String>,
    ) -> Result<(), End> {
        let served = self.conn.served.clone();
        let resources: Vec<Resource> = changed
            .iter()
            .filter_map(|n| {
                Some(Resource {
                    name: n.clone(),
                    version: served.version(type_url, n)?.to_string(),
                    resource: Some(served.resource(type_url, n)?.clone()),
                    ..Default::default()
                })
            })
            .collect();
        let nonce = next_nonce();
        self.conn.sent(type_url, nonce.clone(), |sub| {
            for r in &resources {
                sub.sent.insert(r.name.clone(), r.version.clone());
            }
            for n in &removed {
                sub.sent.remove(n);
            }
        });
        self.conn.cp.count_sent(type_url, resources.len());
        // At info, as istiod logs its pushes: which names travel is what an operator checks.
        tracing::info!(
            node = self.conn.id(),
            version = %self.conn.version,
            "delta push {}: sent {:?}, removed {:?}",
            short_type(type_url),
            resources.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            removed
        );
        let response = DeltaDiscoveryResponse {
            system_version_info: self.conn.version.clone(),
            resources,
            type_url: type_url.to_string(),
            removed_resources: removed,
            nonce,
            ..Default::default()
        };
        self.tx.send(Ok(response)).await.map_err(|_| End::Gone)
    }
}

/// Resolves once `rx` holds true; the borrow guard is not `Send`, so it must not outlive this.
async fn until_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// LDS, RDS, CDS, EDS, SDS: istiod's short names, for logs.
fn short_type(type_url: &str) -> &str {
    match type_url {
        types::LISTENER => "LDS",
        types::ROUTE => "RDS",
        types::CLUSTER => "CDS",
        types::ENDPOINT => "EDS",
        types::SECRET => "SDS",
        other => other,
    }
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

/// A resource's version: a hash of its content in a canonical form. Its encoding will not
/// do: prost writes map fields (metadata, typed_per_filter_config) in HashMap order, which
/// differs between two translations of the same config; the proto-JSON with sorted keys is
/// the same. Stable across restarts, so a reconnecting gateway's versions still compare.
fn resource_version(any: &Any) -> String {
    let hash = match crate::protojson::any_to_json(any) {
        Ok(json) => {
            let mut text = String::new();
            canonical_json(&json, &mut text);
            xxhash_rust::xxh64::xxh64(text.as_bytes(), 0)
        }
        // A type the descriptor pool does not know: its bytes are the best there is.
        Err(_) => xxhash_rust::xxh64::xxh64(&any.value, 0),
    };
    format!("{hash:016x}")
}

/// JSON text with every object's keys sorted, whatever order the map held them in.
fn canonical_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value as J;
    match v {
        J::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&J::String(k.clone()).to_string());
                out.push(':');
                canonical_json(&m[k], out);
            }
            out.push('}');
        }
        J::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
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

#[cfg(test)]
#[path = "server_delta_tests.rs"]
mod delta_tests;
